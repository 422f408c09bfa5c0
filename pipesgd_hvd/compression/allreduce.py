"""One bucket's reduction across ranks, the one function every path runs (the eager engine,
TensorFlow's traced step, the auto mode's timing), and the compressed all-reduce it uses for
byte codecs.

The compressed all-reduce moves the bytes of a ring all-reduce with one quantization per phase.
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

from typing import Any, Callable, Optional, Tuple, Union

from ..comm.base import Communicator, ReduceOp, postscale_factor
from ..ops.base import ITEMSIZE, Tensor, TensorOps
from ..ops.seeds import Seed
from .codecs import Codec


def allreduce_wire_bytes(numel: int, dtype: str, size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` values: ``2 (N-1)/N * M``."""
    return (2 * (size - 1) * numel * ITEMSIZE[dtype]) // size


class Reduction:
    """A bucket's reduction, started or ready to run: ``wait()`` returns (the reduced tensor,
    the bytes this rank sent). ``done()`` says, without waiting, that ``wait()`` would not block
    (False when it cannot tell); ``future``: the Future whose result ``wait()`` returns, when the
    reduction runs on a thread (a waiter can then wait on it in slices)."""

    def __init__(self, wait: Callable[[], Tuple[Tensor, int]], done: Optional[Callable[[], bool]] = None,
                 future: Any = None) -> None:
        # Plain attributes, not methods: a caller's wait() and done() run the producer's own
        # functions (the engine's step path stays in the engine's file, issue 41).
        self.wait: Callable[[], Tuple[Tensor, int]] = wait
        self.done: Callable[[], bool] = done if done is not None else _unknown
        self.future = future


def _unknown() -> bool:
    return False


def reduce_bucket(ops: TensorOps, comm: Communicator, codec: Codec, flat: Tensor, *, name: str, key: str,
                  seed: Seed, op: ReduceOp = ReduceOp.AVERAGE, prescale: float = 1.0,
                  postscale: float = 1.0, numel: Optional[int] = None) -> Reduction:
    """Reduce the flat bucket ``flat`` across ranks with ``codec``.

    A summable codec's payload goes through a plain all-reduce, started here (in place on
    ``flat`` for ``none``); ``wait()`` waits and decodes. A byte codec's compressed all-reduce
    blocks between its phases, so it runs inside ``wait()``: the caller picks the thread (the
    engine's communication thread; at trace time for TensorFlow, where it only builds ops).
    ``numel``: a byte codec's values are the first ``numel`` of ``flat`` (see
    :func:`compressed_allreduce`)."""
    if codec.summable and numel is not None and numel != ops.numel(flat):
        raise ValueError(f"a summable codec ({codec.name}) reduces the whole bucket: got numel={numel} "
                         f"for a bucket of {ops.numel(flat)} values")
    if codec.summable:
        payload, ctx = codec.encode(ops, flat, key=key, seed=seed)
        handle = comm.allreduce_async_(payload, name, op, prescale, postscale)
        sent = allreduce_wire_bytes(ops.numel(payload), ops.dtype_name(payload), comm.size)
        return Reduction(lambda: (codec.decode(ops, handle.wait(), ctx), sent), done=handle.done)
    return Reduction(lambda: compressed_allreduce(ops, comm, codec, flat, name=name, key=key, seed=seed, op=op,
                                                  prescale=prescale, postscale=postscale, numel=numel))


