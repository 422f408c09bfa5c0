"""staleness_correction="split_batch" composes with what plain pipelining does (issue 39): the auto
mode (which then chooses between synchronous pairs and the accurate mode, and never pipelines
Adam's kin without it), a GradScaler (loss scales that change between the two calls of an update,
and a skipped step), and hierarchical reductions; in-process ranks, against the reference rule
of test_split_batch.py where the arithmetic allows it (bitwise)."""
import pytest
import torch

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.auto.rule import Measurements, decide_fixed, pipelined_step
from pipesgd_hvd.testing import LocalWorld
from pipesgd_hvd.testing import LocalCluster
from pipesgd_hvd.ops.torch import TORCH_OPS
from reference import loss_fn, make_batches, make_model
from scripted_timing import FakeClock, ScriptedProbe
from test_split_batch import assert_same, reference, sgd
from threads import run_rank_threads, run_threads


# --------------------------------------------------------------------------------- auto mode
def test_the_auto_width_times_an_update_of_two_calls_and_switches_to_the_accurate_mode():
    """The first auto_measure_steps updates are synchronous pairs; the check (comm 4x an update's
    compute) switches to width 2, and the run is the reference rule with that many warm-up updates."""
    calls, measure = 14, 3
    world, batches = LocalWorld(2, TORCH_OPS), make_batches(calls, 2)

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=comm, staleness_correction="split_batch", width="auto",
                                        auto_measure_steps=measure, auto_recheck_every=0)
        clock = FakeClock()
        opt.auto_controller.clock, opt.auto_controller.probe = clock, ScriptedProbe([0.8])
        for t in range(calls):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            clock.now += 0.1  # per call: an update computes 0.2 s
            opt.step()
        opt.flush()
        decision = opt.auto_decision
        return [p.detach().clone() for p in model.parameters()], decision

    (w0, decision), (w1, _) = run_threads(world, rank_fn)
    assert decision.width == 2 and decision.compression == "none"
    assert decision.predicted_s["none"] == pytest.approx(max(0.1, 0.8) + 0.1)  # max((1-f) c, AR) + f c
    assert_same(w0, reference(sgd, batches, calls, 2, warmup=measure))
    assert_same(w1, w0)


def test_the_accurate_mode_s_step_hides_its_reduction_behind_the_look_ahead_part_only():
    m = Measurements(ranks=2, gradient_bytes=4 << 20, compute_s=0.2, allreduce_s=0.05, fresh_fraction=0.5)
    assert pipelined_step(m, "none") == pytest.approx(0.1 + 0.1)  # hidden behind the 0.1 s look-ahead part
    m = Measurements(ranks=2, gradient_bytes=4 << 20, compute_s=0.2, allreduce_s=0.3, fresh_fraction=0.5)
    assert pipelined_step(m, "none") == pytest.approx(0.3 + 0.1)


@pytest.mark.parametrize("compression", [None, "none"], ids=["codec-auto", "codec-fixed"])
def test_auto_never_pipelines_adam_s_kin_without_the_accurate_mode(compression):
    """However slow the link: synchronous (docs/accuracy.md: a whole stale gradient costs AdamW
    +21% perplexity, more than any codec)."""
    m = Measurements(ranks=2, gradient_bytes=4 << 20, compute_s=0.1, allreduce_s=2.0)
    assert decide_fixed(m, compression=compression).width == 2
    assert decide_fixed(m, compression=compression, pipelining=False).width == 1


def test_an_adamw_with_width_auto_stays_synchronous_through_the_optimizer():
    world, batches = LocalWorld(2, TORCH_OPS), make_batches(6, 2)

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters(), communicator=comm,
                                        width="auto", auto_measure_steps=2, auto_recheck_every=0)
        clock = FakeClock()
        opt.auto_controller.clock, opt.auto_controller.probe = clock, ScriptedProbe([2.0])
        for t in range(6):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            clock.now += 0.1
            opt.step()
        return opt.auto_decision

    for decision in run_threads(world, rank_fn):
        assert decision.width == 1, decision.describe()


# --------------------------------------------------------------------------------- GradScaler
def _train_scaled(calls, growth_interval, overflow_at=None):
    """Horovod's AMP pattern with torch.amp.GradScaler on the CPU. Scales are powers of two, so
    scaling and unscaling are exact: the result is the unscaled rule's, bit for bit, if part A
    is rescaled to part B's scale when the scaler changed it in between."""
    world, batches = LocalWorld(2, TORCH_OPS), make_batches(calls, 2)

    def rank_fn(rank, comm):
        model = make_model()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=growth_interval)
        opt = psgd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=comm, staleness_correction="split_batch", grad_scaler=scaler)
        scales = []
        for t in range(calls):
            opt.zero_grad()
            loss = loss_fn(model, batches[t][rank])
            if t == overflow_at and rank == 1:  # this rank's gradient overflows
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            opt.synchronize()
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        opt.flush()
        return [p.detach().clone() for p in model.parameters()], scales

    return run_threads(world, rank_fn), batches


def test_a_grad_scaler_whose_scale_changes_between_the_two_calls_trains_as_the_unscaled_rule():
    results, batches = _train_scaled(12, growth_interval=1)
    (w0, scales), (w1, _) = results
    assert scales[0] != scales[1], "the scale must change between the calls of a pair for this test to mean anything"
    assert_same(w0, reference(sgd, batches, 12, 2))
    assert_same(w1, w0)


def test_an_overflow_in_one_rank_s_part_skips_the_update_on_every_rank_and_training_goes_on():
    """Rank 1's part B overflows: its look-ahead steps with zeros (its scaler must not skip alone:
    the ranks' scales would part), the overflow rides in the all-reduce, and at the next call
    every rank's scaler skips the real step and lowers the scale alike."""
    results, _ = _train_scaled(12, growth_interval=1000, overflow_at=5)
    (w0, scales0), (w1, scales1) = results
    assert scales0 == scales1, "the ranks' loss scales parted"
    assert scales0[5] == scales0[4] and scales0[6] < scales0[5], "the real step after the overflow was skipped"
    assert all(torch.isfinite(w).all() for w in w0)
    assert_same(w1, w0)


# ------------------------------------------------------------------------------- hierarchical
def test_hierarchical_int8_keeps_the_replicas_identical():
    cluster = LocalCluster(2, 2, TORCH_OPS)
    batches = make_batches(9, cluster.size)

    def rank_fn(rank):
        model = make_model()
        opt = psgd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters(), compression="int8",
                                        communicator=cluster.world.communicator(rank),
                                        hierarchical=cluster.topology(rank), staleness_correction="split_batch")
        for t in range(9):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
        assert opt._core.engine.config.hierarchical is not None
        opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    results = run_rank_threads(cluster.size, rank_fn, timeout=120)
    for weights in results[1:]:
        assert_same(weights, results[0])
