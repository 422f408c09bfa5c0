"""Horovod's PyTorch ops (NCCL on GPU, Gloo or MPI on CPU) behind the Communicator protocol."""
from __future__ import annotations

from typing import Any, List, Optional

import horovod.torch as hvd
import torch

from .base import PolledHandle, ReduceOp, default_timeout

_HVD_OPS = {ReduceOp.SUM: hvd.Sum, ReduceOp.AVERAGE: hvd.Average}


class HorovodTorchCommunicator:
    """Requires ``hvd.init()`` first, like Horovod's own optimizer."""

    def __init__(self, timeout: Optional[float] = None) -> None:
        if not hvd.is_initialized():
            raise RuntimeError("Horovod is not initialized: call hvd.init() before creating the optimizer")
        self._timeout = timeout if timeout is not None else default_timeout()

    @property
    def rank(self) -> int:
        return hvd.rank()

    @property
    def size(self) -> int:
        return hvd.size()

    def _handle(self, handle: int, what: str, pick: Any = None) -> PolledHandle:
        def finish() -> Any:
            out = hvd.synchronize(handle)
            return out[0] if pick == "first" else out

        return PolledHandle(lambda: hvd.poll(handle), finish, what, self._timeout)

    def allreduce_async_(self, x: torch.Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> PolledHandle:
        handle = hvd.allreduce_async_(x, name=name, op=_HVD_OPS[op],
                                      prescale_factor=prescale, postscale_factor=postscale)
        return self._handle(handle, f"allreduce '{name}'")

    def alltoall_async(self, x: torch.Tensor, name: str) -> PolledHandle:
        # splits=None: equal rows to every rank; synchronize returns (output, received_splits).
        handle = hvd.alltoall_async(x, name=name)
        return self._handle(handle, f"alltoall '{name}'", pick="first")

    def allgather_async(self, x: torch.Tensor, name: str) -> PolledHandle:
        handle = hvd.allgather_async(x, name=name)
        return self._handle(handle, f"allgather '{name}'")

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        return list(hvd.allgather_object(obj, name=name))
