"""The compressed all-reduce: the bytes of a ring all-reduce, one quantization per phase.

For N ranks: split the encoded bucket into N chunks (scales travel inside each chunk), alltoall
them (the reduce-scatter phase), decode the N chunks received, sum them in float32 and average,
re-encode the reduced chunk, allgather, decode. Each rank sends ``2 (N-1)`` encoded chunks, as a
ring does, but every value is quantized twice in all, not at each of ``N-1`` hops, and the
codec's work is done once per phase instead of on every hop's critical path. All ranks decode
the same gathered bytes, so every replica gets bitwise the same result.

Written against the Communicator protocol and TensorOps: it runs on Horovod, MPI,
torch.distributed and the in-process world alike, eagerly or inside a traced TensorFlow graph.
"""
from __future__ import annotations

import hashlib
from typing import Any, Tuple

from ..comm.base import Communicator, ReduceOp, postscale_factor
from ..tensor_ops import ITEMSIZE, Tensor, TensorOps
from .codecs import Codec


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from a few ints/strings (stable across processes, unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFFFFFFFFFF


def compressed_allreduce(ops: TensorOps, comm: Communicator, codec: Codec, x: Tensor, *,
                         name: str, key: str, seed: int, op: ReduceOp = ReduceOp.AVERAGE,
                         prescale: float = 1.0, postscale: float = 1.0) -> Tuple[Tensor, int]:
    """Reduce the flat float tensor ``x`` across ranks with a byte codec.

    Returns the reduced tensor (``x``'s length and dtype) and the bytes this rank sent.
    Blocking: the engine runs it on its communication thread, TensorFlow at trace time.
    """
    if codec.summable:
        raise ValueError(f"codec {codec.name} is summable: reduce it with a plain all-reduce")
    n, size, dtype = ops.numel(x), comm.size, ops.dtype_name(x)
    values = ops.cast(x, "float32") if dtype != "float32" else x
    if prescale != 1.0:
        values = values * prescale
    cols = codec.padded_cols(max(1, -(-n // size)))
    if size * cols != n:
        values = ops.concat([values, ops.zeros((size * cols - n,), "float32", like=x)], 0)
    rows = ops.reshape(values, (size, cols))

    payload, ctx = codec.encode(ops, rows, key=f"{key}/send", seed=derive_seed(seed, "send"))
    received = comm.alltoall_async(payload, f"{name}.a2a").wait()
    total = ops.sum(codec.decode(ops, received, ctx), axis=0, keepdims=True)
    scale = postscale_factor(op, postscale, size)
    if scale != 1.0:
        total = total * scale

    reduced, ctx2 = codec.encode(ops, total, key=f"{key}/reduced", seed=derive_seed(seed, "reduced"))
    gathered = comm.allgather_async(reduced, f"{name}.ag").wait()
    out = ops.reshape(codec.decode(ops, gathered, ctx2), (size * cols,))[:n]

    row_bytes = ops.shape(payload)[1] * ITEMSIZE["uint8"]
    sent = 2 * (size - 1) * row_bytes
    return (ops.cast(out, dtype) if dtype != "float32" else out), sent


def reduce_blocking(ops: TensorOps, comm: Communicator, codec: Codec, x: Tensor, *, name: str, key: str,
                    seed: int, op: ReduceOp = ReduceOp.AVERAGE) -> Tuple[Tensor, int]:
    """One whole reduction of ``x`` with ``codec``, the way the engine runs it, waited for: a
    summable codec's payload goes through a plain all-reduce (in place on ``x`` for ``none``),
    a byte codec through :func:`compressed_allreduce`. Returns the result and the bytes sent.
    (The engine itself starts the plain all-reduce and waits later; the auto mode times this.)"""
    if not codec.summable:
        return compressed_allreduce(ops, comm, codec, x, name=name, key=key, seed=seed, op=op)
    payload, ctx = codec.encode(ops, x, key=key, seed=seed)
    reduced = comm.allreduce_async_(payload, name, op).wait()
    sent = allreduce_wire_bytes(ops.numel(payload), ops.dtype_name(payload), comm.size)
    return codec.decode(ops, reduced, ctx), sent


def allreduce_wire_bytes(numel: int, dtype: str, size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` values: ``2 (N-1)/N * M``."""
    return (2 * (size - 1) * numel * ITEMSIZE[dtype]) // size
