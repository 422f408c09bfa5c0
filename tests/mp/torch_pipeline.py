"""Multi-process checks of the PyTorch DistributedOptimizer under horovodrun -np 2.

* width=1 equals horovod.torch.DistributedOptimizer bit for bit (SGD+momentum, Adam, 20 steps);
* width=2 equals the plain reference of the pipelined rule (also with warm-up 3 and with
  backward_passes_per_step=2), every rank with different batches;
* replicas are bitwise identical (digests gathered from every rank).
"""
import sys

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import assert_replicas_identical, passed
from reference import loss_fn, make_batches, make_model, reference_sgd

hvd.init()
rank, size = hvd.rank(), hvd.size()
STEPS, LR = 20, 0.1


def train(make_opt, steps=STEPS, passes=1, batches=None):
    model = make_model()
    opt = make_opt(model)
    for t in range(steps):
        opt.zero_grad()
        for k in range(passes):
            loss_fn(model, batches[t * passes + k][rank]).backward()
        opt.step()
    return model, opt


def check_width1_matches_horovod():
    batches = make_batches(STEPS, size)
    for label, make_inner in [("sgd-momentum", lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)),
                              ("adam", lambda m: torch.optim.Adam(m.parameters(), lr=0.01))]:
        theirs, _ = train(lambda m: hvd.DistributedOptimizer(make_inner(m), named_parameters=m.named_parameters()),
                          batches=batches)
        ours, _ = train(lambda m: psgd.DistributedOptimizer(make_inner(m), named_parameters=m.named_parameters(),
                                                            width=1), batches=batches)
        for (name, a), b in zip(theirs.named_parameters(), ours.parameters()):
            assert torch.equal(a, b), f"width=1 {label}: {name} differs from Horovod's by {(a - b).abs().max()}"
        assert_replicas_identical(ours.parameters(), f"width1-{label}")
        passed(f"width1-equals-horovod-{label}")


def check_width2_matches_reference(warmup=0, passes=1):
    batches = make_batches(STEPS * passes, size)
    model, opt = train(lambda m: psgd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=LR),
                                                           named_parameters=m.named_parameters(), width=2,
                                                           warmup_steps=warmup, backward_passes_per_step=passes),
                       passes=passes, batches=batches)
    if passes == 1:
        ref = reference_sgd(STEPS, size, 2, LR, warmup, batches=lambda t: batches[t])
    else:
        ref = reference_sgd(STEPS, size, 2, LR, warmup, passes,
                            batches=lambda t: [[batches[t * passes + k][r] for k in range(passes)] for r in range(size)])
    for (name, p), r in zip(model.named_parameters(), ref):
        assert torch.equal(p, r), f"width=2 warmup={warmup} passes={passes}: {name} off by {(p - r).abs().max()}"
    assert_replicas_identical(model.parameters(), f"width2-w{warmup}-p{passes}")
    passed(f"width2-reference-warmup{warmup}-passes{passes}")


checks = sys.argv[1:] or ["width1", "width2"]
if "width1" in checks:
    check_width1_matches_horovod()
if "width2" in checks:
    check_width2_matches_reference()
    check_width2_matches_reference(warmup=3)
    check_width2_matches_reference(passes=2)
