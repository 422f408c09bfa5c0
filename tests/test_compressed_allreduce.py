"""The compressed all-reduce on in-process ranks: equals the decoded-sum reference, any size."""
import numpy as np
import pytest

from allreduce_reference import decoded_sum_reference
from pipesgd_hvd.comm.base import ReduceOp
from pipesgd_hvd.comm.local import LocalWorld
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.compression.allreduce import allreduce_wire_bytes, compressed_allreduce
from pipesgd_hvd.frameworks.numpy_ops import NUMPY_OPS
from threads import run_threads


@pytest.mark.parametrize("size,n", [(1, 100), (2, 1000), (3, 1001), (4, 7), (5, 70001)])
@pytest.mark.parametrize("name", ["fp16", "bf16", "truncate16", "int8", "int4"])
def test_equals_decoded_sum_reference(name, size, n):
    rng = np.random.default_rng(size * 1000 + n)
    inputs = [rng.standard_normal(n).astype(np.float32) * (r + 1) for r in range(size)]
    world = LocalWorld(size, NUMPY_OPS)
    results = run_threads(world, lambda rank, comm: compressed_allreduce(
        NUMPY_OPS, comm, resolve_compression(name), inputs[rank].copy(), name="t", key="b0", seed=rank,
        op=ReduceOp.AVERAGE))
    expected = decoded_sum_reference(name, inputs)
    for out, sent in results:
        assert out.shape == (n,)
        assert np.array_equal(out, expected)
    assert results[0][1] == results[-1][1]


@pytest.mark.parametrize("name,limit", [("int8", 0.27), ("int4", 0.14)])
def test_wire_bytes_with_scales(name, limit):
    n = 1 << 20
    world = LocalWorld(2, NUMPY_OPS)
    x = np.ones(n, np.float32)
    results = run_threads(world, lambda rank, comm: compressed_allreduce(
        NUMPY_OPS, comm, resolve_compression(name), x.copy(), name="t", key="b", seed=0))
    assert results[0][1] / allreduce_wire_bytes(n, "float32", 2) <= limit
