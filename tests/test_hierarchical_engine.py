"""The engine with a hierarchical pipeline on in-process hosts (LocalCluster, numpy): each applied
step's gradients are bitwise the reference's (tests/allreduce_reference.py, no communicator),
bucket by bucket of uneven sizes, error feedback carried over steps, at width 2 and width 1."""
import numpy as np
import pytest

from allreduce_reference import hierarchical_reference
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.compression.allreduce import side_region
from pipesgd_hvd.ops.numpy import NUMPY_OPS
from pipesgd_hvd.pipeline.config import PipelineConfig
from pipesgd_hvd.pipeline.engine import PipelineEngine
from pipesgd_hvd.pipeline.fusion import TensorSpec
from pipesgd_hvd.testing import LocalCluster
from threads import run_rank_threads

# Buckets of uneven sizes (threshold 4 KiB): 1200, 7, 3001 and 513 + 64 values.
SHAPES = [(8, 8), (513,), (3001,), (7,), (30, 40)]
SPECS = [TensorSpec(f"t{i}", shape, "float32") for i, shape in enumerate(SHAPES)]
THRESHOLD = 4096


def gradient(step, rank, i):
    rng = np.random.default_rng([step, rank, i])
    return (rng.standard_normal(SHAPES[i]) * (1 + rank)).astype(np.float32)


def run(cluster, name, width, steps, node_dtype="float32"):
    def rank_fn(rank):
        config = PipelineConfig(width=width, fusion_threshold_bytes=THRESHOLD, name="h", hierarchical=node_dtype)
        engine = PipelineEngine(SPECS, ops=NUMPY_OPS, comm=cluster.world.communicator(rank),
                                codec=resolve_compression(name), config=config, topology=cluster.topology(rank))
        applied = {}
        for t in range(steps):
            engine.begin_step(range(len(SPECS)))
            for i in engine._ready_order:
                engine.add_gradient_(i, gradient(t, rank, i))
            for a in engine.end_step():
                applied[(a.step, t)] = {i: g.copy() for i, g in a.grads.items()}
        for a in engine.flush():
            applied[(a.step, steps)] = {i: g.copy() for i, g in a.grads.items()}
        out = applied, engine.layout_for(range(len(SPECS))), engine.stats.bytes_sent
        engine.close()
        return out

    return run_rank_threads(cluster.size, rank_fn)


@pytest.mark.parametrize("hosts,per_host", [(2, 2), (3, 2)])
@pytest.mark.parametrize("name,width", [("int8", 2), ("int4", 2), ("bf16", 2), ("int8", 1)])
def test_applied_gradients_equal_the_reference(name, width, hosts, per_host):
    cluster, steps = LocalCluster(hosts, per_host, NUMPY_OPS), 4
    results = run(cluster, name, width, steps)
    layout = results[0][1]
    sizes = [b.numel for b in layout.buckets]
    assert sizes == [1200, 7, 3001, 577]  # uneven buckets, one of 7 values (fewer than ranks)
    # per bucket: error feedback by hand over the steps, for the codecs that carry it (int8, int4)
    residuals = [dict() if name.startswith("int") else None for _ in layout.buckets]
    for t in range(steps):
        expected = {}
        for b, bucket in enumerate(layout.buckets):
            inputs = []
            length = bucket.numel
            if b == len(layout.buckets) - 1:  # the last one carries the membership flags, in a block of their own
                at, length = side_region(resolve_compression(name), bucket.numel, cluster.size, cluster.size)
            for rank in range(cluster.size):
                flat = np.zeros(length, np.float32)
                for m in bucket.members:
                    flat[m.offset:m.offset + m.numel] = gradient(t, rank, m.index).reshape(-1)
                if length != bucket.numel:
                    flat[at + rank] = 1.0  # every rank trains
                inputs.append(flat)
            reduced = hierarchical_reference(name, inputs, hosts, per_host, residuals[b])
            for m in bucket.members:
                expected[m.index] = reduced[m.offset:m.offset + m.numel].reshape(SHAPES[m.index])
        # width 1 applies step t at step t; width 2 at step t + 1 (the last one at the flush)
        ended_at = t if width == 1 else t + 1
        for applied, _, _ in results:
            grads = applied[(t, ended_at)]
            assert sorted(grads) == sorted(expected)
            for i, g in grads.items():
                assert np.array_equal(g, expected[i]), f"step {t}, tensor {i}"
    assert len({sent for _, _, sent in results}) == 1  # every rank sent as much


def test_a_16_bit_node_stage_runs_in_the_engine():
    cluster = LocalCluster(2, 2, NUMPY_OPS)
    results = run(cluster, "int8", 2, 2, node_dtype="bfloat16")
    layout = results[0][1]
    bucket = layout.buckets[0]
    inputs = []
    for rank in range(4):
        flat = np.zeros(bucket.numel, np.float32)
        for m in bucket.members:
            flat[m.offset:m.offset + m.numel] = gradient(0, rank, m.index).reshape(-1)
        inputs.append(flat)
    reduced = hierarchical_reference("int8", inputs, 2, 2, {}, local_dtype="bfloat16")
    m = bucket.members[0]
    assert np.array_equal(results[0][0][(0, 1)][m.index].reshape(-1), reduced[m.offset:m.offset + m.numel])


def test_the_engine_refuses_half_a_hierarchical_setup():
    cluster = LocalCluster(2, 2, NUMPY_OPS)
    comm = cluster.world.communicator(0)
    with pytest.raises(ValueError, match="both config.hierarchical and a topology"):
        PipelineEngine(SPECS, ops=NUMPY_OPS, comm=comm, codec=resolve_compression("int8"),
                       config=PipelineConfig(hierarchical="float32"), check_ranks=False)
    with pytest.raises(ValueError, match="both config.hierarchical and a topology"):
        PipelineEngine(SPECS, ops=NUMPY_OPS, comm=comm, codec=resolve_compression("int8"),
                       config=PipelineConfig(), topology=cluster.topology(0), check_ranks=False)
    with pytest.raises(ValueError, match="has no hierarchical form"):
        PipelineEngine(SPECS, ops=NUMPY_OPS, comm=comm, codec=resolve_compression("none"),
                       config=PipelineConfig(hierarchical="float32"), topology=cluster.topology(0), check_ranks=False)
