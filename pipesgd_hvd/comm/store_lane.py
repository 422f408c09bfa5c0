"""One connection to a store's server whose every call is bounded in time and re-made when broken.

Why: the status board (:mod:`.board`) lives on the pipeline channel's ``TCPStore``, whose server
runs inside rank 0. torch's client bounds only the wait for a missing key (``get``/``wait``):
``set``, ``add``, ``check``, ``compare_set`` and even the client's constructor block until the
server answers, so with rank 0 frozen (SIGSTOP, a hung host) a board call blocked for good
(measured: more than 15 s, then until killed), and with it the stall inspector that should have
said so. And once the server has closed a connection (a protocol error: ``add`` on a value that
is not a number, which anyone who reaches the port can write), that connection stays broken.

So every call runs on a thread of the lane's own and the caller waits at most ``timeout_s``:

* a call that does not return in time raises :class:`BoardUnavailable` and stays with its thread
  ("stuck"); until it returns, later calls raise at once instead of piling up threads on a
  frozen server. A thawed server answers it, and the lane is usable again;
* a call that raises drops the connection: the next call makes a new one (``connect``), on the
  lane's thread too, since a connection to a frozen server blocks in its constructor;
* a connection refused (``connect`` raises ConnectionRefusedError: nobody listens there any more)
  is ``BoardUnavailable(lost=True)``: the server's process is gone, not slow.

One call at a time; any thread may call.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Tuple, TypeVar

T = TypeVar("T")


class BoardUnavailable(RuntimeError):
    """The store's server did not answer (``lost=False``: frozen, slow or overloaded) or cannot be
    reached any more (``lost=True``: nobody listens at its address)."""

    def __init__(self, message: str, lost: bool = False, waited_s: float = 0.0) -> None:
        super().__init__(message)
        self.lost = lost
        self.waited_s = waited_s  # how long the call that did not answer has been waiting


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _Call:
    def __init__(self, what: str, job: Callable[[Any], Any]) -> None:
        self.what, self.job = what, job
        self.done = threading.Event()
        self.value: Any = None
        self.error: Optional[str] = None
        self.lost = False
        self.started = time.monotonic()


class StoreLane:
    """Bounded calls on a connection of their own (module docstring). ``connect()`` makes a new
    client connection to the server; ``server`` names who serves it, for messages."""

    def __init__(self, connect: Callable[[], Any], timeout_s: float = 5.0, server: str = "rank 0") -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s, self.server = float(timeout_s), server
        self._connect = connect
        self._conn: Any = None
        self._one_at_a_time = threading.Lock()
        self._state = threading.Lock()
        self._stuck: Optional[Tuple[str, float]] = None  # (what, since) of a call that outlived its bound
        self._next: Optional[_Call] = None
        self._wake = threading.Condition(self._state)
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.connections = 0  # connections made: more than one means a broken one was re-made

    def run(self, what: str, job: Callable[[Any], T]) -> T:
        """``job(connection)`` on the lane's thread, within ``timeout_s``; BoardUnavailable otherwise."""
        if not self._one_at_a_time.acquire(timeout=self.timeout_s):
            raise BoardUnavailable(f"the pipeline's store did not answer within {self.timeout_s:g} s ({what}: "
                                   f"another call on this connection holds it)")
        try:
            call = _Call(what, job)
            with self._state:
                if self._closed:
                    raise BoardUnavailable(f"the status board's connection was closed ({what})")
                if self._stuck is not None:
                    stuck_what, since = self._stuck
                    waited = time.monotonic() - since
                    raise BoardUnavailable(
                        f"the pipeline's store, which {self.server} serves, has not answered a call ({stuck_what}) for "
                        f"{waited:.0f} s: {self.server}'s process or host is frozen, lost or overloaded", waited_s=waited)
                self._next = call
                self._ensure_thread()
                self._wake.notify()
            if not call.done.wait(self.timeout_s):
                with self._state:
                    if not call.done.is_set():
                        self._stuck = (what, call.started)
                if self._stuck is not None and not call.done.is_set():
                    raise BoardUnavailable(
                        f"the pipeline's store, which {self.server} serves, did not answer within {self.timeout_s:g} s "
                        f"({what}): {self.server}'s process or host is frozen, lost or overloaded",
                        waited_s=time.monotonic() - call.started)
            if call.error is not None:
                raise BoardUnavailable(f"the pipeline's store did not answer ({what}: {call.error})", lost=call.lost)
            return call.value
        finally:
            self._one_at_a_time.release()

    @property
    def stuck_for(self) -> Optional[float]:
        """Seconds the call that outlived its bound has been waiting (None: none is)."""
        stuck = self._stuck
        return None if stuck is None else time.monotonic() - stuck[1]

    def close(self) -> None:
        """Ends the lane's thread once it is idle (a stuck call keeps it until it returns)."""
        with self._state:
            self._closed = True
            self._wake.notify()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="pipesgd-store-lane", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            with self._state:
                while self._next is None and not self._closed:
                    self._wake.wait()
                if self._next is None:
                    return
                call, self._next = self._next, None
            self._serve(call)

    def _serve(self, call: _Call) -> None:
        try:
            if self._conn is None:
                try:
                    conn = self._connect()
                except Exception as exc:  # noqa: BLE001 - refused, reset, timed out: said to the caller
                    call.error = f"cannot connect to {self.server}'s store: {first_line(exc)}"
                    call.lost = isinstance(exc, ConnectionRefusedError)  # nobody listens there any more
                    return
                self.connections += 1
                self._conn = conn
            call.value = call.job(self._conn)
        except Exception as exc:  # noqa: BLE001 - the server closed it, or a value failed: a new connection next time
            self._conn = None
            call.error = first_line(exc)
        finally:
            with self._state:
                self._stuck = None
            call.done.set()
