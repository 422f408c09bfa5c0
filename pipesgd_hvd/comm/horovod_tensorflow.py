"""Horovod's TensorFlow ops behind the Communicator protocol, eagerly and inside tf.function.

A TensorFlow collective is an op in the step's graph: it starts when its inputs are ready and
the executor gets to it, so "async" here means "an op whose result is a tensor"; the handles are
already done. Overlap comes from the graph (see keras/optimizer.py), not from polling.
"""
from __future__ import annotations

import re
from typing import Any, List

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from . import wire
from .base import DoneHandle, ReduceOp

_HVD_OPS = {ReduceOp.SUM: hvd.Sum, ReduceOp.AVERAGE: hvd.Average}


def op_name(name: str) -> str:
    """Horovod matches tensors across ranks by op name; TensorFlow allows only some characters."""
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", name)


class HorovodTensorFlowCommunicator:
    """Requires ``hvd.init()`` first, like Horovod's own optimizer."""

    def __init__(self) -> None:
        if not hvd.is_initialized():
            raise RuntimeError("Horovod is not initialized: call hvd.init() before creating the optimizer")

    @property
    def rank(self) -> int:
        return hvd.rank()

    @property
    def size(self) -> int:
        return hvd.size()

    def allreduce_async_(self, x: tf.Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> DoneHandle:
        # Functional, not in place: the reduced tensor is what wait() returns.
        return DoneHandle(hvd.allreduce(x, op=_HVD_OPS[op], prescale_factor=prescale,
                                        postscale_factor=postscale, name=op_name(name)))

    # Horovod's shape functions leave the first dimension unknown in a graph (splits could vary);
    # ours are equal, and the codecs need static shapes, so the reshapes restore them (no copy).
    def alltoall_async(self, x: tf.Tensor, name: str) -> DoneHandle:
        return DoneHandle(tf.reshape(hvd.alltoall(x, name=op_name(name)), x.shape))

    def allgather_async(self, x: tf.Tensor, name: str) -> DoneHandle:
        out = hvd.allgather(x, name=op_name(name))
        return DoneHandle(tf.reshape(out, (self.size * int(x.shape[0]),) + tuple(x.shape[1:])))

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        # Eager only. Not hvd.allgather_object: it unpickles what it receives. Sizes, then the
        # bytes of the typed encoding (wire.py); Horovod's allgather takes rows of any length.
        data = tf.constant(np.frombuffer(wire.encode(obj), dtype=np.uint8))
        sizes = hvd.allgather(tf.constant([int(data.shape[0])], dtype=tf.int64), name=op_name(f"{name}.sz")).numpy()
        gathered = hvd.allgather(data, name=op_name(f"{name}.data")).numpy().tobytes()
        out, offset = [], 0
        for size in sizes.tolist():
            out.append(wire.decode(gathered[offset:offset + size]))
            offset += size
        return out


def broadcast_object(obj: Any, root_rank: int = 0, name: Any = None) -> Any:
    """``hvd.broadcast_object`` in the typed encoding of :mod:`.wire` (Horovod's own unpickles what
    it receives); eager. Horovod's elastic ``ObjectState`` takes it as its ``bcast_object``."""
    name = op_name(name or "pipesgd.broadcast_object")
    data = wire.encode(obj) if hvd.rank() == root_rank else b""
    size = int(hvd.broadcast(tf.constant([len(data)], dtype=tf.int64), root_rank, name=f"{name}.sz").numpy()[0])
    buffer = np.frombuffer(data, dtype=np.uint8) if data else np.zeros(size, dtype=np.uint8)
    return wire.decode(hvd.broadcast(tf.constant(buffer), root_rank, name=name).numpy().tobytes())
