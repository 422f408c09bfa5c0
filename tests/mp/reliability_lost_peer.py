"""A peer lost in the middle of a pipelined (width 2), int8-compressed run. Usage: MODE

  kill    rank 1 SIGKILLs itself at step 15: rank 0 must raise PeerLostError (the transport sees
          the broken connection);
  freeze  rank 1 SIGSTOPs itself at step 15 (alive but silent, as a hung host): rank 0 must raise
          PeerLostError once PIPESGD_TIMEOUT passes, and its process must end;
  slow    rank 1 sleeps half of PIPESGD_TIMEOUT at step 15: no error, replicas equal.

Rank 0 prints ``RAISED rank0 PeerLostError after <s> s: ...`` with the seconds spent in the
step() call that failed, then exits 1. It ignores SIGTERM: when rank 1 dies, horovodrun
terminates the other ranks at once (the job ends either way); ignoring it lets the test see what
rank 0 reports first, as on a multi-host job where the launcher is slower (it SIGKILLs 5 s later).
"""
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import assert_replicas_identical, passed
from reference import loss_fn, make_batches, make_model

mode = sys.argv[1]
signal.signal(signal.SIGTERM, signal.SIG_IGN)
hvd.init()
rank = hvd.rank()
batches = make_batches(30, hvd.size())
model = make_model()
opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                named_parameters=model.named_parameters(), width=2, compression="int8")
for t in range(30):
    if rank == 1 and t == 15:
        print(f"rank1 {mode} at step {t}, wall clock {time.time():.3f}", flush=True)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:  # slow, not lost: half the timeout
            time.sleep(float(os.environ["PIPESGD_TIMEOUT"]) / 2)
    opt.zero_grad()
    loss_fn(model, batches[t][rank]).backward()
    started = time.monotonic()
    try:
        opt.step()
    except Exception as exc:  # noqa: BLE001 - reported, then the rank fails
        print(f"RAISED rank{rank} {type(exc).__name__} after {time.monotonic() - started:.2f} s: {exc}", flush=True)
        sys.exit(1)
    time.sleep(0.01)
opt.flush()
assert_replicas_identical(model.parameters(), "slow")
passed("slow-peer-is-not-lost")
