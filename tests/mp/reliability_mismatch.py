"""Rank 1 differs from rank 0 in one way at a time: every rank must get the same clear error,
naming the tensor or setting, and no rank may hang. One launch tries every kind in turn (each
check is one small allgather, and a failed one leaves no collective in flight).

Prints ``RAISED rank<r> <kind>: <message>`` for each kind; exits 1 if some kind raised nothing.
"""
import sys

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from reference import loss_fn, make_batches, make_model

hvd.init()
rank = hvd.rank()
odd = rank == 1


def build(kind):
    """(model, optimizer) for this rank; rank 1 differs by ``kind``."""
    model = make_model()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    kwargs = {}
    if odd and kind == "name":
        named = [("renamed." + n, p) for n, p in named]
    if odd and kind == "shape":
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        named, params = list(model.named_parameters()), list(model.parameters())
    if odd and kind == "dtype":
        model.double()
    if odd and kind == "count":
        model = torch.nn.Sequential(*make_model(), torch.nn.Tanh(), torch.nn.Linear(3, 3))
        named, params = list(model.named_parameters()), list(model.parameters())
    if odd and kind == "order":
        params = params[::-1]
    if odd and kind == "width":
        kwargs["width"] = 3
    if odd and kind == "compression":
        kwargs["compression"] = "int8"
    opt = psgd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=named, **kwargs)
    return model, opt


missing = []
batches = make_batches(1, hvd.size())
for kind in ["name", "shape", "dtype", "count", "order", "width", "compression", "requires_grad"]:
    try:
        model, opt = build(kind)
        if kind == "requires_grad":  # frozen on rank 1 only, before the first step
            if odd:
                model[2].bias.requires_grad_(False)
            loss_fn(model, batches[0][rank]).backward()
            opt.step()
    except ValueError as exc:
        print(f"RAISED rank{rank} {kind}: {exc}", flush=True)
        continue
    missing.append(kind)
    print(f"NO ERROR rank{rank} {kind}", flush=True)
sys.exit(1 if missing else 0)
