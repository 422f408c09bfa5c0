"""Rank 1 builds a different model: every rank must get a clear error naming the tensor, not hang."""
import sys

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd

hvd.init()
kind = sys.argv[1]
width = 3
if hvd.rank() == 1:
    width = {"shape": 4, "name": 3, "dtype": 3}[kind]
model = torch.nn.Sequential(torch.nn.Linear(2, width), torch.nn.Linear(width, 1))
named = list(model.named_parameters())
if hvd.rank() == 1 and kind == "name":
    named = [("renamed." + n, p) for n, p in named]
if hvd.rank() == 1 and kind == "dtype":
    model.double()
try:
    psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named)
except ValueError as exc:
    print(f"RAISED rank{hvd.rank()}: {exc}", flush=True)
    sys.exit(3)
print("no error", flush=True)