def padded_numel(codec: Codec, numel: int, size: int) -> int:
    """How many values a byte codec's compressed all-reduce of ``numel`` values over ``size``
    ranks works on: one row per rank, of whole codec groups. A float32 buffer this long whose
    values past ``numel`` are zero is reduced without copying it into a padded one."""
    return size * codec.padded_cols(max(1, -(-numel // size)))


def side_region(codec: Codec, numel: int, extra: int, size: int) -> Tuple[int, int]:
    """Where ``extra`` values can ride after a bucket's ``numel`` values without sharing a codec
    block with any of them, and the bucket's length then: ``(offset, length)``.

    Why: the pipeline sends which ranks still train (the membership flags, see the engine's
    ``join``) inside a step's last bucket instead of in a collective of their own. A quantizer
    scales each block by its largest value, so a flag of 1.0 beside gradients of 1e3 would
    quantize to 0, and a non-finite gradient turns its whole block into NaN; in a block of their
    own the flags (equal non-zero values and zeros) quantize exactly, and their error-feedback
    residual is zero. Summable codecs are element-wise: right after the values. Byte codecs: the
    first block boundary past ``numel`` within one of the compressed all-reduce's ``size`` rows
    that has room; the length is whole rows (pass ``numel=length`` to
    :func:`compressed_allreduce`, so that it keeps these rows)."""
    if codec.summable:
        return numel, numel + extra
    cols = codec.padded_cols(max(1, -(-(numel + extra) // size)))
    while True:
        width = codec.block_width(cols)
        row, col = divmod(numel, cols)
        col = -(-col // width) * width  # the next block boundary in this row
        if col + extra > cols:
            row, col = row + 1, 0
        if row < size and col + extra <= cols:
            return row * cols + col, size * cols
        cols = codec.padded_cols(cols + 1)


def compressed_allreduce(ops: TensorOps, comm: Communicator, codec: Codec, x: Tensor, *,
                         name: str, key: str, seed: Union[Seed, int], op: ReduceOp = ReduceOp.AVERAGE,
                         prescale: float = 1.0, postscale: float = 1.0,
                         numel: Optional[int] = None) -> Tuple[Tensor, int]:
    """Reduce the flat float tensor ``x`` across ranks with a byte codec (blocking).

    Returns the reduced tensor (``numel`` values, ``x``'s dtype) and the bytes this rank sent.
    ``seed``: stochastic rounding's (an int is taken as ``Seed(seed)``). ``numel``: the values
    are the first ``numel`` of ``x`` (default: all of it). A float32 ``x`` of at least
    :func:`padded_numel` values, zero past ``numel``, is encoded where it lies; any other is first
    copied into a zero-padded one (a whole copy of the bucket, on every call: the engine's
    buffers have the room).
    """
    seed = seed if isinstance(seed, Seed) else Seed(int(seed))
    size = comm.size
    values, n, cols = padded_values(ops, codec, x, numel, size, prescale)
    gathered, ctx, row_bytes = exchange_compressed(ops, comm, codec, ops.reshape(values, (size, cols)), name=name,
                                                   key=key, seed=seed, scale=postscale_factor(op, postscale, size))
    del values  # a padded copy (not the engine's buffer): not needed while the result is decoded
    out = ops.reshape(codec.decode(ops, gathered, ctx), (size * cols,))[:n]
    dtype = ops.dtype_name(x)
    return (ops.cast(out, dtype) if dtype != "float32" else out), 2 * (size - 1) * row_bytes


def padded_values(ops: TensorOps, codec: Codec, x: Tensor, numel: Optional[int], rows: int,
                  prescale: float = 1.0) -> Tuple[Tensor, int, int]:
    """``x``'s first ``numel`` values (all by default) as float32, zero-padded to ``rows`` rows of
    whole codec groups, times ``prescale``: (the ``rows * cols`` values, numel, cols). A float32
    ``x`` with the room (:func:`padded_numel`) is used where it lies, without a copy."""
    if codec.summable:
        raise ValueError(f"codec {codec.name} is summable: reduce it with a plain all-reduce")
    dtype, length = ops.dtype_name(x), ops.numel(x)
    n = length if numel is None else numel
    if not 0 <= n <= length:
        raise ValueError(f"numel={n} is not within the {length} values of the bucket")
    cols = codec.padded_cols(max(1, -(-n // rows)))
    if dtype == "float32" and length >= rows * cols:
        values = x if length == rows * cols else x[:rows * cols]  # zero past n: the caller's word
    else:
        head = x if n == length else x[:n]
        values = ops.cast(head, "float32") if dtype != "float32" else head
        if rows * cols != n:
            values = ops.concat([values, ops.zeros((rows * cols - n,), "float32", like=x)], 0)
    if prescale != 1.0:
        values = values * prescale
    return values, n, cols


def exchange_compressed(ops: TensorOps, comm: Communicator, codec: Codec, rows: Tensor, *, name: str, key: str,
                        seed: Seed, scale: float) -> Tuple[Tensor, Any, int]:
    """The two phases of the compressed all-reduce over ``comm`` on float32 ``rows`` (one per
    rank): encode, alltoall, decode and sum in float32 times ``scale``, re-encode, allgather.
    Returns the gathered encoded rows (the same bytes on every rank), their decode context, and
    the bytes of one encoded row. Error feedback keeps its residuals under ``<key>/send`` and
    ``<key>/reduced``."""
    # The transport's outputs may come from its own stream's memory (Horovod allocates them on its
    # thread); they are decoded on this one, so they are recorded here (see ops/torch_cuda.py).
    # Each phase's tensors are dropped as soon as the next is made (benchmarks/memory.py): held to the
    # return, the encoded rows, the received rows and their float32 sum (for int8 on 2 ranks, as much
    # as the bucket in float32) were all alive during the allgather.
    payload, ctx = codec.encode(ops, rows, key=f"{key}/send", seed=seed.child("send"))
    row_bytes = ops.shape(payload)[1] * ITEMSIZE["uint8"]
    received = comm.alltoall_async(payload, f"{name}.a2a").wait()
    del payload
    ops.record_use(received)
    total = codec.decode_sum(ops, received, ctx, scale)
    del received

    reduced, ctx2 = codec.encode(ops, total, key=f"{key}/reduced", seed=seed.child("reduced"))
    del total
    gathered = comm.allgather_async(reduced, f"{name}.ag").wait()
    del reduced
    ops.record_use(gathered)
    return gathered, ctx2, row_bytes


__all__ = ["Reduction", "allreduce_wire_bytes", "compressed_allreduce", "padded_numel", "reduce_bucket", "side_region"]
