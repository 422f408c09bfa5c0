"""The auto mode and the timing model with hierarchical reductions: the model's terms in closed
form, the rule's choice between a byte codec flat and hierarchical, and the controller timing
both on in-process hosts (a real TimingProbe: the real reductions) and rebuilding accordingly."""
import numpy as np
import pytest

from pipesgd_hvd.auto.controller import AutoController, AutoSettings, TimingProbe
from pipesgd_hvd.auto.model import (CODECS, LinkParams, compressed_allreduce_time, flat_on_nodes_time,
                                    hierarchical_allreduce_time)
from pipesgd_hvd.auto.rule import CANDIDATES, Measurements, decide, decide_fixed, with_hierarchical
from pipesgd_hvd.ops.numpy import NUMPY_OPS
from pipesgd_hvd.pipeline.engine import AppliedStep
from pipesgd_hvd.pipeline.fusion import TensorSpec
from pipesgd_hvd.testing import LocalCluster
from scripted_timing import FakeClock
from threads import run_rank_threads

M = 64e6
FREE = LinkParams(alpha=0.0, bandwidth=float("inf"))


@pytest.mark.parametrize("name", ["int8", "int4", "fp16"])
@pytest.mark.parametrize("hosts", [2, 3, 8])
def test_one_rank_per_host_is_the_flat_formula(name, hosts):
    link, codec = LinkParams(50e-6, 1.25e9, 1e-10), CODECS[name]
    flat = compressed_allreduce_time(hosts, M, link, codec)
    assert flat_on_nodes_time(1, hosts, M, FREE, link, codec) == pytest.approx(flat, rel=1e-12)
    assert hierarchical_allreduce_time(1, hosts, M, FREE, link, codec) == pytest.approx(flat, rel=1e-12)


@pytest.mark.parametrize("local_size,hosts", [(2, 2), (4, 2), (8, 2), (2, 3), (8, 4)])
def test_the_link_between_hosts_carries_local_size_times_less(local_size, hosts):
    """Bandwidth alone (no latency, free links inside the host, no codec cost): the flat
    reduction's time over the hierarchical one's is the ratio of what each puts on a host's link,
    ``2 L (C-1)/C r M`` against ``2 (C-1)/C r M``."""
    link, codec = LinkParams(0.0, 1.25e9), CODECS["int8"]
    flat = flat_on_nodes_time(local_size, hosts, M, FREE, link, codec)
    hier = hierarchical_allreduce_time(local_size, hosts, M, FREE, link, codec)
    assert flat / hier == pytest.approx(local_size, rel=1e-12)
    assert hier == pytest.approx(2 * (hosts - 1) / hosts * codec.ratio * M / link.bandwidth, rel=1e-12)


def test_the_node_stages_in_closed_form():
    """A free link between hosts: what is left is the reduce-scatter inside the host (w M, float32 or
    16-bit) and the allgather of the encoded shards (r M), each (L-1)/L of it, plus 2 (L-1) latencies
    and the float32 sum."""
    node, codec, L = LinkParams(1e-5, 10e9, 2e-11), CODECS["int4"], 4
    for w in (1.0, 0.5):
        expected = 2 * (L - 1) * 1e-5 + (L - 1) / L * (w + codec.ratio) * M / 10e9 + (L - 1) / L * M * 2e-11
        assert hierarchical_allreduce_time(L, 2, M, node, FREE, codec, node_ratio=w) == pytest.approx(expected)


def test_untimed_candidates_on_hosts_of_two_pick_the_hierarchical_form():
    # comm 5x compute between hosts: only a codec's hierarchical form comes close to compute
    m = Measurements(ranks=4, gradient_bytes=int(M), compute_s=0.1, allreduce_s=0.5, local_size=2)
    d = decide(m, candidates=with_hierarchical(CANDIDATES))
    assert d.hierarchical and d.compression in ("int8", "int4")
    assert d.predicted_s[f"{d.compression}/hier"] < d.predicted_s[d.compression] / 1.5
    # one rank per host: the same numbers choose a flat codec
    flat = decide(Measurements(ranks=4, gradient_bytes=int(M), compute_s=0.1, allreduce_s=0.5))
    assert not flat.hierarchical


def test_timed_forms_decide_and_flat_wins_when_clearly_faster():
    base = dict(ranks=4, gradient_bytes=int(M), compute_s=0.1, allreduce_s=0.5, local_size=2)
    faster_hier = Measurements(**base, reduction_s={"none": 0.5, "int8/hier": 0.11, "int8": 0.2})
    assert decide(faster_hier, candidates=with_hierarchical(("none", "int8"))).hierarchical
    faster_flat = Measurements(**base, reduction_s={"none": 0.5, "int8/hier": 0.3, "int8": 0.12})
    d = decide(faster_flat, candidates=with_hierarchical(("none", "int8")))
    assert (d.compression, d.hierarchical) == ("int8", False)
    # within the tolerance the hierarchical form is kept (as lossy or less)
    close = Measurements(**base, reduction_s={"none": 0.5, "int8/hier": 0.125, "int8": 0.12})
    assert decide(close, candidates=with_hierarchical(("none", "int8"))).hierarchical
    # a fixed codec timed both ways takes the same rule
    assert decide_fixed(faster_hier, compression="int8").hierarchical
    assert not decide_fixed(faster_flat, compression="int8").hierarchical


