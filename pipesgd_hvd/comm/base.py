"""The Communicator protocol: the three collectives the engine and the compressed all-reduce use.

Every collective returns a :class:`Handle`; ``wait()`` blocks until the result is there and
returns it. ``allreduce_async_`` works in place (trailing underscore); ``alltoall_async`` and
``allgather_async`` return new tensors. Collectives must be issued in the same order on every
rank (the engine guarantees it): MPI-style transports match them by order, Horovod by name.

No wait is unbounded: a collective that does not complete within ``PIPESGD_TIMEOUT`` seconds
(default :data:`DEFAULT_TIMEOUT_S`) raises :class:`PeerLostError`, and so does a transport that
reports a broken connection. ``docs/reliability.md`` lists what each failure gives.

Optional, where the transport can: ``status_board(namespace)`` (:mod:`.board`: where each rank
says what it is doing, read by the stall inspector) and ``error_type`` (the PeerLostError
subclass its failures raise).
"""
from __future__ import annotations

import enum
import os
import sys
import threading
import time
from typing import Any, Callable, List, Optional, Protocol

from ..ops.base import Tensor


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"


class PeerLostError(RuntimeError):
    """A collective did not complete because a peer went away or stopped answering."""


# torch.distributed's NCCL default: long enough for one rank to evaluate or write a checkpoint
# alone while the others wait in step(), short enough that a lost peer does not hold a job for hours.
DEFAULT_TIMEOUT_S = 600.0
# After a lost peer, how long interpreter exit may take before the process ends itself (see
# exit_if_stuck): a transport's own shutdown can wait forever for the peer that is gone.
DEFAULT_EXIT_GRACE_S = 10.0

# Why a collective may never complete; every timeout message lists these, since the rank that
# times out cannot tell them apart.
TIMEOUT_CAUSES = (
    "a peer was lost (its process died or its host stopped answering), or the ranks issued different "
    "collectives: one rank called step() more or fewer times than the others, skipped a backward pass, "
    "froze different parameters, or called flush() alone. Look for the first error in the other ranks' "
    "logs; if a rank can legitimately be this slow (evaluation or checkpointing on one rank), raise "
    "PIPESGD_TIMEOUT (seconds; 0 disables the timeout)")


class Handle(Protocol):
    def wait(self) -> Any: ...
    def done(self) -> bool: ...


