"""A Gloo group with NCCL's work semantics, in place of the pipeline channel's NCCL group on a CPU.

What it copies from ``ProcessGroupNCCL`` (torch 2.x, ProcessGroupNCCL.cpp): a collective runs on
its own (Gloo's worker threads run it, as the GPU runs NCCL's kernel), ``is_completed()`` turns
true once it ran or failed, and ``wait()`` never blocks the host and never raises for a transfer
still in flight (it only orders the caller's stream after it); it raises only an error already
recorded (``inject_error``: what NCCL records when a peer dies). Its own timeout is later than
``PIPESGD_TIMEOUT``, as the real factory's. ``abort()`` is recorded.

What it cannot copy: NCCL's kernels, streams and its watchdog ending the process; those are the
GPU check's (tools/gpu_check_channel.py).
"""
from __future__ import annotations

import datetime
import threading
from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from pipesgd_hvd.comm.device_group import watchdog_timeout


class NcclLikeWork:
    def __init__(self, gloo_work: Any) -> None:
        self._gloo = gloo_work
        self.error: Optional[str] = None  # an NCCL error recorded for it (NcclLikeGroup.inject_error)

    def is_completed(self) -> bool:
        # Gloo's worker threads run the collective; a silent peer keeps it incomplete, as NCCL's.
        return self.error is not None or bool(self._gloo.is_completed())

    def wait(self) -> bool:
        if self.error is not None:
            raise RuntimeError(f"NCCL error (stand-in): {self.error}")
        if self._gloo.is_completed():
            self._gloo.wait()  # done: returns at once
        return True  # NCCL: the current stream waits; the host does not


class NcclLikeGroup:
    """Connects lazily, as NCCL makes its communicator at the first collective (or at
    ``eager_connect_single_device``), blocking until every rank has joined."""

    def __init__(self, connect: Any, rank: int) -> None:
        self._connect, self._gloo_group, self.rank = connect, None, rank
        self.aborts = 0
        self.works: List[NcclLikeWork] = []
        self._lock = threading.Lock()

    @property
    def _gloo(self) -> Any:
        with self._lock:
            if self._gloo_group is None:
                self._gloo_group = self._connect()
            return self._gloo_group

    def eager_connect_single_device(self, device: Any) -> None:
        self._gloo  # noqa: B018 - connects

    def _work(self, gloo_work: Any) -> NcclLikeWork:
        work = NcclLikeWork(gloo_work)
        self.works.append(work)
        return work

    def allreduce(self, tensors: List[Any], opts: Any) -> NcclLikeWork:
        return self._work(self._gloo.allreduce(tensors, opts))

    def alltoall_base(self, out: Any, x: Any, out_splits: List[int], in_splits: List[int], opts: Any) -> NcclLikeWork:
        return self._work(self._gloo.alltoall_base(out, x, out_splits, in_splits, opts))

    def _allgather_base(self, out: Any, x: Any) -> NcclLikeWork:
        return self._work(self._gloo._allgather_base(out, x))

    def inject_error(self, message: str) -> None:
        """What NCCL reports when a peer's process dies mid-collective (ncclRemoteError): every
        unfinished work completes with the error."""
        for work in self.works:
            if not work.is_completed():
                work.error = message

    def abort(self) -> None:
        self.aborts += 1
        if self._gloo_group is not None:
            self._gloo_group.abort()


class NcclLikeFactory:
    """The channel's ``device_group`` argument: makes an :class:`NcclLikeGroup` and records, per
    creation, (rank, the creating thread, the group)."""

    def __init__(self, address: str = "127.0.0.1", margin: float = 1.0) -> None:
        self.address, self.margin = address, margin
        self.made: List[Tuple[int, int, NcclLikeGroup]] = []
        self._lock = threading.Lock()

    def __call__(self, store: Any, rank: int, size: int, timeout: Optional[float]) -> NcclLikeGroup:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.address)]
        # Later than PIPESGD_TIMEOUT, as the real factory's (watchdog_timeout), but by a short
        # margin, so that a transfer left waiting ends within the test.
        opts._timeout = watchdog_timeout(None) if timeout is None else datetime.timedelta(seconds=timeout + self.margin)
        group = NcclLikeGroup(lambda: dist.ProcessGroupGloo(store, rank, size, opts), rank)
        with self._lock:
            self.made.append((rank, threading.get_ident(), group))
        return group
