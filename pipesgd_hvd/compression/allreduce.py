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

from typing import Callable, Tuple, Union

from ..comm.base import Communicator, ReduceOp, postscale_factor
from ..schedule import Seed, allreduce_wire_bytes
from ..tensor_ops import ITEMSIZE, Tensor, TensorOps
from .codecs import Codec


class Reduction:
    """A bucket's reduction, started or ready to run: ``wait()`` returns (the reduced tensor,
    the bytes this rank sent)."""

    def __init__(self, wait: Callable[[], Tuple[Tensor, int]]) -> None:
        self._wait = wait

    def wait(self) -> Tuple[Tensor, int]:
        return self._wait()


def reduce_bucket(ops: TensorOps, comm: Communicator, codec: Codec, flat: Tensor, *, name: str, key: str,
                  seed: Seed, op: ReduceOp = ReduceOp.AVERAGE, prescale: float = 1.0,
                  postscale: float = 1.0) -> Reduction:
    """Reduce the flat bucket ``flat`` across ranks with ``codec``.

    A summable codec's payload goes through a plain all-reduce, started here (in place on
    ``flat`` for ``none``); ``wait()`` waits and decodes. A byte codec's compressed all-reduce
    blocks between its phases, so it runs inside ``wait()``: the caller picks the thread (the
    engine's communication thread; at trace time for TensorFlow, where it only builds ops)."""
    if codec.summable:
        payload, ctx = codec.encode(ops, flat, key=key, seed=seed)
        handle = comm.allreduce_async_(payload, name, op, prescale, postscale)
        sent = allreduce_wire_bytes(ops.numel(payload), ops.dtype_name(payload), comm.size)
        return Reduction(lambda: (codec.decode(ops, handle.wait(), ctx), sent))
    return Reduction(lambda: compressed_allreduce(ops, comm, codec, flat, name=name, key=key, seed=seed, op=op,
                                                  prescale=prescale, postscale=postscale))


def compressed_allreduce(ops: TensorOps, comm: Communicator, codec: Codec, x: Tensor, *,
                         name: str, key: str, seed: Union[Seed, int], op: ReduceOp = ReduceOp.AVERAGE,
                         prescale: float = 1.0, postscale: float = 1.0) -> Tuple[Tensor, int]:
    """Reduce the flat float tensor ``x`` across ranks with a byte codec (blocking).

    Returns the reduced tensor (``x``'s length and dtype) and the bytes this rank sent.
    ``seed``: stochastic rounding's (an int is taken as ``Seed(seed)``).
    """
    seed = seed if isinstance(seed, Seed) else Seed(int(seed))
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

    # The transport's outputs may come from its own stream's memory (Horovod allocates them on its
    # thread); they are decoded on this one, so they are recorded here (see frameworks/torch_cuda.py).
    payload, ctx = codec.encode(ops, rows, key=f"{key}/send", seed=seed.child("send"))
    received = comm.alltoall_async(payload, f"{name}.a2a").wait()
    ops.record_use(received)
    total = codec.decode_sum(ops, received, ctx, postscale_factor(op, postscale, size))

    reduced, ctx2 = codec.encode(ops, total, key=f"{key}/reduced", seed=seed.child("reduced"))
    gathered = comm.allgather_async(reduced, f"{name}.ag").wait()
    ops.record_use(gathered)
    out = ops.reshape(codec.decode(ops, gathered, ctx2), (size * cols,))[:n]

    row_bytes = ops.shape(payload)[1] * ITEMSIZE["uint8"]
    sent = 2 * (size - 1) * row_bytes
    return (ops.cast(out, dtype) if dtype != "float32" else out), sent


__all__ = ["Reduction", "allreduce_wire_bytes", "compressed_allreduce", "reduce_bucket"]
