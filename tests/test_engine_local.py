"""The engine and the PyTorch adapter on N in-process ranks (threads over LocalWorld)."""
import re

import pytest
from dataclasses import replace
import torch

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.testing import LocalWorld
from reference import loss_fn, make_batches, make_model, reference_sgd
from threads import run_threads

STEPS, LR = 20, 0.1


def train(world, width, warmup=0, passes=1, compression=psgd.Compression.none, steps=STEPS, seed=0):
    batches = make_batches(steps * passes, world.size)

    def rank_fn(rank, comm):
        model = make_model(seed)
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                        named_parameters=model.named_parameters(), width=width,
                                        warmup_steps=warmup, backward_passes_per_step=passes,
                                        compression=compression, communicator=comm)
        for t in range(steps):
            opt.zero_grad()
            for k in range(passes):
                loss_fn(model, batches[t * passes + k][rank]).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()], opt

    return run_threads(world, rank_fn), batches


@pytest.mark.parametrize("width,warmup,passes", [(1, 0, 1), (2, 0, 1), (3, 0, 1), (2, 3, 1), (2, 0, 2)])
def test_update_rule_matches_plain_reference_bitwise(width, warmup, passes):
    world = LocalWorld(2, TORCH_OPS)
    results, batches = train(world, width, warmup, passes)
    if passes == 1:
        ref = reference_sgd(STEPS, 2, width, LR, warmup, batches=lambda t: batches[t])
    else:
        ref = reference_sgd(STEPS, 2, width, LR, warmup, passes,
                            batches=lambda t: [[batches[t * passes + k][r] for k in range(passes)] for r in range(2)])
    for (weights, _) in results:
        for w, r in zip(weights, ref):
            assert torch.equal(w, r)


def test_warmup_schedule_applies_nothing_at_the_first_pipelined_step():
    # warm-up 3: steps 0-2 apply their own mean gradient, step 3 applies nothing, t >= 4 applies t-1.
    world = LocalWorld(2, TORCH_OPS)
    batches = make_batches(6, 2)

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters(),
                                        width=2, warmup_steps=3, communicator=comm)
        changed = []
        for t in range(6):
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
            changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
        return changed

    for changed in run_threads(world, rank_fn):
        assert changed == [True, True, True, False, True, True]


def test_flush_applies_what_is_in_flight():
    world = LocalWorld(2, TORCH_OPS)
    results, batches = train(world, width=2, steps=5)
    for weights, opt in results:
        assert opt.engine.in_flight == 1
    flushed = run_threads(world, lambda rank, comm: (results[rank][1].flush(),
                                                     [p.detach().clone() for p in results[rank][1].optimizer.param_groups[0]["params"]]))
    # the rule run 5 steps, then the in-flight gradient (of step 4) applied
    ref = reference_sgd(5, 2, 2, LR, batches=lambda t: batches[t], flush=True)
    for count, weights in flushed:
        assert count == 1
        for w, r in zip(weights, ref):
            assert torch.equal(w, r)
    assert all(opt.engine.in_flight == 0 for _, opt in results)


def test_overlap_reduction_in_flight_during_next_backward():
    """The reduction of step t starts in step t's backward, is still in flight while step t+1's
    forward/backward run, and step t+1's step() is the first wait on it. (Step 0's start at its
    step(): a tensor set is checked across ranks before its first reduction, and a collective
    check cannot run inside a backward hook.)"""
    world = LocalWorld(2, TORCH_OPS)
    batches = make_batches(4, 2)

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters(),
                                        width=2, communicator=comm, fusion_threshold_mb=0)
        for t in range(4):
            world.record(rank, "forward", f"step{t}")
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            world.record(rank, "step", f"step{t}")
            opt.step()
        return opt.engine.config.name

    run_threads(world, rank_fn)
    reductions = re.compile(r"\.b\d+\.s\d+$")  # not the checks, which go through allgather_object
    events = [(what, name) for rank, what, name in world.events
              if rank == 0 and (reductions.search(name) or what in ("forward", "step"))]
    for t in range(3):
        fwd, step = events.index(("forward", f"step{t}")), events.index(("step", f"step{t}"))
        fwd_next, step_next = events.index(("forward", f"step{t + 1}")), events.index(("step", f"step{t + 1}"))
        started = [(i, n) for i, (w, n) in enumerate(events[:fwd_next]) if w == "start" and i > fwd]
        assert len(started) >= 2, "each bucket of step t is started in step t"
        if t > 0:
            assert all(i < step for i, _ in started), "reductions start during the backward pass, before step()"
        for i, name in started:
            first_wait = next(j for j, (w, n) in enumerate(events) if j > i and w == "wait" and n == name)
            assert first_wait > step_next, f"step {t}'s {name} was waited on before step {t + 1}'s step()"


