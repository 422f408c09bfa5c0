"""A rank that sleeps mid-training (issue 32): the waiting rank's stall warning names it.

Usage: reliability_stall.py CODEC SLEEP_S   (under horovodrun -np 2, with a short
PIPESGD_STALL_CHECK_TIME_SECONDS: the default is 60 s, as Horovod's)

Both ranks train 8 steps at width 2; rank 1 sleeps SLEEP_S seconds after step 3 (evaluating
alone, say). Training must complete with equal replicas (a stall is not an error); the warning
is checked by the test. Prints ``PASS rank<r> stall-<codec>``.
"""
import sys
import time

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import assert_replicas_identical, passed
from reference import loss_fn, make_batches, make_model

codec, sleep_s = sys.argv[1], float(sys.argv[2])
hvd.init()
rank = hvd.rank()
batches = make_batches(8, hvd.size())
model = make_model()
opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                named_parameters=model.named_parameters(), compression=codec)
for t in range(8):
    opt.zero_grad()
    loss_fn(model, batches[t][rank]).backward()
    opt.step()
    if rank == 1 and t == 3:
        print(f"SLEEPS rank1 at {time.time():.3f}", flush=True)
        time.sleep(sleep_s)  # the line the warning names
opt.flush()
assert_replicas_identical(model.parameters(), "stall")
passed(f"stall-{codec}")
