"""Several DistributedOptimizers in one process, as Horovod code has them (issue 17).

Usage: multi_optimizer.py WIDTH CODEC [SCENARIO ...]   (under horovodrun -np 2; default: all)

Scenarios, run in turn in one process (each prints ``PASS rank<r> <scenario>`` when the ranks end
with bitwise-equal replicas and the expected weights; the first failure prints
``RAISED rank<r> <scenario>: <error>`` and ends the run):

  per_class         one model, one DistributedOptimizer per optimizer class in turn (Horovod's
                    test_broadcast_state pattern), each flushed before the next is built
  per_class_noflush the same, the old optimizer dropped with its last step still in flight
  resume_rank0      Horovod's resume pattern: rank 0 saves, a new model and optimizer on every
                    rank, rank 0 alone loads the checkpoint, broadcast_parameters and
                    broadcast_optimizer_state; must equal the uninterrupted run
  two_models        two models of one class (identical parameter names) trained alternately,
                    each with its own optimizer; must equal the same run with names made unique
  same_names_shapes two models of different shapes whose parameter names coincide, alternately
  dropped           an optimizer garbage-collected with work in flight, then a new one over the
                    same model
"""
import gc
import sys
import time
import warnings

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import weights_digest
from reference import loss_fn, make_batches, make_model

WIDTH, CODEC = int(sys.argv[1]), sys.argv[2]
hvd.init()
rank, size = hvd.rank(), hvd.size()
BATCHES = make_batches(40, size)


def wrap(inner, named, width=WIDTH, codec=CODEC):
    return psgd.DistributedOptimizer(inner, named_parameters=named, width=width,
                                     compression=getattr(psgd.Compression, codec))


def train(model, opt, steps, start=0):
    for t in range(start, start + steps):
        opt.zero_grad()
        loss_fn(model, BATCHES[t % len(BATCHES)][rank]).backward()
        opt.step()
    return start + steps


def replicas_equal(tag, *models):
    digests = hvd.allgather_object(weights_digest(p for m in models for p in m.parameters()),
                                   name=f"mo.digest.{tag}")
    assert len(set(digests)) == 1, f"{tag}: replicas differ across ranks"


def same_weights(a, b, what):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{what}: {name} differs by {(p - q).abs().max().item():.3g}"


CLASSES = [lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), lambda ps: torch.optim.Adam(ps, lr=0.01),
           lambda ps: torch.optim.RMSprop(ps, lr=0.01), lambda ps: torch.optim.Adagrad(ps, lr=0.05)]


def per_class(flush_between):
    model, t = make_model(), 0
    for make in CLASSES:
        opt = wrap(make(model.parameters()), model.named_parameters())
        t = train(model, opt, 4, t)
        if flush_between:
            opt.flush()
    opt.flush()
    replicas_equal("per_class", model)


def resume_rank0():
    # uninterrupted: 10 steps
    full = make_model()
    opt = wrap(torch.optim.SGD(full.parameters(), lr=0.05, momentum=0.9), full.named_parameters())
    train(full, opt, 10)
    opt.flush()
    # interrupted at 5: rank 0 saves (Horovod's examples save on rank 0 only)
    model = make_model()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters())
    train(model, opt, 5)
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()} if rank == 0 else None
    del opt
    model = make_model(seed=7)  # a fresh process would build it anew; the broadcast fixes the weights
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters())
    if rank == 0:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    train(model, opt, 5, start=5)
    opt.flush()
    replicas_equal("resume_rank0", model)
    if CODEC == "none":  # error feedback residuals are per rank: exact only without them
        same_weights(model, full, "resumed (rank 0 loaded) vs uninterrupted")


def alternate(a, b, opt_a, opt_b, rounds=8):
    for t in range(rounds):
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            loss_fn(model, BATCHES[t][rank]).backward()
            opt.step()
    opt_a.flush()
    opt_b.flush()


def two_models():
    def run(prefix_a, prefix_b):
        a, b = make_model(1), make_model(2)
        opt_a = wrap(torch.optim.SGD(a.parameters(), lr=0.05), [(prefix_a + n, p) for n, p in a.named_parameters()])
        opt_b = wrap(torch.optim.SGD(b.parameters(), lr=0.05), [(prefix_b + n, p) for n, p in b.named_parameters()])
        alternate(a, b, opt_a, opt_b)
        return a, b

    ua, ub = run("a.", "b.")  # unique names: the expected result
    sa, sb = run("", "")      # model.named_parameters() of two instances of one class
    replicas_equal("two_models", sa, sb)
    same_weights(sa, ua, "model A, identical names vs unique names")
    same_weights(sb, ub, "model B, identical names vs unique names")


def same_names_shapes():
    def other():
        m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        torch.manual_seed(3)
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.3)
        return m

    def run(prefix):
        a, b = make_model(1), other()
        opt_a = wrap(torch.optim.SGD(a.parameters(), lr=0.05), a.named_parameters())
        opt_b = wrap(torch.optim.SGD(b.parameters(), lr=0.05), [(prefix + n, p) for n, p in b.named_parameters()])
        alternate(a, b, opt_a, opt_b)
        return a, b

    ua, ub = run("b.")
    sa, sb = run("")
    replicas_equal("same_names_shapes", sa, sb)
    same_weights(sa, ua, "model A")
    same_weights(sb, ub, "model B")


def dropped():
    model = make_model()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters())
    train(model, opt, 3)
    in_flight = opt.engine.in_flight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del opt
        gc.collect()
    # Horovod keeps each op's tensors until synchronize(): poll until the dropped optimizer's are
    # waited for (at most 10 s, or they never will be)
    deadline = time.monotonic() + 10.0
    while hvd.mpi_ops._handle_map and time.monotonic() < deadline:
        time.sleep(0.05)
    unwaited = len(hvd.mpi_ops._handle_map)
    print(f"INFO rank{rank} dropped: {in_flight} step(s) were in flight; warnings at drop: "
          f"{[str(w.message)[:120] for w in caught]}; Horovod handles never waited for: {unwaited}", flush=True)
    # Nothing computed is lost silently: dropping work in flight at least warns (docs/migrating.md,
    # "several optimizers in one process"), and
    # leaves no Horovod op unwaited (Horovod keeps its tensors in _handle_map until synchronize()).
    assert in_flight == 0 or caught, f"an optimizer with {in_flight} step(s) in flight was dropped without a word"
    assert unwaited == 0, f"{unwaited} Horovod op(s) of the dropped optimizer were never waited for (buffers leak)"
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters())
    train(model, opt, 3, start=3)
    opt.flush()
    replicas_equal("dropped", model)


RUN = {"per_class": lambda: per_class(True), "per_class_noflush": lambda: per_class(False),
       "resume_rank0": resume_rank0, "two_models": two_models, "same_names_shapes": same_names_shapes,
       "dropped": dropped}
for scenario in sys.argv[3:] or list(RUN):
    try:
        RUN[scenario]()
    except Exception as exc:
        print(f"RAISED rank{rank} {scenario}: {type(exc).__name__}: {exc}", flush=True)
        raise
    print(f"PASS rank{rank} {scenario}", flush=True)
