"""Horovod's PyTorch ops (NCCL on GPU, Gloo or MPI on CPU) behind the Communicator protocol."""
from __future__ import annotations

import os
from typing import Any, Callable, List, Optional, TypeVar

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError

from ..ops.torch import TORCH_OPS
from . import wire
from .base import PeerLostError, PolledHandle, ReduceOp, default_timeout

_HVD_OPS = {ReduceOp.SUM: hvd.Sum, ReduceOp.AVERAGE: hvd.Average}
T = TypeVar("T")


class HorovodPeerLostError(PeerLostError, HorovodInternalError):
    """Horovod shut down under a collective. Also a HorovodInternalError, so that code written for
    Horovod (``hvd.elastic.run`` resets on it) sees the failure it expects."""


def _lost(what: str, exc: BaseException) -> PeerLostError:
    first = str(exc).split(". ")[0].strip()
    return HorovodPeerLostError(
        f"a peer was lost: Horovod shut down while {what} was in flight ({first}). Horovod shuts down when a "
        "peer's process dies or its host stops answering, or when its stall shutdown "
        "(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) fires because ranks issued different collectives (different "
        "numbers of step() calls, a skipped backward pass). Look for the first error in the other ranks' logs, "
        "then restart every rank from the last checkpoint")


def _translated(call: Callable[[], T], what: str) -> T:
    """Runs a Horovod call; the errors Horovod raises once it has shut down become PeerLostError."""
    try:
        return call()
    except HorovodInternalError as exc:
        raise _lost(what, exc) from exc
    except (RuntimeError, ValueError) as exc:
        if "shut down" not in str(exc):  # anything else is not a transport failure: let it through
            raise
        raise _lost(what, exc) from exc


def join_async(timeout: Optional[float] = None) -> PolledHandle:
    """Horovod's ``hvd.join()``, started without blocking: while it is pending, Horovod's own
    collectives of the other ranks (metric all-reduces) complete with zeros from this rank, as
    Horovod's join does, and this thread can go on taking part in the pipeline's steps (which do
    not use Horovod's ops). ``wait()`` returns the rank that joined Horovod last."""
    from horovod.torch import mpi_ops

    output = torch.tensor(-1, dtype=torch.int)
    handle = _translated(lambda: mpi_ops.mpi_lib.horovod_torch_join(output, -1), "join")
    mpi_ops._handle_map[handle] = (None, output)
    finish = lambda: int(_translated(lambda: hvd.synchronize(handle), "join").item())  # noqa: E731
    return PolledHandle(lambda: _translated(lambda: hvd.poll(handle), "join"), finish, "join",
                        timeout if timeout is not None else default_timeout())


def async_completion_enabled() -> bool:
    """Horovod's ``HOROVOD_ENABLE_ASYNC_COMPLETION`` (read by Horovod at ``hvd.init()``)."""
    return os.environ.get("HOROVOD_ENABLE_ASYNC_COMPLETION", "").strip().lower() in ("1", "true", "yes", "on")


class HorovodTorchCommunicator:
    """Requires ``hvd.init()`` first, like Horovod's own optimizer.

    On CUDA: with ``HOROVOD_ENABLE_ASYNC_COMPLETION`` a finished handle only means that Horovod
    made the device's default stream wait for the collective, so every result is followed by a
    wait of the current stream (the pipeline's side stream, on the comm thread) for the default
    stream (``ops.follow_default_stream``); without it Horovod has waited for the GPU on the host.
    bfloat16 tensors (which Horovod's PyTorch ops refuse) are summed in float32 and written back."""

    def __init__(self, timeout: Optional[float] = None, ops: Optional[Any] = None,
                 async_completion: Optional[bool] = None) -> None:
        if not hvd.is_initialized():
            raise RuntimeError("Horovod is not initialized: call hvd.init() before creating the optimizer")
        self._timeout = timeout if timeout is not None else default_timeout()
        self._ops = ops if ops is not None else TORCH_OPS
        self._async = async_completion_enabled() if async_completion is None else async_completion

    @property
    def rank(self) -> int:
        return hvd.rank()

    @property
    def size(self) -> int:
        return hvd.size()

    def _handle(self, handle: int, what: str, pick: Any = None,
                after: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> PolledHandle:
        def finish() -> Any:
            out = _translated(lambda: hvd.synchronize(handle), what)
            out = out[0] if pick == "first" else out
            if self._async:
                self._ops.follow_default_stream(out)
            return after(out) if after is not None else out

        return PolledHandle(lambda: _translated(lambda: hvd.poll(handle), what), finish, what, self._timeout)

    def allreduce_async_(self, x: torch.Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> PolledHandle:
        what = f"allreduce '{name}'"
        # Horovod has no bfloat16 ops for PyTorch ("Tensor type torch.BFloat16Tensor is not
        # supported"): sum a float32 copy, as the compressed path sums, and round once back into x.
        work = x.float() if x.dtype == torch.bfloat16 else x
        handle = _translated(lambda: hvd.allreduce_async_(work, name=name, op=_HVD_OPS[op], prescale_factor=prescale,
                                                          postscale_factor=postscale), what)
        return self._handle(handle, what, after=None if work is x else lambda out: x.copy_(out))

    def alltoall_async(self, x: torch.Tensor, name: str) -> PolledHandle:
        # splits=None: equal rows to every rank; synchronize returns (output, received_splits).
        what = f"alltoall '{name}'"
        handle = _translated(lambda: hvd.alltoall_async(x, name=name), what)
        return self._handle(handle, what, pick="first")

    def allgather_async(self, x: torch.Tensor, name: str) -> PolledHandle:
        what = f"allgather '{name}'"
        handle = _translated(lambda: hvd.allgather_async(x, name=name), what)
        return self._handle(handle, what)

    @property
    def error_type(self) -> type:
        return HorovodPeerLostError

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        # hvd.allgather_object blocks in synchronize() with no timeout and unpickles what it
        # receives: the same two allgathers (sizes, then the bytes, whose first dimension may differ
        # per rank) of the typed encoding (wire.py), through polled handles.
        data = torch.frombuffer(bytearray(wire.encode(obj)), dtype=torch.uint8)
        sizes = self.allgather_async(torch.tensor([data.numel()], dtype=torch.int64), f"{name}.sz").wait()
        gathered = self.allgather_async(data, f"{name}.data").wait()
        out, offset = [], 0
        for size in sizes.tolist():
            out.append(wire.decode(gathered[offset:offset + size].numpy().tobytes()))
            offset += size
        return out
