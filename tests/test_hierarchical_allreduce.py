"""The hierarchical compressed all-reduce on in-process hosts (LocalCluster): bitwise equal to a
reference computed without any communicator (tests/allreduce_reference.py), every codec, uneven
bucket sizes, error feedback over steps; replicas identical; cross-host bytes 1/local_size of the
flat reduction's."""
import numpy as np
import pytest

from allreduce_reference import decoded_sum_reference, hierarchical_reference
from pipesgd_hvd.comm.base import ReduceOp
from pipesgd_hvd.comm.topology import NodeLayout, Topology, layout_problem
from pipesgd_hvd.compression import Compression, resolve_compression
from pipesgd_hvd.compression.allreduce import compressed_allreduce, padded_numel
from pipesgd_hvd.compression.hierarchical import hierarchical_allreduce
from pipesgd_hvd.ops.numpy import NUMPY_OPS
from pipesgd_hvd.testing import CountingComm, LocalCluster
from threads import run_rank_threads

CODECS = ["fp16", "bf16", "truncate16", "int8", "int4"]


def run_cluster(cluster, fn, timeout=60):
    """``fn(rank, topology, comm)`` on every in-process rank; results in rank order."""
    return run_rank_threads(cluster.size, lambda rank: fn(rank, cluster.topology(rank),
                                                          cluster.world.communicator(rank)), timeout)


def inputs_for(size, n, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) * (r + 1) for r in range(size)]


@pytest.mark.parametrize("hosts,per_host", [(2, 2), (3, 2), (2, 3)])
@pytest.mark.parametrize("n", [7, 1001, 70001])
@pytest.mark.parametrize("name", CODECS)
def test_equals_the_reference_bit_for_bit(name, n, hosts, per_host):
    size = hosts * per_host
    inputs = inputs_for(size, n, hosts * 100 + n)
    cluster = LocalCluster(hosts, per_host, NUMPY_OPS)
    results = run_cluster(cluster, lambda rank, topo, comm: hierarchical_allreduce(
        NUMPY_OPS, topo, resolve_compression(name), inputs[rank].copy(), name="t", key="b0", seed=rank))
    expected = hierarchical_reference(name, inputs, hosts, per_host)
    for out, _ in results:
        assert out.shape == (n,) and out.dtype == np.float32
        assert np.array_equal(out, expected)


