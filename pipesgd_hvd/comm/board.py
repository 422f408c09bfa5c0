"""A status board: where each rank of one pipeline says what it is doing, outside the collectives.

Why: a collective that waits cannot tell why its peers are missing. A rank that ran out of data
and called ``flush()``, one inside Horovod's own ``hvd.join()``, one that is exiting and one that
evaluates alone all look the same from inside a receive. The board lets a waiting rank ask, and
lets ``flush()`` agree on step counts without a collective that a rank still training would
never answer (:mod:`pipesgd_hvd.pipeline.stall` reads and writes it).

It is not a collective and not ordered with them: each rank writes its own entry, any rank reads
all of them, at any moment, from any thread. A rank's monitor thread writes only when asked
(:meth:`StatusBoard.poke` bumps a counter every monitor polls), so a training step costs no board
traffic. Two implementations: :class:`StoreBoard` on the pipeline channel's ``TCPStore``, every
entry signed with the job's secret (an entry written by someone outside the job is ignored, and
counted), and :class:`MemoryBoard` for in-process ranks (tests).
"""
from __future__ import annotations

import datetime
import json
import threading
from typing import Any, Dict, List, Optional, Protocol

from . import wire


class BoardUnavailable(RuntimeError):
    """The board cannot be reached (its store's server is gone or does not answer)."""


class StatusBoard(Protocol):
    """One rank's view of the board of one pipeline."""

    rank: int
    size: int
    #: whether a rank's interpreter exit means that it leaves the job (False for in-process ranks,
    #: which all exit together: the exit check does not run for them)
    process_exit: bool

    def publish(self, status: Dict[str, Any]) -> None:
        """Replace this rank's entry (plain JSON values)."""
    def read(self) -> List[Optional[Dict[str, Any]]]:
        """Every rank's latest entry, in rank order (None: none yet, or one that failed its check)."""
    def poke(self) -> int:
        """Ask every rank to publish afresh; returns the new request number."""
    def requests(self) -> int:
        """The latest request number (what :meth:`poke` returned last, on any rank)."""


class StoreBoard:
    """The board on a torch.distributed store. ``store`` should be a connection of its own with a
    short timeout (the channel clones its store): the board is read from a monitor thread, which
    must not hang for ``PIPESGD_TIMEOUT`` when rank 0, which serves the store, is frozen."""

    process_exit = True

    def __init__(self, store: Any, rank: int, size: int, secret: bytes, namespace: str) -> None:
        self.rank, self.size = rank, size
        self._store, self._secret, self._ns = store, secret, namespace
        self.forged = 0  # entries that did not carry the job's secret (someone outside the job wrote them)

    def _key(self, what: str) -> str:
        return f"board/{self._ns}/{what}"

    def _context(self, rank: int) -> bytes:
        return f"board/{self._ns}/status/{rank}".encode()

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (RuntimeError, ValueError) as exc:  # DistStoreError: timeout, connection reset
            raise BoardUnavailable(f"the pipeline's status board did not answer ({what}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None

    def publish(self, status: Dict[str, Any]) -> None:
        body = json.dumps(status, separators=(",", ":")).encode()
        self._call("publish", self._store.set, self._key(f"status/{self.rank}"),
                   wire.seal(self._secret, self._context(self.rank), body))

    def read(self) -> List[Optional[Dict[str, Any]]]:
        out: List[Optional[Dict[str, Any]]] = []
        for r in range(self.size):
            key = self._key(f"status/{r}")
            if not self._call("read", self._store.check, [key]):  # check first: get() would wait for it
                out.append(None)
                continue
            frame = self._call("read", self._store.get, key)
            try:
                entry = json.loads(wire.open_sealed(self._secret, self._context(r), frame, f"the board entry of rank {r}"))
            except (wire.WireError, ValueError):
                self.forged += 1
                out.append(None)
                continue
            out.append(entry if isinstance(entry, dict) else None)
        return out

    def poke(self) -> int:
        return int(self._call("poke", self._store.add, self._key("requests"), 1))

    def requests(self) -> int:
        return int(self._call("read requests", self._store.add, self._key("requests"), 0))


def board_store(store: Any, timeout_s: float = 5.0) -> Any:
    """A connection of its own to ``store``'s server, with a short timeout (see :class:`StoreBoard`)."""
    clone = store.clone()
    clone.set_timeout(datetime.timedelta(seconds=timeout_s))
    return clone


class MemoryBoard:
    """The board of in-process ranks (:class:`~pipesgd_hvd.testing.LocalWorld`). Entries go
    through JSON, as on the store, so what the tests publish is what crosses processes."""

    process_exit = False

    def __init__(self, shared: Dict[str, Any], lock: threading.Lock, rank: int, size: int, namespace: str) -> None:
        self.rank, self.size = rank, size
        self._shared, self._lock, self._ns = shared, lock, namespace

    def publish(self, status: Dict[str, Any]) -> None:
        with self._lock:
            self._shared[(self._ns, "status", self.rank)] = json.dumps(status)

    def read(self) -> List[Optional[Dict[str, Any]]]:
        with self._lock:
            raw = [self._shared.get((self._ns, "status", r)) for r in range(self.size)]
        return [json.loads(v) if v is not None else None for v in raw]

    def poke(self) -> int:
        with self._lock:
            n = self._shared.get((self._ns, "requests"), 0) + 1
            self._shared[(self._ns, "requests")] = n
            return n

    def requests(self) -> int:
        with self._lock:
            return self._shared.get((self._ns, "requests"), 0)
