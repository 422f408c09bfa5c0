"""The hierarchical compressed all-reduce, for nodes of several GPUs (docs/options.md, "Multi-GPU
nodes: `hierarchical`"): compress only where the bytes are slow, between nodes.

Over a :class:`~pipesgd_hvd.comm.topology.Topology` of C nodes of L ranks each (N = L C):

1. inside the node, a reduce-scatter: the bucket's L shards go to their owners by alltoall, as
   float32 (or a 16-bit cast, ``local_dtype``), and each owner adds the L shards it received in
   float32, in local-rank order from +0;
2. across nodes, among the C ranks of equal ``local_rank``, the flat compressed all-reduce of that
   shard (``compression/allreduce.py``): encode, alltoall, decode and sum in float32 (times the
   average's 1/N), re-encode, allgather. Error feedback keeps its residuals here only, under
   ``<key>/cross/send`` and ``<key>/cross/reduced``: stage 1 loses nothing in float32 (a 16-bit
   cast there rounds each value once, uncorrected), and stage 3 moves bytes already encoded;
3. inside the node, an allgather of the C encoded chunks each rank holds, and every rank decodes
   all N chunks.

Why: each rank sends its shard (1/L of the bucket) across nodes, ``2 (C-1)/C`` of it encoded, so a
node's link carries ``2 (C-1)/C r M`` per bucket of M bytes (r: the codec's wire ratio), where the
flat reduction puts ``2 L (C-1)/C r M`` on it: L times less. Inside the node it adds ``(L-1)/L M``
float32 bytes per rank on the fast links.

Replicas: the N chunks every rank decodes are the same bytes on every rank (stage 2's allgather
gives them to the C ranks of a local rank, stage 3 to the whole node), so every replica gets
bitwise the same result, as with the flat reduction.

Layout: the bucket, padded as the flat reduction pads it for N ranks (:func:`padded_numel` with
``size=N``), is N rows of ``cols`` values; the rank of local rank j on node c reduces row
``j C + c``. Shard j of stage 1 is then rows ``j C .. j C + C - 1``, contiguous, so the engine's
padded buffers serve both reductions, and the chunk layout is the flat one's.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

from ..comm.base import Communicator, ReduceOp, postscale_factor
from ..comm.topology import Topology
from ..ops.base import ITEMSIZE, Tensor, TensorOps
from ..ops.seeds import Seed
from .allreduce import exchange_compressed, padded_values
from .codecs import Cast, Codec

#: What stage 1 sends inside the node: float32 (exact) or a 16-bit cast, summed in float32.
LOCAL_DTYPES = ("float32", "float16", "bfloat16")


def hierarchical_allreduce(ops: TensorOps, topology: Topology, codec: Codec, x: Tensor, *, name: str, key: str,
                           seed: Union[Seed, int], op: ReduceOp = ReduceOp.AVERAGE, prescale: float = 1.0,
                           postscale: float = 1.0, numel: Optional[int] = None,
                           local_dtype: str = "float32") -> Tuple[Tensor, int]:
    """Reduce the flat float tensor ``x`` across all ``L C`` ranks of ``topology`` with a byte
    codec, in the three stages of the module docstring (blocking).

    Same contract as :func:`~pipesgd_hvd.compression.allreduce.compressed_allreduce`: returns the
    reduced tensor (``numel`` values, ``x``'s dtype) and the bytes this rank sent (both links);
    a float32 ``x`` of at least ``padded_numel(codec, numel, L * C)`` values, zero past
    ``numel``, is reduced where it lies. Collectives: ``<name>.local.a2a`` on the node's group,
    ``<name>.cross.a2a`` and ``<name>.cross.ag`` on the cross-node group, ``<name>.local.ag``
    on the node's group, in that order on every rank."""
    if local_dtype not in LOCAL_DTYPES:
        raise ValueError(f"local_dtype must be one of {', '.join(LOCAL_DTYPES)}, got {local_dtype!r}")
    seed = seed if isinstance(seed, Seed) else Seed(int(seed))
    local, cross = topology.local, topology.cross
    shards, chunks = local.size, cross.size
    size = shards * chunks
    values, n, cols = padded_values(ops, codec, x, numel, size, prescale)

    # 1. Reduce-scatter inside the node: shard j (C rows) to local rank j, summed in float32.
    shard = _local_reduce_scatter(ops, local, ops.reshape(values, (shards, chunks * cols)), name=name,
                                  local_dtype=local_dtype, seed=seed.child("local"))
    local_sent = (shards - 1) * chunks * cols * ITEMSIZE[local_dtype]

    # 2. The compressed all-reduce of the shard across nodes; 1/N of an average applies here, on
    #    the one sum that has every rank's share in it.
    gathered, ctx, row_bytes = exchange_compressed(
        ops, cross, codec, ops.reshape(shard, (chunks, cols)), name=f"{name}.cross", key=f"{key}/cross",
        seed=seed.child("cross"), scale=postscale_factor(op, postscale, size))

    # 3. Allgather the encoded shard inside the node: row j C + c of the result is shard j's chunk c.
    everything = local.allgather_async(ops.reshape(gathered, (1, chunks * row_bytes)), f"{name}.local.ag").wait()
    ops.record_use(everything)
    decoded = codec.decode(ops, ops.reshape(everything, (size, row_bytes)), ctx)
    out = ops.reshape(decoded, (size * cols,))[:n]
    local_sent += (shards - 1) * chunks * row_bytes
    sent = local_sent + 2 * (chunks - 1) * row_bytes
    dtype = ops.dtype_name(x)
    return (ops.cast(out, dtype) if dtype != "float32" else out), sent


def _local_reduce_scatter(ops: TensorOps, local: Communicator, rows: Tensor, *, name: str, local_dtype: str,
                          seed: Seed) -> Tensor:
    """Stage 1: row j of ``rows`` ``[L, C cols]`` goes to local rank j; returns the float32 sum
    ``[1, C cols]`` of the L rows received, added in local-rank order from +0 (the order the
    codecs' decode+sum keeps, so a reference can repeat it)."""
    name = f"{name}.local.a2a"
    if local_dtype == "float32":
        received = local.alltoall_async(rows, name).wait()
        ops.record_use(received)
        total = received[0:1] + 0.0  # a new tensor (the rows are the transport's), from +0 as the codecs add
        for r in range(1, ops.shape(received)[0]):
            total = total + received[r:r + 1]
        return total
    cast = Cast(local_dtype)
    payload, ctx = cast.encode(ops, rows, key="local", seed=seed)
    received = local.alltoall_async(payload, name).wait()
    ops.record_use(received)
    return cast.decode_sum(ops, received, ctx, 1.0)


__all__ = ["LOCAL_DTYPES", "hierarchical_allreduce"]
