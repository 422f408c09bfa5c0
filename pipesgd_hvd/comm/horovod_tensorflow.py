"""Horovod's TensorFlow ops behind the Communicator protocol, eagerly and inside tf.function.

A TensorFlow collective is an op in the step's graph: it starts when its inputs are ready and
the executor gets to it, so "async" here means "an op whose result is a tensor"; the handles are
already done. Overlap comes from the graph (see tensorflow/optimizer.py), not from polling.
"""
from __future__ import annotations

import re
from typing import Any, List

import horovod.tensorflow as hvd
import tensorflow as tf

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
        return list(hvd.allgather_object(obj, name=op_name(name)))
