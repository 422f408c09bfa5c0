"""width="auto" / compression="auto" on in-process ranks, with injected timings.

Each rank gets a fake clock (the test advances it by that rank's "compute" before every step, so
the time outside the optimizer's waits is exactly that) and a scripted probe (its all-reduce time
at each check, its codec costs). The ranks are given different numbers on purpose: the decision
must come from the slowest rank's (the maxima), so it is the same everywhere.
"""
import copy
import logging

import numpy as np
import pytest
import torch

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.auto.controller import AutoController, AutoSettings, TimingProbe
from pipesgd_hvd.auto.rule import Measurements, decide_fixed
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.ops.numpy import NUMPY_OPS
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.pipeline.engine import AppliedStep
from pipesgd_hvd.pipeline.fusion import TensorSpec
from pipesgd_hvd.testing import LocalWorld
from reference import loss_fn, make_batches, make_model, mean_gradient
from scripted_timing import FakeClock, ScriptedProbe
from threads import run_threads

MB = 2**20
LR = 0.1


def train(steps, compute_ms, allreduce_ms, codec_ms=None, flush=True, **kw):
    """2 ranks; rank r computes compute_ms[r] per step, measures allreduce_ms[r][check] and the
    codec costs codec_ms (a dict, or one per rank).
    Returns per rank (weights, optimizer, [(step, width, codec name) that reduced each step])."""
    world, batches = LocalWorld(2, TORCH_OPS), make_batches(steps, 2)

    def rank_fn(rank, comm):
        model = make_model()
        kw.setdefault("width", "auto")
        kw.setdefault("compression", "auto")
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                        named_parameters=model.named_parameters(), communicator=comm, **kw)
        clock = FakeClock()
        opt.auto_controller.clock = clock
        codecs = codec_ms[rank] if isinstance(codec_ms, list) else codec_ms or {}
        opt.auto_controller.probe = ScriptedProbe([ms / 1e3 for ms in allreduce_ms[rank]],
                                                  {k: v / 1e3 for k, v in codecs.items()})
        trace = []
        for t in range(steps):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            clock.now += compute_ms[rank] / 1e3
            # the engine that reduces step t (error feedback is part of int8/int4)
            trace.append((opt.engine.step, opt.engine.config.width, opt.engine.codec.name.replace("+ef", "")))
            opt.step()
        if flush:
            opt.flush()
        return [p.detach().clone() for p in model.parameters()], opt, trace

    return run_threads(world, rank_fn)


def assert_replicas_equal(results):
    (w0, _, _), (w1, _, _) = results
    assert all(torch.equal(a, b) for a, b in zip(w0, w1)), "replicas differ"


@pytest.mark.parametrize("compute_ms, allreduce_ms, codec_ms, expected, timed", [
    # rank 1 alone would stay synchronous (3 ms << 100 ms): the slowest rank's 90 ms decides;
    # none's step (100 ms) is compute alone: no codec can beat it, none is timed
    ([100, 100], [[90], [3]], None, (2, "none"), ["none"]),
    ([100, 90], [[4], [2]], None, (1, "none"), ["none"]),
    ([100, 100], [[50], [200]], None, (2, "fp16"), ["none", "fp16"]),
    # the compute maximum matters too: with rank 1's 60 ms alone int8 would not fit
    ([60, 110], [[400], [400]], None, (2, "int8"), ["none", "fp16", "int8"]),
    ([100, 100], [[800], [10]], None, (2, "int4"), ["none", "fp16", "int8", "int4"]),
    # codec costs are maxima over ranks as well: int8 (100.8 + 30 ms) is no longer within 10% of
    # int4's step (110 ms), so int4 (cheap) wins
    ([110, 110], [[400], [400]], [{"int8": 60.0}, {"int8": 1.0}], (2, "int4"), ["none", "fp16", "int8", "int4"]),
])
def test_each_branch_is_chosen_from_the_slowest_ranks_numbers_on_every_rank(compute_ms, allreduce_ms,
                                                                             codec_ms, expected, timed):
    results = train(8, compute_ms, allreduce_ms, codec_ms, auto_measure_steps=4, auto_recheck_every=0)
    for rank, (_, opt, trace) in enumerate(results):
        d = opt.auto_decision
        assert (d.width, d.compression) == expected, f"rank {rank}: {d.describe()}"
        # measuring: synchronous, uncompressed; from step 4 on, the choice, on every rank
        assert trace[:4] == [(t, 1, "none") for t in range(4)]
        assert all(cfg[1:] == expected for cfg in trace[4:]), trace
        m = opt.auto_controller.history[0].measurements
        assert m.compute_s == pytest.approx(max(compute_ms) / 1e3)
        assert m.allreduce_s == pytest.approx(max(a[0] for a in allreduce_ms) / 1e3)
        assert m.gradient_bytes == 4 * sum(p.numel() for p in make_model().parameters())
        # the same collectives on every rank: the loop stops on the gathered (slowest) numbers
        assert opt.auto_controller.probe.timed == [timed] and list(m.reduction_s) == timed
    assert results[0][1].auto_decision == results[1][1].auto_decision
    assert_replicas_equal(results)


