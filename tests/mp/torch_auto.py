"""width="auto" / compression="auto" on real ranks under horovodrun -np 2.

* measured: real timings (which differ per rank); every rank makes the same decisions at the same
  steps (histories gathered and compared) and the replicas stay bitwise identical;
* scripted: each rank gets different injected numbers (a fake clock and probe) whose maxima
  mean width 2 uncompressed: the run equals the reference rule (4 synchronous steps, then
  pipelined) bit for bit; and a re-check that switches int8 -> none over Horovod keeps the
  replicas identical.
"""
import sys

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import assert_replicas_identical, passed
from reference import loss_fn, make_batches, make_model, reference_sgd
from scripted_timing import FakeClock, ScriptedProbe

hvd.init()
rank, size = hvd.rank(), hvd.size()
LR = 0.1


def train(steps, batches, compute_s=None, allreduce_s=None, flush=True, **kw):
    model = make_model()
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                    named_parameters=model.named_parameters(), width="auto", compression="auto", **kw)
    clock = None
    if compute_s is not None:
        clock = opt.auto_controller.clock = FakeClock()
        opt.auto_controller.probe = ScriptedProbe(allreduce_s)
    trace = []
    for t in range(steps):
        opt.zero_grad()
        loss_fn(model, batches[t][rank]).backward()
        if clock is not None:
            clock.now += compute_s
        trace.append((opt.engine.step, opt.engine.config.width, opt.engine.codec.name))
        opt.step()
    if flush:
        opt.flush()
    history = [(r.step, r.decision.width, r.decision.compression, r.decision.reason)
               for r in opt.auto_controller.history]
    return model, opt, trace, history


def same_everywhere(value, what):
    everyone = hvd.allgather_object(value, name=f"auto.{what}")
    assert all(v == everyone[0] for v in everyone), f"{what} differs across ranks: {everyone}"


def check_measured():
    steps = 14
    model, opt, trace, history = train(steps, make_batches(steps, size), auto_measure_steps=4, auto_recheck_every=5)
    assert [h[0] for h in history] == [4, 9, 14], history
    same_everywhere((trace, history), "measured")
    assert_replicas_identical(model.parameters(), "auto-measured")
    if rank == 0:
        print("AUTO", opt.auto_decision.describe(), flush=True)
    passed("auto-measured-identical")


def check_scripted_matches_reference():
    steps, batches = 12, make_batches(12, size)
    # rank 0: 100 ms compute, 90 ms all-reduce; rank 1 alone would stay synchronous (50 ms, 3 ms)
    compute, allreduce = [(0.100, [0.090]), (0.050, [0.003])][rank]
    model, opt, trace, history = train(steps, batches, compute, allreduce, flush=False,
                                       auto_measure_steps=4, auto_recheck_every=0)
    assert [h[:3] for h in history] == [(4, 2, "none")], history
    assert [w for _, w, _ in trace] == [1] * 4 + [2] * 8, trace
    ref = reference_sgd(steps, size, 2, LR, warmup=4, batches=lambda t: batches[t])
    for (name, p), r in zip(model.named_parameters(), ref):
        assert torch.equal(p, r), f"auto (2, none): {name} off by {(p - r).abs().max()}"
    opt.flush()
    assert_replicas_identical(model.parameters(), "auto-scripted")
    passed("auto-scripted-equals-reference")


def check_recheck_switches_codec():
    steps = 12
    # compute 110 ms; 400 ms needs int8, then 60 ms pipelines uncompressed (rank 1 sees less)
    allreduce = [[0.400, 0.060], [0.100, 0.010]][rank]
    model, opt, trace, history = train(steps, make_batches(steps, size), 0.110, allreduce,
                                       auto_measure_steps=3, auto_recheck_every=4)
    assert [h[:3] for h in history] == [(3, 2, "int8"), (7, 2, "none"), (11, 2, "none")], history
    assert [c for _, _, c in trace] == ["none"] * 3 + ["int8+ef"] * 4 + ["none"] * 5, trace
    same_everywhere(trace, "recheck")
    assert_replicas_identical(model.parameters(), "auto-recheck")
    passed("auto-recheck-switches-codec")


checks = sys.argv[1:] or ["measured", "scripted", "recheck"]
if "measured" in checks:
    check_measured()
if "scripted" in checks:
    check_scripted_matches_reference()
if "recheck" in checks:
    check_recheck_switches_codec()
