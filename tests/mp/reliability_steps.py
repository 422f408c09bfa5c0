"""Ranks that disagree on how many times they step. Usage: reliability_steps.py MODE

  fewer        rank 1 runs 9 steps, rank 0 runs 10, then both flush()
  more         rank 1 runs 11 steps, rank 0 runs 10, then both flush()
  fewer-sync   as fewer, with width=1: rank 0 waits inside its 10th step() for a reduction that
               rank 1 never starts, so no flush() check can run; a timeout must end it
  no-backward  at step 5, rank 1 calls step() without a backward pass

Each rank prints ``RAISED rank<r> <error type> after <s> s: <message>`` (seconds spent in the
call that failed) and exits 1. The ranks ignore SIGTERM: when one rank exits, horovodrun
terminates the others at once, and this test wants to see what they report first (horovodrun
kills them 5 s later anyway).
"""
import signal
import sys
import time

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from reference import loss_fn, make_batches, make_model

signal.signal(signal.SIGTERM, signal.SIG_IGN)
mode = sys.argv[1]
hvd.init()
rank = hvd.rank()
steps = {"fewer": 9, "fewer-sync": 9, "more": 11}.get(mode, 10) if rank == 1 else 10
batches = make_batches(11, hvd.size())
model = make_model()
opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=model.named_parameters(), width=1 if mode == "fewer-sync" else 2,
                                compression="int8")
started = time.monotonic()
try:
    for t in range(steps):
        opt.zero_grad()
        if not (mode == "no-backward" and rank == 1 and t == 5):
            loss_fn(model, batches[t][rank]).backward()
        started = time.monotonic()
        opt.step()
    started = time.monotonic()
    opt.flush()
except Exception as exc:  # noqa: BLE001 - reported, then the rank fails
    print(f"RAISED rank{rank} {type(exc).__name__} after {time.monotonic() - started:.2f} s: {exc}", flush=True)
    sys.exit(1)
print(f"NO ERROR rank{rank}", flush=True)
