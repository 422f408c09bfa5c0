"""A status board: where each rank of one pipeline says what it is doing, outside the collectives.

Why: a collective that waits cannot tell why its peers are missing. A rank that ran out of data
and called ``flush()``, one inside Horovod's own ``hvd.join()``, one that is exiting and one that
evaluates alone all look the same from inside a receive. The board lets a waiting rank ask, and
lets ``flush()`` agree on step counts without a collective that a rank still training would
never answer (:mod:`pipesgd_hvd.pipeline.stall` reads and writes it).

It is not a collective and not ordered with them: each rank writes its own entry, any rank reads
all of them, at any moment, from any thread. A rank's monitor thread writes only when asked
(:meth:`StatusBoard.poke` raises a request number every monitor polls), so a training step costs
no board traffic. Two implementations: :class:`StoreBoard` on the pipeline channel's
``TCPStore`` (in-process ranks have :class:`pipesgd_hvd.testing.board.MemoryBoard`).

What the store holds can be read, written and deleted by anyone who reaches its port (torch's
store has no authentication), so :class:`StoreBoard` trusts nothing it reads
(docs/reliability.md, "Who can talk to a job"):

* every value (each rank's entry, and the request number) is signed with the job's secret and
  carries a sequence number inside the signature: a value without the secret is *forged*, a
  genuine one older than one already read is *replayed*; both are ignored (the last genuine
  value stands), counted (:attr:`StoreBoard.forged`, ``replayed``, ``removed`` for a deleted
  entry) and logged once;
* values are read with ``compare_set`` against a value no rank writes, which returns the value
  or that marker at once: ``get`` waits for a missing key, and ``add`` makes the server close the
  connection when someone stored a non-number there (it did: one such write broke every rank's
  board for good);
* every call goes through a :class:`~pipesgd_hvd.comm.store_lane.StoreLane`: bounded in time
  (rank 0, which serves the store, may be frozen) and on a connection that is re-made when broken.
"""
from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Protocol, Tuple

from . import wire
from .store_lane import BoardUnavailable, StoreLane

__all__ = ["BoardUnavailable", "StatusBoard", "StoreBoard", "store_lane"]

log = logging.getLogger("pipesgd_hvd.board")

#: What ``compare_set(key, ABSENT, ABSENT)`` returns for a missing key (and leaves it missing): no
#: rank writes it (a signed value starts with its MAC), so it reads the key without waiting for it.
ABSENT = b"\x00pipesgd:absent\x00"
BOARD_TIMEOUT_S = 5.0  # the most one board call waits for the store (rank 0 may be frozen)
_ENTRY = struct.Struct("<Q")      # an entry's sequence number, then its JSON
_REQUEST = struct.Struct("<IQQ")  # the request number's writer rank, its sequence number, the number


class _Sequence:
    """Sequence numbers that only grow in this process, whichever board writes them: a reader
    keeps the highest it saw per rank, and a rank's later boards must not look older."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def next(self) -> int:
        with self._lock:
            self._last = max(self._last + 1, time.time_ns())
            return self._last


_SEQUENCE = _Sequence()


class StatusBoard(Protocol):
    """One rank's view of the board of one pipeline."""

    rank: int
    size: int
    #: whether a rank's interpreter exit means that it leaves the job (False for in-process ranks,
    #: which all exit together: the exit check does not run for them)
    process_exit: bool
    #: which rank serves the board (named when the board does not answer); None: nobody (in memory)
    server_rank: Optional[int]

    def publish(self, status: Dict[str, Any]) -> None:
        """Replace this rank's entry (plain JSON values)."""
    def read(self) -> List[Optional[Dict[str, Any]]]:
        """Every rank's latest entry, in rank order (None: none yet)."""
    def poke(self) -> int:
        """Ask every rank to publish afresh; returns the new request number."""
    def requests(self) -> int:
        """The latest request number (what :meth:`poke` returned last, on any rank)."""


