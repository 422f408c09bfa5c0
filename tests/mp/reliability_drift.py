"""The replica drift guard on 2 ranks (horovodrun).

1. check_replicas_every=2 over 12 int8 steps while replicas agree: no error on any rank;
2. check_replicas_every=5; rank 1 alone nudges one weight at step 7: every rank raises
   ReplicaDriftError at step 10 naming that parameter. Prints ``RAISED rank<r> ...``, exits 1.
"""
import sys

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import passed
from pipesgd_hvd.pipeline.guards import ReplicaDriftError
from reference import loss_fn, make_batches, make_model

hvd.init()
rank = hvd.rank()
batches = make_batches(14, hvd.size())


def train(every, steps, corrupt_at=None):
    model = make_model()
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), width=2, compression="int8",
                                    check_replicas_every=every)
    for t in range(steps):
        if t == corrupt_at and rank == 1:
            with torch.no_grad():
                model[2].weight[1, 3] += 1e-7
        opt.zero_grad()
        loss_fn(model, batches[t][rank]).backward()
        opt.step()
    opt.flush()


train(every=2, steps=12)
passed("checks-pass-while-equal")
try:
    train(every=5, steps=14, corrupt_at=7)
except ReplicaDriftError as exc:
    print(f"RAISED rank{rank} ReplicaDriftError: {exc}", flush=True)
    sys.exit(1)
print(f"NO ERROR rank{rank}", flush=True)
