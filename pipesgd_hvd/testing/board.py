"""The status board of in-process ranks: the :class:`~pipesgd_hvd.comm.board.StatusBoard` that
:class:`~pipesgd_hvd.testing.LocalWorld`'s ranks share."""
from __future__ import annotations

import json
import threading
from typing import Any, Dict, List, Optional


class MemoryBoard:
    """The board of in-process ranks (:class:`~pipesgd_hvd.testing.LocalWorld`). Entries go
    through JSON, as on the store, so what the tests publish is what crosses processes."""

    process_exit = False
    server_rank = None
    forged = replayed = removed = rejected = 0  # nothing outside the process writes here

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