def reference_with_switches(steps, width_from, flush_after):
    """Plain SGD under the pipelined rule where step t ends with width ``width_from(t)``, and at the
    end of each step in ``flush_after`` everything in flight is applied at once."""
    model, batches = make_model(), make_batches(steps, 2)
    params, pending = list(model.parameters()), []
    for t in range(steps):
        pending.append(mean_gradient(model, batches[t]))
        while len(pending) >= width_from(t) or (t in flush_after and pending):
            with torch.no_grad():
                for p, g in zip(params, pending.pop(0)):
                    p.add_(g, alpha=-LR)
    return [p.detach().clone() for p in params]


def test_rechecks_switch_at_the_same_step_and_training_follows_the_rule_bitwise():
    # compute 100 ms; all-reduce at the checks after steps 3, 7, 11: 90 ms (pipeline),
    # 2 ms (synchronous again), 60 ms (pipeline again)
    results = train(14, [100, 100], [[90, 2, 60], [90, 1, 30]], auto_measure_steps=3, auto_recheck_every=4)
    for _, opt, trace in results:
        history = [(r.step, r.decision.width, r.decision.compression) for r in opt.auto_controller.history]
        assert history == [(3, 2, "none"), (7, 1, "none"), (11, 2, "none")]
        assert [w for _, w, _ in trace] == [1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1, 2, 2, 2]
    assert_replicas_equal(results)
    # each check flushes (steps 2, 6, 10 end with everything applied), then the new width holds
    expected = reference_with_switches(14, lambda t: 1 if t < 3 or 7 <= t < 11 else 2, flush_after={2, 6, 10, 13})
    for p, r in zip(results[0][0], expected):
        assert torch.equal(p, r), (p - r).abs().max()


def test_a_recheck_changes_the_codec_on_every_rank():
    # compute 110 ms; 400 ms all-reduce needs int8, then the link frees up: 150 ms -> fp16
    results = train(12, [110, 110], [[400, 150], [400, 150]], auto_measure_steps=3, auto_recheck_every=5)
    for _, opt, trace in results:
        assert [(r.step, r.decision.compression) for r in opt.auto_controller.history] == [(3, "int8"), (8, "fp16")]
        assert [c for _, _, c in trace] == ["none"] * 3 + ["int8"] * 5 + ["fp16"] * 4
        assert opt.engine.step == 12
    assert_replicas_equal(results)


def test_one_of_the_two_fixed_stays_as_given():
    # width fixed at 2: the codec is chosen (int8); measuring still runs synchronously first
    results = train(7, [110, 110], [[400], [400]], width=2, auto_measure_steps=3, auto_recheck_every=0)
    for _, opt, trace in results:
        assert [cfg[1:] for cfg in trace] == [(1, "none")] * 3 + [(2, "int8")] * 4
    assert_replicas_equal(results)
    # the codec fixed: it runs from the start; only the width is chosen
    for allreduce, width in [(300, 2), (4, 1)]:
        results = train(6, [100, 100], [[allreduce], [allreduce]], compression=psgd.Compression.int8,
                        auto_measure_steps=3, auto_recheck_every=0)
        for _, opt, trace in results:
            assert [cfg[1:] for cfg in trace] == [(1, "int8")] * 3 + [(width, "int8")] * 3
            assert opt.auto_decision.compression == "int8"
        assert_replicas_equal(results)


def test_decision_is_logged_on_rank_0_with_the_numbers(caplog):
    with caplog.at_level(logging.INFO, logger="pipesgd_hvd.auto.rule"):
        train(5, [100, 100], [[200], [200]], auto_measure_steps=3, auto_recheck_every=0)
    lines = [r.getMessage() for r in caplog.records if r.name == "pipesgd_hvd.auto.rule"]
    assert len(lines) == 1, lines  # rank 0 only
    assert "width=2 compression=fp16" in lines[0] and "compute 100.0 ms/step" in lines[0]
    assert "all-reduce" in lines[0] and "200.0 ms" in lines[0]