class Communicator(Protocol):
    """What the pipeline needs from a transport.

    ``allreduce_async_(x, name, op, prescale, postscale)`` computes, in place,
    ``postscale' * sum_r(prescale * x_r)`` where ``postscale' = postscale / size`` for AVERAGE
    (Horovod's definition, so that width 1 averages as ``horovod.torch.DistributedOptimizer`` does; the
    order of the sum is the transport's, docs/options.md "Width 1 and Horovod's optimizer").
    ``alltoall_async(x, name)``: ``x`` has ``size`` rows; row j goes to rank j; the result's row j
    came from rank j. ``allgather_async(x, name)``: ``x`` has one row; the result has ``size`` rows.
    """

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    def allreduce_async_(self, x: Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> Handle: ...
    def alltoall_async(self, x: Tensor, name: str) -> Handle: ...
    def allgather_async(self, x: Tensor, name: str) -> Handle: ...
    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Blocking: every rank's ``obj``, in rank order (for consistency checks and states).

        ``obj`` holds only what the typed encoding of :mod:`.wire` carries (no pickle: bytes from
        the network never run code); a transport that crosses processes sends it that way.

        It must not be ordered with the tensor collectives (a separate MPI communicator or
        process group; Horovod matches by name anyway): the checks run while reductions are in
        flight, and a rank that is missing one of those must still be able to answer the check.
        It times out like the collectives (:class:`PeerLostError`)."""


def postscale_factor(op: ReduceOp, postscale: float, size: int) -> float:
    """The factor applied after the sum (Horovod folds 1/size into it for AVERAGE)."""
    return postscale / size if op is ReduceOp.AVERAGE else postscale


def _seconds_from_env(variable: str, default: float) -> Optional[float]:
    value = os.environ.get(variable, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{variable}={value!r} is not a number of seconds; set it to e.g. 600, or 0 "
                         "for no limit") from None
    if seconds != seconds or seconds < 0:
        raise ValueError(f"{variable}={value!r} must be >= 0 seconds (0: no limit)")
    return seconds if seconds > 0 else None


def default_timeout() -> Optional[float]:
    """Seconds a collective may take before it counts as a lost peer: ``PIPESGD_TIMEOUT``
    (default :data:`DEFAULT_TIMEOUT_S`; ``0`` waits forever)."""
    return _seconds_from_env("PIPESGD_TIMEOUT", DEFAULT_TIMEOUT_S)


def exit_if_stuck(reason: str) -> None:
    """Called after a lost peer (at the error, or at interpreter exit): ends the process with
    status 1 if it has not exited ``PIPESGD_EXIT_GRACE`` seconds (default
    :data:`DEFAULT_EXIT_GRACE_S`) after its exit began.

    Why: after the error, Python's exit runs the transport's own shutdown (Horovod registers
    one), which can wait forever for the peer that is gone (MPI) or for its own timeout (Gloo,
    30 s), and a rank that never exits is a hang. Before any atexit handler, it also joins the
    worker threads of ``concurrent.futures``, and a pipeline thread may still be blocked in a
    receive from a peer that will never send (one that is alive but in Horovod's own join): so
    the countdown starts when interpreter exit begins, and may be armed as soon as the error is
    raised. torch.distributed's NCCL watchdog ends the process for the same reason. A daemon
    thread: it does not itself keep the process alive."""
    grace = _seconds_from_env("PIPESGD_EXIT_GRACE", DEFAULT_EXIT_GRACE_S)
    if grace is None:
        return

    exiting = threading.Event()

    def end() -> None:
        exiting.wait()
        time.sleep(grace)
        sys.stderr.write(f"pipesgd_hvd: {reason}; the transport did not shut down within {grace:.0f} s "
                         "(PIPESGD_EXIT_GRACE), ending the process with status 1\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)

    # The hook concurrent.futures uses to join its threads at exit; registered later, it runs first.
    # (Python's own API, underscored; if it is gone, or exit has begun, count from now.)
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading atexit hook")
        register(exiting.set)
    except RuntimeError:  # "can't register atexit after shutdown": called at exit
        exiting.set()
    threading.Thread(target=end, name="pipesgd-exit-guard", daemon=True).start()


class DoneHandle:
    """A result that is already there (size-1 worlds, graph-mode tensors)."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def wait(self) -> Any:
        return self._value

    def done(self) -> bool:
        return True


class PolledHandle:
    """Waits by polling ``poll()`` with a short, growing sleep.

    Horovod's own ``synchronize`` spins on ``yield`` and retakes the GIL each turn, which steals
    a core from the compute thread on a one-core-per-rank machine; sleeping between polls costs at
    most ``max_sleep`` of latency. ``timeout`` (seconds, None for none) turns a silent hang into
    :class:`PeerLostError`.
    """

    def __init__(self, poll: Callable[[], bool], finish: Callable[[], Any], what: str,
                 timeout: Optional[float] = None, max_sleep: float = 0.002) -> None:
        self._poll = poll
        self._finish = finish
        self._what = what
        self._timeout = timeout
        self._max_sleep = max_sleep
        self._result: Any = None
        self._finished = False

    def done(self) -> bool:
        return self._finished or self._poll()

    def wait(self) -> Any:
        if self._finished:
            return self._result
        start = time.monotonic()
        sleep = 0.00005
        while not self._poll():
            if self._timeout is not None and time.monotonic() - start > self._timeout:
                raise PeerLostError(f"{self._what} did not complete within {self._timeout:g} s "
                                    f"(PIPESGD_TIMEOUT): {TIMEOUT_CAUSES}")
            time.sleep(sleep)
            sleep = min(sleep * 2, self._max_sleep)
        self._result = self._finish()
        self._finished = True
        return self._result