class StoreBoard:
    """The board on a torch.distributed store, through ``lane`` (a connection of its own with a
    short bound: the board is read from a monitor thread, which must not hang when rank 0, which
    serves the store, is frozen). See the module docstring for what it trusts."""

    process_exit = True

    def __init__(self, lane: StoreLane, rank: int, size: int, secret: bytes, namespace: str,
                 server_rank: Optional[int] = 0) -> None:
        self.rank, self.size, self.server_rank = rank, size, server_rank
        self._lane, self._secret, self._ns = lane, secret, namespace
        self.forged = 0     # values without the job's secret (someone outside the job wrote them)
        self.replayed = 0   # genuine values older than one already read (written back from outside)
        self.removed = 0    # entries deleted after they were read (no rank deletes one)
        self._lock = threading.Lock()  # the caches below: the monitor and the training thread both read
        self._seen: List[Optional[Tuple[int, Dict[str, Any]]]] = [None] * size
        self._present = [False] * size
        self._requests = 0
        self._request_seqs: Dict[int, int] = {}
        self._request_present = False
        self._said: set = set()

    @property
    def rejected(self) -> int:
        """Values read and ignored: forged, replayed or removed."""
        return self.forged + self.replayed + self.removed

    @property
    def lane(self) -> StoreLane:
        return self._lane

    def _key(self, what: str) -> str:
        return f"board/{self._ns}/{what}"

    def _context(self, what: str) -> bytes:
        return f"board/{self._ns}/{what}".encode()

    # ---------------------------------------------------------------------------- entries
    def publish(self, status: Dict[str, Any]) -> None:
        body = _ENTRY.pack(_SEQUENCE.next()) + json.dumps(status, separators=(",", ":")).encode()
        key, frame = self._key(f"status/{self.rank}"), wire.seal(self._secret, self._context(f"status/{self.rank}"), body)
        self._lane.run("publish", lambda store: store.set(key, frame))

    def read(self) -> List[Optional[Dict[str, Any]]]:
        keys = [self._key(f"status/{r}") for r in range(self.size)]
        frames = self._lane.run("read", lambda store: [store.compare_set(k, ABSENT, ABSENT) for k in keys])
        with self._lock:
            return [self._entry(r, bytes(frame)) for r, frame in enumerate(frames)]

    def _entry(self, r: int, frame: bytes) -> Optional[Dict[str, Any]]:
        seen = self._seen[r]
        last = seen[1] if seen is not None else None
        if frame == ABSENT:
            if self._present[r]:
                self._present[r] = False
                self._reject("removed", f"rank {r}'s entry")
            return last
        self._present[r] = True
        try:
            payload = wire.open_sealed(self._secret, self._context(f"status/{r}"), frame, f"the board entry of rank {r}")
            (seq,) = _ENTRY.unpack_from(payload)
            entry = json.loads(payload[_ENTRY.size:])
            if not isinstance(entry, dict):
                raise ValueError("not an object")
        except (wire.WireError, ValueError, struct.error):
            self._reject("forged", f"rank {r}'s entry")
            return last
        if seen is not None and seq < seen[0]:
            self._reject("replayed", f"rank {r}'s entry")
            return last
        self._seen[r] = (seq, entry)
        return entry

    # ---------------------------------------------------------------------------- requests
    def poke(self) -> int:
        key = self._key("requests")

        def job(store: Any) -> int:
            frame = bytes(store.compare_set(key, ABSENT, ABSENT))
            with self._lock:
                number = self._request(frame) + 1
                self._requests = number
            payload = _REQUEST.pack(self.rank, _SEQUENCE.next(), number)
            store.set(key, wire.seal(self._secret, self._context("requests"), payload))
            return number

        return self._lane.run("poke", job)

    def requests(self) -> int:
        key = self._key("requests")
        frame = self._lane.run("read requests", lambda store: store.compare_set(key, ABSENT, ABSENT))
        with self._lock:
            return self._request(bytes(frame))

    def _request(self, frame: bytes) -> int:
        """The request number after reading ``frame``: the highest genuine one seen (any rank may
        have raised it; two ranks asking at once may write the same number, which is as good)."""
        if frame == ABSENT:
            if self._request_present:
                self._request_present = False
                self._reject("removed", "the request number")
            return self._requests
        self._request_present = True
        try:
            writer, seq, number = _REQUEST.unpack(
                wire.open_sealed(self._secret, self._context("requests"), frame, "the board's request number"))
            if writer >= self.size:
                raise ValueError(f"writer {writer}")
        except (wire.WireError, ValueError, struct.error):
            self._reject("forged", "the request number")
            return self._requests
        if seq < self._request_seqs.get(writer, -1):
            self._reject("replayed", "the request number")
            return self._requests
        self._request_seqs[writer] = seq
        self._requests = max(self._requests, number)
        return self._requests

    # ------------------------------------------------------------------------------ words
    def _reject(self, kind: str, what: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if kind in self._said:
            return
        self._said.add(kind)
        why = {"forged": "does not carry this job's secret",
               "replayed": "is an older genuine value written back",
               "removed": "was deleted"}[kind]
        log.warning(f"pipesgd_hvd: the status board of pipeline {self._ns} ignored {what}: it {why}. Someone outside "
                    f"the job writes to the pipeline's store (rank {self.server_rank} serves it); the last genuine value "
                    "stands and training goes on. Counted in the board's forged/replayed/removed counts; check who "
                    "can reach the training hosts (docs/reliability.md, 'Who can talk to a job')")


def store_lane(store: Any, timeout_s: float = BOARD_TIMEOUT_S, server: str = "rank 0") -> StoreLane:
    """A :class:`StoreLane` with connections of its own to ``store``'s server, each call bounded by
    ``timeout_s`` (a ``TCPStore``: a new client at its host and port; any other store: its
    ``clone()``)."""
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if isinstance(host, str) and isinstance(port, int):
        import torch.distributed as dist

        def connect() -> Any:
            # torch's client retries a refused connection with a growing pause, well past its own
            # timeout (2 s took 5 s): a short one, then a plain connect says whether anybody
            # listens there at all (refused: the server's process is gone). Not the plain connect
            # first: one closed unused made torch's server leave the next client waiting (measured).
            try:
                return dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=min(1.0, timeout_s / 4)))
            except Exception:  # noqa: BLE001 - refused, reset or timed out: which one, below
                socket.create_connection((host, port), timeout=timeout_s / 4).close()  # refused: raises
                raise
    else:
        def connect() -> Any:
            clone = store.clone()
            clone.set_timeout(timedelta(seconds=timeout_s))
            return clone
    return StoreLane(connect, timeout_s, server)
