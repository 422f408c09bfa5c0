"""The Communicator protocol: the three collectives the engine and the compressed all-reduce use.

Every collective returns a :class:`Handle`; ``wait()`` blocks until the result is there and
returns it. ``allreduce_async_`` works in place (trailing underscore); ``alltoall_async`` and
``allgather_async`` return new tensors. Collectives must be issued in the same order on every
rank (the engine guarantees it): MPI-style transports match them by order, Horovod by name.
"""
from __future__ import annotations

import enum
import os
import time
from typing import Any, Callable, List, Optional, Protocol

from ..tensor_ops import Tensor


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"


class PeerLostError(RuntimeError):
    """A collective did not complete because a peer went away or stopped answering."""


class Handle(Protocol):
    def wait(self) -> Any: ...
    def done(self) -> bool: ...


class Communicator(Protocol):
    """What the pipeline needs from a transport.

    ``allreduce_async_(x, name, op, prescale, postscale)`` computes, in place,
    ``postscale' * sum_r(prescale * x_r)`` where ``postscale' = postscale / size`` for AVERAGE
    (Horovod's definition, so that width 1 matches ``horovod.torch.DistributedOptimizer`` bit for bit).
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
        """Blocking: every rank's ``obj``, in rank order (for consistency checks)."""


def postscale_factor(op: ReduceOp, postscale: float, size: int) -> float:
    """The factor applied after the sum (Horovod folds 1/size into it for AVERAGE)."""
    return postscale / size if op is ReduceOp.AVERAGE else postscale


def default_timeout() -> Optional[float]:
    """Seconds a collective may take before it counts as a lost peer (``PIPESGD_TIMEOUT``)."""
    value = os.environ.get("PIPESGD_TIMEOUT", "")
    return float(value) if value else None


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
                raise PeerLostError(
                    f"{self._what} did not complete within {self._timeout:.0f} s: a peer was lost or "
                    "stopped answering (raise PIPESGD_TIMEOUT if ranks can legitimately be this slow)")
            time.sleep(sleep)
            sleep = min(sleep * 2, self._max_sleep)
        self._result = self._finish()
        self._finished = True
        return self._result
