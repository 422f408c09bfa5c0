"""MPI directly through mpi4py on host buffers: the fastest transport on one CPU host.

Works under ``mpirun`` or ``horovodrun --mpi`` (an MPI world must exist). Tensors move as
zero-copy numpy views; dtypes MPI cannot sum (float16, bfloat16) are summed in float32.
"""
from __future__ import annotations

from typing import Any, List, Optional

import numpy as np
from mpi4py import MPI

from ..ops.base import MutableTensorOps, Tensor
from . import wire
from .base import PolledHandle, ReduceOp, default_timeout, postscale_factor

_MPI_SUMMABLE = ("float32", "float64")


class Mpi4pyCommunicator:
    # Moves host buffers only (zero-copy numpy views, reduced in place): the optimizer refuses
    # CUDA parameters with it at construction instead of failing inside a backward hook.
    host_only = True

    def __init__(self, ops: MutableTensorOps, comm: Optional[Any] = None,
                 timeout: Optional[float] = None) -> None:
        self._ops = ops
        # A duplicate of the world (collective): MPI matches collectives by issue order within a
        # communicator, so the pipeline's traffic must not share one with the user's own calls.
        self._comm = comm if comm is not None else MPI.COMM_WORLD.Dup()
        # Checks get a communicator of their own: they run while reductions are in flight, and a
        # rank missing one of those (fewer step() calls) must still answer the check.
        self._check_comm = self._comm.Dup()
        self._timeout = timeout if timeout is not None else default_timeout()

    @property
    def rank(self) -> int:
        return self._comm.Get_rank()

    @property
    def size(self) -> int:
        return self._comm.Get_size()

    def _polled(self, request: Any, finish: Any, what: str) -> PolledHandle:
        return PolledHandle(lambda: request.Test(), finish, what, self._timeout)

    def allreduce_async_(self, x: Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> PolledHandle:
        ops = self._ops
        dtype = ops.dtype_name(x)
        work = x if dtype in _MPI_SUMMABLE else ops.cast(x, "float32")
        if prescale != 1.0:
            ops.assign(work, work * prescale)
        buf = ops.to_numpy(work)
        request = self._comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        after = postscale_factor(op, postscale, self.size)

        def finish() -> Tensor:
            request.Wait()
            result = work * after if after != 1.0 else work
            return ops.assign(x, result if dtype in _MPI_SUMMABLE else ops.cast(result, dtype))

        return self._polled(request, finish, f"allreduce '{name}'")

    def alltoall_async(self, x: Tensor, name: str) -> PolledHandle:
        send = np.ascontiguousarray(self._ops.to_numpy(x))
        recv = np.empty_like(send)
        request = self._comm.Ialltoall(send, recv)

        def finish() -> Tensor:
            request.Wait()
            return self._ops.from_numpy(recv, like=x)

        return self._polled(request, finish, f"alltoall '{name}'")

    def allgather_async(self, x: Tensor, name: str) -> PolledHandle:
        send = np.ascontiguousarray(self._ops.to_numpy(x))
        recv = np.empty((self.size * send.shape[0],) + send.shape[1:], dtype=send.dtype)
        request = self._comm.Iallgather(send, recv)

        def finish() -> Tensor:
            request.Wait()
            return self._ops.from_numpy(recv, like=x)

        return self._polled(request, finish, f"allgather '{name}'")

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        # comm.allgather(obj) blocks with no timeout and unpickles what it receives: sizes, then the
        # padded bytes of the typed encoding (wire.py), non-blocking.
        data = np.frombuffer(wire.encode(obj), dtype=np.uint8)
        sizes = np.empty(self.size, dtype=np.int64)
        request = self._check_comm.Iallgather(np.array([data.size], dtype=np.int64), sizes)
        self._polled(request, request.Wait, f"allgather_object '{name}' (sizes)").wait()
        longest = int(sizes.max())
        send = np.zeros(longest, dtype=np.uint8)
        send[:data.size] = data
        recv = np.empty((self.size, longest), dtype=np.uint8)
        request = self._check_comm.Iallgather(send, recv)
        self._polled(request, request.Wait, f"allgather_object '{name}'").wait()
        return [wire.decode(recv[r, :sizes[r]].tobytes()) for r in range(self.size)]