def test_codec_runs_and_replicas_stay_identical_int8():
    world = LocalWorld(2, TORCH_OPS)
    results, _ = train(world, width=2, compression=psgd.Compression.int8)
    (w0, opt0), (w1, _) = results
    for a, b in zip(w0, w1):
        assert torch.equal(a, b)
    assert opt0.stats.ratio < 0.6  # tiny model: padding to even blocks weighs; the wire test uses big ones


def _train_recording_grads(compression, set_to_none, steps=6, copy_always=False):
    """2 in-process ranks, width 2; per applied step, rank 0's ``.grad`` objects and the data
    pointers of their storages, and the fusion buffers' storages; the weights after the last
    step (before the flush)."""
    world, batches = LocalWorld(2, TORCH_OPS), make_batches(steps, 2)

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                        named_parameters=model.named_parameters(), width=2,
                                        compression=compression, communicator=comm)
        if copy_always:  # what the adapter's write did before it took tensors over
            write = opt._adapter.write
            opt._adapter.write = lambda update: write(update if update is None else replace(update, owned=False))
        seen = []
        for t in range(steps):
            opt.zero_grad(set_to_none=set_to_none)
            loss_fn(model, batches[t][rank]).backward()
            before = [p.grad for p in model.parameters()]
            opt.step()
            if t >= 1:  # steps 1.. apply step t-1's average
                buffers = {b.untyped_storage().data_ptr() for bs in opt._core.engine._buffers.values() for b in bs}
                seen.append(([p.grad is g for p, g in zip(model.parameters(), before)],
                             {p.grad.untyped_storage().data_ptr() for p in model.parameters()}, buffers))
        weights = [p.detach().clone() for p in model.parameters()]
        opt.flush()
        return weights, seen

    return run_threads(world, rank_fn)


@pytest.mark.parametrize("codec", ["fp16", "int8", "int4"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_byte_codec_averages_become_the_gradients_without_a_copy(codec, set_to_none):
    # A byte codec's reduced bucket is a new tensor: .grad takes it over (set_), one storage per
    # bucket (the tiny model has one), never a fusion buffer, each .grad object kept.
    compression = getattr(psgd.Compression, codec)
    results = _train_recording_grads(compression, set_to_none)
    for same_objects, storages, buffers in results[0][1]:
        assert all(same_objects), ".grad keeps its identity, as with Horovod's in-place all-reduce"
        assert len(storages) == 1, f"the gradients were copied into {len(storages)} storages of their own"
        assert not storages & buffers, "a gradient aliases a fusion buffer the next steps refill"
    copied = _train_recording_grads(compression, set_to_none, copy_always=True)
    for (weights, _), (reference, _) in zip(results, copied):
        assert all(torch.equal(w, r) for w, r in zip(weights, reference)), "taking over changed the update"


def test_summable_averages_are_copied_out_of_the_fusion_buffers():
    # With none the all-reduce runs in the fusion buffer itself, refilled two steps later: .grad
    # must be a copy (views would change under the update when the buffer is refilled).
    (weights, seen), _ = _train_recording_grads(psgd.Compression.none, set_to_none=False)
    for same_objects, storages, buffers in seen:
        assert all(same_objects)
        assert not storages & buffers
    ref = reference_sgd(6, 2, 2, LR, 0, batches=lambda t: make_batches(6, 2)[t])
    assert all(torch.equal(w, r) for w, r in zip(weights, ref))
