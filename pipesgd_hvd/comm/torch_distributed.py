"""torch.distributed (Gloo on CPU, NCCL on GPU): the fallback when Horovod is absent (torchrun).

Host tensors (the membership flags, a CPU model) always go to a Gloo group of our own, device
tensors to a group on the default backend: under ``init_process_group("nccl")`` a group of the
default backend is NCCL-only and refuses host tensors ("No backend type associated with device
type cpu"). Which tensors are device tensors, the tensor-op table says (``ops``; tests fake it).
The device group's own timeout is ``PIPESGD_TIMEOUT`` plus a margin, so that the polled wait
raises ``PeerLostError`` before PyTorch's NCCL watchdog ends the process (.device_group)."""
from __future__ import annotations

import datetime
from typing import Any, Callable, List, Optional, TypeVar

import torch
import torch.distributed as dist

from ..ops.torch import TORCH_OPS, TorchOps
from . import wire
from .base import TIMEOUT_CAUSES, PeerLostError, PolledHandle, ReduceOp, default_timeout, postscale_factor
from .device_group import watchdog_timeout

T = TypeVar("T")


def _translated(call: Callable[[], T], what: str) -> T:
    """Gloo and NCCL report a broken connection or their own timeout as a RuntimeError (a
    DistBackendError on recent PyTorch): the same PeerLostError as every other transport."""
    try:
        return call()
    except RuntimeError as exc:
        raise PeerLostError(f"torch.distributed failed during {what} ({str(exc).splitlines()[0]}): "
                            f"{TIMEOUT_CAUSES}") from exc


class TorchDistributedCommunicator:
    """Requires ``torch.distributed.init_process_group`` first (torchrun does the rest).
    Constructing it is collective: every rank must construct it, in the same order."""

    def __init__(self, group: Optional[Any] = None, timeout: Optional[float] = None,
                 ops: Optional[TorchOps] = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "torch.distributed.init_process_group() first (or use Horovod)")
        self._timeout = timeout if timeout is not None else default_timeout()
        self._device_of = (ops if ops is not None else TORCH_OPS).streams.cuda.device_of
        # Our own groups (created collectively, like the optimizer itself): they pair collectives
        # by issue order, and a user's metric all_reduce on the default group, issued while a
        # pipelined reduction is in flight on our comm thread, must not interleave with it.
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        limit = datetime.timedelta(seconds=self._timeout if self._timeout is not None else 10 * 365 * 86400)
        self._group = group if group is not None else dist.new_group(ranks=ranks, timeout=watchdog_timeout(self._timeout))
        self._host_group = dist.new_group(ranks=ranks, timeout=limit, backend="gloo")
        # Checks get a group of their own (they run while reductions are in flight, and a rank
        # missing one of those must still answer the check), bounded by the same timeout; Gloo
        # whatever the default backend: the checks gather host bytes (the typed encoding).
        self._check_group = dist.new_group(ranks=ranks, timeout=limit, backend="gloo")

    def _group_for(self, x: torch.Tensor) -> Any:
        return self._host_group if self._device_of(x) is None else self._group

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self._group)

    def _polled(self, work: Any, finish: Callable[[], Any], what: str) -> PolledHandle:
        return PolledHandle(work.is_completed, lambda: _translated(finish, what), what, self._timeout)

    def allreduce_async_(self, x: torch.Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> PolledHandle:
        if prescale != 1.0:
            x.mul_(prescale)
        work = dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self._group_for(x), async_op=True)
        after = postscale_factor(op, postscale, self.size)

        def finish() -> torch.Tensor:
            work.wait()
            return x.mul_(after) if after != 1.0 else x

        return self._polled(work, finish, f"allreduce '{name}'")

    def alltoall_async(self, x: torch.Tensor, name: str) -> PolledHandle:
        x = x.contiguous()
        out = torch.empty_like(x)
        work = dist.all_to_all_single(out, x, group=self._group_for(x), async_op=True)
        return self._polled(work, lambda: (work.wait(), out)[1], f"alltoall '{name}'")

    def allgather_async(self, x: torch.Tensor, name: str) -> PolledHandle:
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:]))
        work = dist.all_gather_into_tensor(out, x, group=self._group_for(x), async_op=True)
        return self._polled(work, lambda: (work.wait(), out)[1], f"allgather '{name}'")

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        # Not dist.all_gather_object: it unpickles what it receives. Sizes, then the padded bytes
        # of the typed encoding (wire.py).
        what = f"allgather_object '{name}'"
        data = torch.frombuffer(bytearray(wire.encode(obj)), dtype=torch.uint8)
        sizes = torch.empty(self.size, dtype=torch.int64)
        _translated(lambda: dist.all_gather_into_tensor(sizes, torch.tensor([data.numel()], dtype=torch.int64),
                                                        group=self._check_group), what)
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        gathered = torch.empty(self.size * longest, dtype=torch.uint8)
        _translated(lambda: dist.all_gather_into_tensor(gathered, padded, group=self._check_group), what)
        rows = gathered.view(self.size, longest)
        return [wire.decode(rows[r, :int(sizes[r])].numpy().tobytes()) for r in range(self.size)]
