"""Rank 0, which serves the pipeline's store, freezes mid-training (issue 40).

Usage: frozen_store_host.py CODEC   (under horovodrun -np 2, with a short
PIPESGD_STALL_CHECK_TIME_SECONDS and PIPESGD_TIMEOUT)

Rank 0 trains 4 steps, then stops itself (SIGSTOP: alive, silent, as a hung host); rank 1 trains
on and waits for rank 0's share of the next step. Rank 1 must warn (the stall warning, naming
rank 0 and the status board it serves) and raise at PIPESGD_TIMEOUT; its process then ends, and
the launcher ends the frozen rank. Before issue 40 rank 1 printed nothing until the launcher
killed it (its board calls blocked on the frozen store: the warning and the error with them).
Prints ``RAISED rank1 <error> after <s> s: <message>``, and ``WAITS rank1 at <time>`` when its
failing step begins.
"""
import os
import signal
import sys
import time

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from reference import loss_fn, make_batches, make_model

codec = sys.argv[1]
hvd.init()
rank = hvd.rank()
batches = make_batches(8, hvd.size())
model = make_model()
opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                named_parameters=model.named_parameters(), compression=codec)
for t in range(8):
    if rank == 0 and t == 4:
        print(f"FREEZES rank0 at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    opt.zero_grad()
    loss_fn(model, batches[t][rank]).backward()
    started = time.monotonic()
    if t >= 4:
        print(f"WAITS rank{rank} at {time.time():.3f} step {t}", flush=True)
    try:
        opt.step()
    except Exception as exc:
        print(f"RAISED rank{rank} {type(exc).__name__} after {time.monotonic() - started:.1f} s: {exc}", flush=True)
        raise
print(f"UNEXPECTED rank{rank}: training ended with rank 0 frozen", flush=True)
