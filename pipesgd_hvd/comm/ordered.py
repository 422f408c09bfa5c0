"""One pipeline communicator per process, shared by every optimizer, whose tensor collectives are
all issued by one thread, in the order they were submitted.

Why: the pipeline channel's groups (Gloo pairs, an NCCL communicator) match transfers by the
order in which each rank issues them. With one channel per optimizer, a process held one NCCL
communicator per optimizer on its GPU, issued from as many comm threads at timing-dependent
moments; NCCL documents that communicators used concurrently on one device can deadlock unless
every rank issues their operations in the same order. And within one channel, a byte codec's
phases (comm thread) and a plain all-reduce or the membership flags (training thread) of another
optimizer could interleave differently on different ranks.

So :class:`OrderedCommunicator` wraps the process's one communicator (the channel under Horovod,
torch.distributed under torchrun) with an :class:`IssueThread`:

* a tensor collective called on the issue thread (a comm job: the compressed all-reduce's phases)
  is issued at once;
* one called on any other thread (the training thread's plain all-reduces and flags, the auto
  mode's probes) is handed to the issue thread and issued there after everything submitted
  before it; a device tensor's producer stream is marked first, and the issue thread's stream
  waits for the mark before the collective reads it;
* the engines submit their comm jobs to the same thread (``issue_thread``), so every collective of
  every optimizer is issued in submission order, which is program order on every rank (the
  training thread, or autograd's thread during backward: one at a time either way).

``allgather_object`` (the cross-rank checks) stays on the calling thread: it has its own group,
which is not ordered with the tensor collectives by design (:mod:`.base`).
"""
from __future__ import annotations

import atexit
import concurrent.futures
import threading
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

from ..ops.base import Tensor
from .base import ReduceOp


class IssueThread:
    """A single worker thread with a FIFO queue (``submit`` as ThreadPoolExecutor's)."""

    def __init__(self, name: str = "pipesgd-issue") -> None:
        self._ident: Optional[int] = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name, initializer=self._started)

    def _started(self) -> None:
        self._ident = threading.get_ident()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self._pool.submit(fn, *args, **kwargs)

    def on_thread(self) -> bool:
        """The caller is the issue thread itself (a job running on it)."""
        return threading.get_ident() == self._ident

    @property
    def ident(self) -> Optional[int]:
        return self._ident

    def shutdown(self, wait: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=True)


class _Issued:
    """A handle whose collective is issued on the issue thread: ``wait()`` waits for the issue,
    then for the transfer (on the calling thread, so its stream follows the result)."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def wait(self) -> Any:
        return self._future.result().wait()

    def done(self) -> bool:
        return self._future.done() and (self._future.exception() is not None or self._future.result().done())


class OrderedCommunicator:
    """The Communicator protocol over ``comm``, every tensor collective issued by one thread.

    ``ops``: the tensor-op table whose markers order a device tensor's producer stream before
    the issue thread's. ``closes_at_exit``: this object is shared; one optimizer finishing at
    exit must not close it under the others (:func:`shared_communicator` closes it last)."""

    closes_at_exit = True

    def __init__(self, comm: Any, ops: Any, name: str = "pipesgd-issue") -> None:
        self.inner, self._ops = comm, ops
        self.issue_thread = IssueThread(name)
        self.issued: Optional[List[Tuple[int, str]]] = None  # tests: set to [] to log (thread, name)
        self._closed = False

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def closed(self) -> bool:
        return self._closed

    def _issue(self, x: Tensor, name: str, call: Callable[[], Any]) -> Any:
        if self._closed:
            raise RuntimeError(f"'{name}' was not issued: the pipeline's communicator was closed")
        if self.issue_thread.on_thread():
            return self._logged(name, call)
        marker = self._ops.ready_marker(x)  # the producer's stream, on the submitting thread

        def issue() -> Any:
            self._ops.wait_marker(marker)  # the issue thread's stream waits before the collective reads x
            return self._logged(name, call)

        return _Issued(self.issue_thread.submit(issue))

    def _logged(self, name: str, call: Callable[[], Any]) -> Any:
        if self.issued is not None:
            self.issued.append((threading.get_ident(), name))
        return call()

    def allreduce_async_(self, x: Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> Any:
        return self._issue(x, name, lambda: self.inner.allreduce_async_(x, name, op, prescale, postscale))

    def alltoall_async(self, x: Tensor, name: str) -> Any:
        return self._issue(x, name, lambda: self.inner.alltoall_async(x, name))

    def allgather_async(self, x: Tensor, name: str) -> Any:
        return self._issue(x, name, lambda: self.inner.allgather_async(x, name))

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        return self.inner.allgather_object(obj, name)

    def close(self) -> None:
        """Closes the communicator for every user (the world is gone: a lost peer, an elastic
        reset, exit) and stops the issue thread without waiting for it."""
        if self._closed:
            return
        self._closed = True
        self.issue_thread.shutdown(wait=False)
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


# The process's shared communicators, by world: "one per process" is process-wide state by nature.
_SHARED: Dict[Hashable, OrderedCommunicator] = {}
_LOCK = threading.Lock()
_EXIT_REGISTERED = False


def shared_communicator(key: Hashable, build: Callable[[], Any], ops: Any) -> OrderedCommunicator:
    """The process's communicator for ``key`` (a world: e.g. Horovod's rank and size), built by
    ``build()`` (collective) the first time, or again once the previous one was closed. Every rank
    creates its optimizers in the same order, so every rank builds at the same point."""
    close_at_exit()
    with _LOCK:
        shared = _SHARED.get(key)
        if shared is not None and not shared.closed:
            return shared
    shared = OrderedCommunicator(build(), ops)
    with _LOCK:
        for stale in [k for k, c in _SHARED.items() if c.closed]:
            del _SHARED[stale]
        _SHARED[key] = shared
    return shared


def close_at_exit() -> None:
    """Closes the shared communicators at interpreter exit, after every optimizer's own exit
    handler: atexit runs last in, first out, and this is registered once, when the first
    optimizer asks for its transport (before it registers its handler). Idempotent."""
    global _EXIT_REGISTERED
    with _LOCK:
        if _EXIT_REGISTERED:
            return
        _EXIT_REGISTERED = True
    atexit.register(_close_all)


def _close_all() -> None:
    with _LOCK:
        shared = list(_SHARED.values())
        _SHARED.clear()
    for comm in shared:
        comm.close()
