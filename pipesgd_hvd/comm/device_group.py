"""The pipeline channel's group for device (CUDA) tensors, with the failure semantics of its Gloo
groups: a wait blocks until the transfer is done and raises when it failed or timed out.

Why a wrapper: a ``ProcessGroupNCCL`` work does not behave like a Gloo one (PyTorch's
``ProcessGroupNCCL.cpp``, read for torch 2.x). Its ``wait()`` only makes the calling thread's
current stream wait for the collective and returns at once; it neither blocks the host nor
raises for a transfer still waiting on a peer. A lost or stuck peer is noticed by PyTorch's
watchdog thread, which, at the group's own timeout (or at an NCCL error), ends the whole process
by default (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` unset, i.e. 3). A caller written for Gloo would
get an unfinished result, and the process would die without a ``PeerLostError``.

So a :class:`DeviceWork`'s ``wait()``:

* polls the work's status (``is_completed()``: true once the kernel has run or the work holds an
  NCCL error) with a short, growing sleep, so the host thread waits without holding the GIL;
* once complete, calls the work's own ``wait()``: the current stream waits for the collective
  (no host sync), or NCCL's recorded error is raised;
* at ``PIPESGD_TIMEOUT`` after the collective was issued, or on that error, aborts the *group*
  (``ProcessGroupNCCL.abort()``: the watchdog stops checking, in-flight kernels end) and raises
  ``RuntimeError("Timed out ...")`` or the error, which the channel turns into ``PeerLostError``.

NCCL makes its communicator at the group's first collective and, by default, blocks there until
every rank has joined, with no timeout. So before its first collective the group is connected
(``eager_connect_single_device``) on a helper thread that the issuing thread waits for up to
``PIPESGD_TIMEOUT``: a peer that never joins gives ``RuntimeError("Timed out ...")`` too.

The NCCL group is made with a longer timeout than ``PIPESGD_TIMEOUT`` (:func:`watchdog_timeout`),
so that this wait, not the watchdog, is what notices a silent peer. An NCCL *error* (a peer's
process died, a broken link) is seen by the watchdog too; with the default error handling it
ends the process shortly after the ``PeerLostError`` was raised (docs/reliability.md,
"NCCL"); ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` keeps the process alive for Horovod elastic.

The group is injectable (the channel's ``device_group`` argument): tests put a Gloo group with
NCCL's work semantics in its place (tests/fake_nccl.py), so all of this runs on a CPU.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable, List, Optional

# A group factory: (store, rank, size, timeout seconds or None) -> a ProcessGroup-like object with
# allreduce, alltoall_base, _allgather_base and abort.
GroupFactory = Callable[[Any, int, int, Optional[float]], Any]

# How much later than PIPESGD_TIMEOUT the NCCL watchdog's own timeout fires: long enough for the
# polling wait to notice first and abort the group, even on a loaded host.
WATCHDOG_MARGIN_S = 60.0
_FOREVER = datetime.timedelta(days=3650)  # PIPESGD_TIMEOUT=0: no limit (the group needs a number)
_MAX_SLEEP_S = 0.002  # the most a finished transfer waits to be noticed


def watchdog_timeout(timeout: Optional[float]) -> datetime.timedelta:
    """The NCCL group's own timeout: ``PIPESGD_TIMEOUT`` plus :data:`WATCHDOG_MARGIN_S`."""
    return _FOREVER if timeout is None else datetime.timedelta(seconds=timeout + WATCHDOG_MARGIN_S)


def nccl_group(store: Any, rank: int, size: int, timeout: Optional[float]) -> Any:
    """The default device group: a ``ProcessGroupNCCL`` on ``store`` (the caller gives it its own
    prefix). Creating it connects nothing yet: PyTorch makes the NCCL communicator at the first
    collective, on the thread that issues it (the channel's issue thread)."""
    import torch.distributed as dist

    if not dist.is_nccl_available():
        raise RuntimeError("CUDA tensors on the pipeline channel need a PyTorch built with NCCL; this one has none "
                           "(a CPU build?): install the CUDA build of torch, or keep the model on the CPU")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = watchdog_timeout(timeout)
    return dist.ProcessGroupNCCL(store, rank, size, opts)