def test_checkpoint_after_a_switch_resumes_with_that_configuration():
    steps, world, batches = 10, LocalWorld(2, TORCH_OPS), make_batches(10, 2)

    def run(rank, comm, opt, model, start, stop, clock):
        for t in range(start, stop):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            clock.now += 0.110
            opt.step()

    def rank_fn(rank, comm):
        def build():
            model = make_model()
            opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), communicator=comm,
                                            named_parameters=model.named_parameters(), width="auto",
                                            compression="auto", auto_measure_steps=3, auto_recheck_every=0)
            opt.auto_controller.clock, opt.auto_controller.probe = FakeClock(), ScriptedProbe([0.4])
            return model, opt

        model, opt = build()
        run(rank, comm, opt, model, 0, 6, opt.auto_controller.clock)
        saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        run(rank, comm, opt, model, 6, steps, opt.auto_controller.clock)
        opt.flush()
        straight = [p.detach().clone() for p in model.parameters()]

        model, opt = build()
        model.load_state_dict(saved_model)
        opt.load_state_dict(saved_opt)
        assert (opt.engine.config.width, opt.engine.codec.name, opt.engine.step) == (2, "int8+ef", 6)
        run(rank, comm, opt, model, 6, steps, opt.auto_controller.clock)
        opt.flush()
        return straight, [p.detach().clone() for p in model.parameters()]

    for straight, resumed in run_threads(world, rank_fn):
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_arguments_are_checked_before_any_collective():
    model = make_model()
    comm = LocalWorld(1, TORCH_OPS).communicator(0)
    make = lambda **kw: psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),  # noqa: E731
                                                  named_parameters=model.named_parameters(), communicator=comm, **kw)
    with pytest.raises(ValueError, match="auto_measure_steps"):
        make(width="auto", auto_measure_steps=1)
    with pytest.raises(ValueError, match="auto_recheck_every"):
        make(compression="auto", auto_recheck_every=-1)
    with pytest.raises(ValueError, match="width"):
        make(width=0, compression="auto")
    with pytest.raises(ValueError, match="unknown compression"):
        make(width="auto", compression="int3")
    assert AutoSettings.from_arguments(2, "int8") is None and make(width=2).auto_decision is None


def test_decide_fixed_keeps_what_is_fixed():
    m = Measurements(ranks=2, gradient_bytes=100 * MB, compute_s=0.1, allreduce_s=0.2, codec_s={})
    assert (decide_fixed(m, width=1).width, decide_fixed(m, width=1).compression) == (1, "fp16")
    d = decide_fixed(m, compression="int8")  # 200 ms * 0.252 = 50 ms: over 5% of compute
    assert (d.width, d.compression) == (2, "int8")
    tiny = Measurements(ranks=2, gradient_bytes=100 * MB, compute_s=0.1, allreduce_s=0.012, codec_s={})
    assert decide_fixed(tiny, compression="int8").width == 1       # 12 ms * 0.252 = 3 ms < 5 ms
    assert decide_fixed(tiny, compression="horovod:x").width == 2  # unknown codec: counted as float32


class StubEngine:
    """What the controller reads of an engine: the step count, the specs, flush()."""

    def __init__(self, numel):
        self.step, self.specs, self.flushes = 0, [TensorSpec("w", (numel,), "float32")], 0

    def flush(self):
        self.flushes += 1
        return []


def test_compute_is_the_time_outside_the_reduction_waits_framework_free():
    # numpy ops and a stub engine: nothing of PyTorch (the Keras adapter can drive it the same way)
    clock, engine, rebuilt = FakeClock(), StubEngine(256), []
    controller = AutoController(AutoSettings.from_arguments("auto", "auto", 4, 3),
                                LocalWorld(1, NUMPY_OPS).communicator(0), NUMPY_OPS, rebuild=lambda w, c, h: rebuilt.append((w, c)),
                                probe=ScriptedProbe([0.2]), clock=clock)
    computes = [5.0, 0.1, 0.3, 0.2, 0.5, 0.6, 0.7]  # the first step (no previous end) is not counted
    for t, compute in enumerate(computes):
        clock.now += compute
        controller.reduction_started()
        clock.now += 0.5  # blocked in our reduction: not compute
        engine.step += 1
        assert controller.after_step(engine, [AppliedStep(t, {0: np.full(256, 1.0, np.float32)})]) == []
    first, second = controller.history
    assert (first.step, second.step, engine.flushes) == (4, 7, 2)
    assert first.measurements.compute_s == pytest.approx(0.2)   # median of 0.1, 0.3, 0.2
    assert second.measurements.compute_s == pytest.approx(0.6)  # only the steps since the last check
    assert first.measurements.gradient_bytes == 1024 and rebuilt == []  # one rank: stays synchronous


def test_timing_probe_times_the_real_reduction_of_every_candidate_codec():
    probe, flat = TimingProbe(), np.linspace(-1, 1, 5000, dtype=np.float32)
    world = LocalWorld(1, NUMPY_OPS)
    seconds, cpu = probe.reduction(world.communicator(0), NUMPY_OPS, resolve_compression("none"), flat.copy())
    assert seconds >= 0.0 and cpu >= 0.0
    assert [e[1] for e in world.events if e[0] == 0 and e[1] == "done"] == ["done"] * 4  # warm-up + 3
    int8 = resolve_compression("int8")
    for name in ("fp16", "int8", "int4"):
        seconds, cpu = probe.reduction(world.communicator(0), NUMPY_OPS, int8 if name == "int8" else
                                       resolve_compression(name), flat.copy())
        assert seconds > 0.0 and cpu >= 0.0
    assert not int8.state_dict()["residuals"], "the probe must not touch the pipeline's error feedback"


def test_a_fixed_codec_is_timed_with_the_float32_all_reduce_only():
    results = train(6, [100, 100], [[400], [400]], compression="int8", auto_measure_steps=4, auto_recheck_every=0)
    for _, opt, _ in results:
        assert opt.auto_controller.probe.timed == [["none", "int8"]]
        assert (opt.auto_decision.width, opt.auto_decision.compression) == (2, "int8")
