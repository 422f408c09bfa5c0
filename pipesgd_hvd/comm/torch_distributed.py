"""torch.distributed (Gloo on CPU, NCCL on GPU): the fallback when Horovod is absent (torchrun)."""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist

from .base import PolledHandle, ReduceOp, postscale_factor, default_timeout


class TorchDistributedCommunicator:
    """Requires ``torch.distributed.init_process_group`` first (torchrun does the rest).
    Constructing it is collective: every rank must construct it, in the same order."""

    def __init__(self, group: Optional[Any] = None, timeout: Optional[float] = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "torch.distributed.init_process_group() first (or use Horovod)")
        # Our own group (created collectively, like the optimizer itself): Gloo pairs collectives
        # by issue order, and a user's metric all_reduce on the default group, issued while a
        # pipelined reduction is in flight on our comm thread, must not interleave with it.
        self._group = group if group is not None else dist.new_group()
        self._timeout = timeout if timeout is not None else default_timeout()

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self._group)

    def _polled(self, work: Any, finish: Any, what: str) -> PolledHandle:
        return PolledHandle(work.is_completed, finish, what, self._timeout)

    def allreduce_async_(self, x: torch.Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> PolledHandle:
        if prescale != 1.0:
            x.mul_(prescale)
        work = dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        after = postscale_factor(op, postscale, self.size)

        def finish() -> torch.Tensor:
            work.wait()
            return x.mul_(after) if after != 1.0 else x

        return self._polled(work, finish, f"allreduce '{name}'")

    def alltoall_async(self, x: torch.Tensor, name: str) -> PolledHandle:
        x = x.contiguous()
        out = torch.empty_like(x)
        work = dist.all_to_all_single(out, x, group=self._group, async_op=True)
        return self._polled(work, lambda: (work.wait(), out)[1], f"alltoall '{name}'")

    def allgather_async(self, x: torch.Tensor, name: str) -> PolledHandle:
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:]))
        work = dist.all_gather_into_tensor(out, x, group=self._group, async_op=True)
        return self._polled(work, lambda: (work.wait(), out)[1], f"allgather '{name}'")

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._group)
        return out