class DeviceGroup:
    """A device group whose works wait like Gloo's (module docstring). Issue from one thread."""

    def __init__(self, group: Any, timeout: Optional[float]) -> None:
        self._group, self._timeout = group, timeout
        self._abort_lock = threading.Lock()
        self._connected = False
        self.aborted: Optional[str] = None  # why the group was aborted, once it was

    # The ProcessGroup methods the channel's device branch calls.
    def allreduce(self, tensors: List[Any], opts: Any) -> "DeviceWork":
        return self._issued(tensors[0], lambda: self._group.allreduce(tensors, opts))

    def alltoall_base(self, out: Any, x: Any, out_splits: List[int], in_splits: List[int], opts: Any) -> "DeviceWork":
        return self._issued(x, lambda: self._group.alltoall_base(out, x, out_splits, in_splits, opts))

    def _allgather_base(self, out: Any, x: Any) -> "DeviceWork":
        return self._issued(x, lambda: self._group._allgather_base(out, x))

    def _issued(self, x: Any, post: Callable[[], Any]) -> "DeviceWork":
        if self.aborted is not None:
            raise RuntimeError(f"the pipeline channel's device group was aborted ({self.aborted})")
        if not self._connected:
            self._connect(x.device)
        return DeviceWork(post(), self)

    def _connect(self, device: Any) -> None:
        """Makes the communicator now, bounded by the timeout (module docstring)."""
        connect = getattr(self._group, "eager_connect_single_device", None)
        if connect is None:  # a group that connects at its first collective, bounded by itself
            self._connected = True
            return
        done, failed = threading.Event(), []

        def run() -> None:
            try:
                connect(device)
            except BaseException as exc:  # noqa: BLE001 - raised on the issuing thread below
                failed.append(exc)
            done.set()

        started = time.monotonic()
        threading.Thread(target=run, name="pipesgd-device-connect", daemon=True).start()
        if not done.wait(self._timeout):
            self.abort("making its communicator timed out")
            raise RuntimeError(f"Timed out after {time.monotonic() - started:.1f} s making the device group's "
                               "communicator: a peer did not join")
        if failed:
            raise RuntimeError(f"the device group's communicator could not be made: {failed[0]}")
        self._connected = True

    def abort(self, reason: str = "closed") -> None:
        """Aborts the group once (later calls do nothing): its in-flight collectives end, and
        PyTorch's NCCL watchdog stops checking them."""
        with self._abort_lock:
            if self.aborted is not None:
                return
            self.aborted = reason
        self._group.abort()

    @property
    def timeout(self) -> Optional[float]:
        return self._timeout


class DeviceWork:
    """One collective on a :class:`DeviceGroup`: ``wait()`` blocks, and raises on failure."""

    def __init__(self, work: Any, group: DeviceGroup) -> None:
        self._work, self._group = work, group
        self._issued_at = time.monotonic()

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self) -> bool:
        timeout, sleep = self._group.timeout, 0.00005
        while not self._work.is_completed():
            if self._group.aborted is not None:
                raise RuntimeError(f"the pipeline channel's device group was aborted ({self._group.aborted}) while "
                                   "this transfer was in flight")
            waited = time.monotonic() - self._issued_at
            if timeout is not None and waited > timeout:
                self._group.abort("a transfer timed out")
                raise RuntimeError(f"Timed out after {waited:.1f} s waiting for a transfer of the device group "
                                   "(its NCCL communicator was aborted)")
            time.sleep(sleep)
            sleep = min(2 * sleep, _MAX_SLEEP_S)
        try:
            self._work.wait()  # NCCL: the current stream waits for the collective; or its error is raised
        except RuntimeError as exc:
            self._group.abort("a transfer failed")
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RuntimeError(f"{first} (the device group was aborted; with NCCL, PyTorch's watchdog may end this "
                               "process next unless TORCH_NCCL_ASYNC_ERROR_HANDLING=2: docs/reliability.md)") from None
        return True