class StubEngine:
    def __init__(self, numel):
        self.step, self.specs = 0, [TensorSpec("w", (numel,), "float32")]

    def flush(self):
        return []


class SlowHierarchicalProbe(TimingProbe):
    """The real reductions (the collectives run, so every rank must time the same ones), with a
    scripted number per form: the float32 all-reduce 5x compute, a flat byte codec 2x, the
    hierarchical form as ``hier_s`` says. Records what was timed, and how."""

    def __init__(self, hier_s):
        super().__init__(repeats=1)
        self.hier_s, self.timed = hier_s, []

    def reduction(self, comm, ops, codec, flat, topology=None, node_dtype="float32"):
        super().reduction(comm, ops, codec, flat, topology=topology, node_dtype=node_dtype)
        hier = topology is not None
        self.timed.append((codec.name.split("+")[0], hier))
        return (0.5 if codec.summable else self.hier_s if hier else 0.2), 0.0


FP16_HIER_ONLY = [("none", False), ("fp16", True)]  # fp16/hier within 10% of compute: the rest cannot matter
EVERY_FORM = [("none", False)] + [(c, h) for c in ("fp16", "int8", "int4") for h in (True, False)]


@pytest.mark.parametrize("hier_s,expect_hier,expect_timed", [(0.11, True, FP16_HIER_ONLY), (0.4, False, EVERY_FORM)])
def test_the_controller_times_both_forms_and_rebuilds_with_the_faster(hier_s, expect_hier, expect_timed):
    cluster = LocalCluster(2, 2, NUMPY_OPS)

    def rank_fn(rank):
        clock, engine, rebuilt = FakeClock(), StubEngine(4096), []
        probe = SlowHierarchicalProbe(hier_s)
        controller = AutoController(AutoSettings.from_arguments("auto", "auto", 2, 0), cluster.world.communicator(rank),
                                    NUMPY_OPS, rebuild=lambda w, c, h: rebuilt.append((w, c, h)), probe=probe,
                                    clock=clock, topology=cluster.topology(rank), choose_hierarchy=True)
        grad = np.linspace(-1, 1, 4096, dtype=np.float32) * (rank + 1)
        for t in range(3):
            clock.now += 0.1
            controller.reduction_started()
            engine.step += 1
            controller.after_step(engine, [AppliedStep(t, {0: grad.copy()})])
        return probe.timed, rebuilt, controller.decision

    out = run_rank_threads(4, rank_fn)
    timed, rebuilt, decision = out[0]
    # none first, then each byte codec hierarchical before flat, until the rest cannot matter
    assert timed == expect_timed
    assert rebuilt == [(2, "fp16", expect_hier)]  # the least lossy codec within 10% of the fastest
    assert all(o[1] == rebuilt and o[0] == timed for o in out)  # every rank timed and chose alike


def test_the_optimizer_rebuilds_a_hierarchical_pipeline_when_the_auto_mode_says_so():
    """Through PyTorch's DistributedOptimizer and the life cycle's rebuild: the groups passed as
    hierarchical= are used by the pipeline the auto mode switches to (fp16 here, whose
    hierarchical form the scripted numbers put within 10% of compute)."""
    import torch

    import pipesgd_hvd.torch as psgd
    from pipesgd_hvd.ops.torch import TORCH_OPS
    from reference import loss_fn, make_batches, make_model

    cluster, batches = LocalCluster(2, 2, TORCH_OPS), make_batches(5, 4)

    def rank_fn(rank):
        model = make_model()
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(), width="auto",
                                        compression="auto", auto_measure_steps=2, auto_recheck_every=0,
                                        communicator=cluster.world.communicator(rank),
                                        hierarchical=cluster.topology(rank))
        clock = FakeClock()
        opt.auto_controller.clock, opt.auto_controller.probe = clock, SlowHierarchicalProbe(0.11)
        before = (opt._core.engine.config.width, opt._core.engine.config.hierarchical)
        for t in range(5):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            clock.now += 0.1
            opt.step()
        opt.flush()
        engine = opt._core.engine
        return before, (engine.config.width, engine.codec.name, engine.config.hierarchical), \
            [p.detach().clone() for p in model.parameters()]

    out = run_rank_threads(4, rank_fn, timeout=120)
    for before, after, weights in out:
        assert before == (1, None)  # measuring: synchronous, uncompressed
        assert after == (2, "fp16", "float32")
        for w, w0 in zip(weights, out[0][2]):
            assert torch.equal(w, w0)