@pytest.mark.parametrize("local_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["int8", "bf16"])
def test_a_16_bit_node_stage_equals_the_reference(name, local_dtype):
    hosts, per_host, n = 2, 2, 5003
    inputs = inputs_for(4, n, 7)
    cluster = LocalCluster(hosts, per_host, NUMPY_OPS)
    results = run_cluster(cluster, lambda rank, topo, comm: hierarchical_allreduce(
        NUMPY_OPS, topo, resolve_compression(name), inputs[rank].copy(), name="t", key="b0", seed=rank,
        local_dtype=local_dtype))
    expected = hierarchical_reference(name, inputs, hosts, per_host, local_dtype=local_dtype)
    assert not np.array_equal(expected, hierarchical_reference(name, inputs, hosts, per_host))  # the cast shows
    for out, _ in results:
        assert np.array_equal(out, expected)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_error_feedback_over_steps_and_a_padded_buffer(name):
    """Three steps of error feedback (the cross stage's residuals), each bucket in a buffer with
    the room the engine gives it (zero past the bucket), prescale and postscale: equal to the
    reference whose error feedback is done by hand."""
    hosts, per_host, n = 3, 2, 3001
    size = hosts * per_host
    steps = [inputs_for(size, n, 50 + t) for t in range(3)]
    room = padded_numel(resolve_compression(name), n, size)
    cluster = LocalCluster(hosts, per_host, NUMPY_OPS)

    def rank_fn(rank, topo, comm):
        codec, outs = resolve_compression(name), []
        for t, inputs in enumerate(steps):
            x = np.zeros(room, np.float32)
            x[:n] = inputs[rank]
            out, _ = hierarchical_allreduce(NUMPY_OPS, topo, codec, x, name=f"s{t}", key="b0", seed=t, numel=n,
                                            prescale=0.5, postscale=2.0)
            outs.append(out.copy())
        return outs, sorted(codec.state_dict()["residuals"])

    results = run_cluster(cluster, rank_fn)
    residuals = {}
    for t, inputs in enumerate(steps):
        expected = hierarchical_reference(name, inputs, hosts, per_host, residuals)
        for outs, _ in results:
            assert np.array_equal(outs[t], expected), f"step {t}"
    # error feedback on the cross stage only, under its own keys
    assert results[0][1] == ["b0/cross/reduced", "b0/cross/send"]


def test_sum_and_a_non_float32_bucket():
    hosts, per_host, n = 2, 2, 999
    inputs = inputs_for(4, n, 3)
    cluster = LocalCluster(hosts, per_host, NUMPY_OPS)
    results = run_cluster(cluster, lambda rank, topo, comm: hierarchical_allreduce(
        NUMPY_OPS, topo, resolve_compression("fp16"), inputs[rank].astype(np.float16), name="t", key="b", seed=0,
        op=ReduceOp.SUM))
    expected = hierarchical_reference("fp16", [x.astype(np.float16).astype(np.float32) for x in inputs],
                                      hosts, per_host) * np.float32(4)
    for out, _ in results:
        assert out.dtype == np.float16
        # x4 after the reference's /4 is exact (a power of two) unless a value underflowed there
        assert np.array_equal(out, expected.astype(np.float16))


@pytest.mark.parametrize("name", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("hosts,per_host", [(2, 2), (2, 4), (3, 2)])
def test_cross_host_bytes_shrink_by_the_ranks_per_host(name, hosts, per_host):
    """Counted per collective (pipesgd_hvd/testing/counting.py): the flat reduction over all ranks, and the
    hierarchical one's cross-node group (all of its traffic crosses hosts) and node group (none)."""
    n = 1 << 16
    size = hosts * per_host
    inputs = inputs_for(size, n, 11)
    cluster = LocalCluster(hosts, per_host, NUMPY_OPS)
    host_of = lambda rank: rank // per_host  # noqa: E731 - the flat world's ranks, host by host

    def rank_fn(rank, topo, comm):
        flat = CountingComm(comm, host_of)
        compressed_allreduce(NUMPY_OPS, flat, resolve_compression(name), inputs[rank].copy(), name="f", key="f", seed=0)
        local = CountingComm(topo.local, lambda peer: 0)
        cross = CountingComm(topo.cross, lambda peer: peer)
        _, sent = hierarchical_allreduce(NUMPY_OPS, Topology(topo.layout, local, cross), resolve_compression(name),
                                         inputs[rank].copy(), name="h", key="h", seed=0)
        assert local.cross_bytes == cross.local_bytes == 0
        assert sent == local.local_bytes + cross.cross_bytes  # what the reduction reports is what it sent
        return flat.cross_bytes, cross.cross_bytes

    counted = run_cluster(cluster, rank_fn)
    flat_bytes, hier_bytes = sum(f for f, _ in counted), sum(h for _, h in counted)
    assert hier_bytes * per_host <= flat_bytes
    assert hier_bytes * per_host > 0.98 * flat_bytes  # the same chunks, padding aside: no bytes lost track of


def test_replicas_are_identical_with_stochastic_rounding():
    """Each rank rounds with its own noise (the seed holds the rank); every rank still decodes the
    same bytes, so the results are the same bits everywhere."""
    hosts, per_host, n = 2, 2, 4099
    inputs = inputs_for(4, n, 5)
    cluster = LocalCluster(hosts, per_host, NUMPY_OPS)
    results = run_cluster(cluster, lambda rank, topo, comm: hierarchical_allreduce(
        NUMPY_OPS, topo, Compression.quantize(8, rounding="stochastic"), inputs[rank].copy(), name="t", key="b",
        seed=1000 + rank))
    for out, _ in results[1:]:
        assert np.array_equal(out, results[0][0])
    assert np.max(np.abs(results[0][0] - decoded_sum_reference("int8", inputs))) < 0.1


def test_layouts_that_cannot_be_hierarchical_say_why():
    even = [NodeLayout(r % 2, 2, r // 2, 2) for r in range(4)]
    assert layout_problem(even, 4) is None
    uneven = [NodeLayout(0, 2, 0, 2), NodeLayout(1, 2, 0, 1), NodeLayout(0, 1, 1, 2)]  # hosts a:2, b:1
    assert "different numbers of ranks" in layout_problem(uneven, 3)
    twice = [NodeLayout(0, 2, 0, 2)] * 4
    assert "do not fill" in layout_problem(twice, 4)
    with pytest.raises(ValueError, match="do not match the layout"):
        cluster = LocalCluster(2, 2, NUMPY_OPS)
        Topology(NodeLayout(1, 2, 0, 2), cluster.topology(0).local, cluster.topology(0).cross)

