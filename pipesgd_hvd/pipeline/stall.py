"""The stall inspector: no silent wait, and every way a rank can stop early ends on every rank.

Horovod's stall inspector warns after 60 s and names the ranks and tensors that have not arrived
(``HOROVOD_STALL_CHECK_TIME_SECONDS``), and can shut the job down after a second threshold. The
pipeline's collectives do not go through Horovod's coordinator, so it cannot see them; this is
their inspector. One per optimizer (or per engine built alone), with a daemon monitor thread:

* **Warning.** A pipeline wait longer than ``PIPESGD_STALL_CHECK_TIME_SECONDS`` (default 60; ``0``:
  no warning) logs, on the waiting rank, the step and bucket it waits on, which ranks have not
  begun that step and what each is doing (from the status board: in ``flush()``, in ``join()``,
  outside the pipeline at ``file:line``, not answering), and the likely causes; again after each
  further threshold. ``PIPESGD_STALL_SHUTDOWN_TIME_SECONDS`` (default 0: never) ends such a wait
  with an error. ``PIPESGD_TIMEOUT`` stays the last resort.
* **Early ends, in seconds, with words.** A wait that has lasted a few seconds asks every rank
  for its status (:mod:`pipesgd_hvd.comm.board`) and raises at once when a rank it needs can never
  come: one that is exiting, one stopped at an error, one inside Horovod's own ``hvd.join()``
  (which does not take part in the pipeline's steps). That rank's own monitor says it too.
* **flush() without a collective.** Where a board exists, ``flush()`` agrees on step counts
  through it (:meth:`StallInspector.agree_at_flush`): a rank that ran out of data and calls
  ``flush()`` while the others still train is told so (it returns, and its ``join()`` then
  works), instead of waiting in a check that the training ranks never reach.
* **Exit.** A rank that exits while others still need its share of a step (it left the training
  loop without ``join()``) says so and ends with status 1, and tells them first
  (:meth:`StallInspector.check_at_exit`).

Cost: the training thread only writes a few attributes per step and waits through
:meth:`StallInspector.wait`, which is a plain ``wait()`` when the result is already there; the
monitor wakes every half second and asks the board one question (has anyone asked for news?).
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Type

from ..comm.base import PeerLostError, _seconds_from_env, default_timeout, exit_if_stuck
from ..comm.board import BoardUnavailable, StatusBoard
from . import rank_status as rules

log = logging.getLogger("pipesgd_hvd.stall")

DEFAULT_CHECK_S = 60.0     # Horovod's HOROVOD_STALL_CHECK_TIME_SECONDS default
PERIOD_S = 0.5             # the monitor's tick
ASK_AFTER_S = 2.0          # a wait this old asks every rank for its status
SLICE_S = 0.25             # how often a waiting training thread looks for a verdict
FLUSHES_KEPT = 4           # past flush() calls each rank's entry lists

CAUSES = ("a rank in flush(), join(), evaluation or checkpoint writing alone; uneven data per rank (call "
          "psgd.join() on a rank once it runs out of batches, instead of leaving the loop); or a lost peer")


@dataclass(frozen=True)
class StallSettings:
    """The thresholds, from the environment (Horovod's names with PIPESGD_ instead of HOROVOD_)."""

    check_s: Optional[float] = DEFAULT_CHECK_S
    shutdown_s: Optional[float] = None
    period_s: float = PERIOD_S

    @classmethod
    def from_env(cls) -> "StallSettings":
        return cls(_seconds_from_env("PIPESGD_STALL_CHECK_TIME_SECONDS", DEFAULT_CHECK_S),
                   _seconds_from_env("PIPESGD_STALL_SHUTDOWN_TIME_SECONDS", 0.0))

    @property
    def ask_after_s(self) -> float:
        return min(ASK_AFTER_S, self.check_s / 2) if self.check_s else ASK_AFTER_S


@dataclass
class Wait:
    step: int
    bucket: Optional[int]   # None: not a bucket's reduction (a check, flush()'s agreement)
    what: str
    since: float


@dataclass
class _Status:
    """This rank's state, written by the training thread (plain attributes: no board traffic)."""

    phase: str = "train"                 # train | flush | join | exit | failed
    begun: int = 0                        # steps begun (the open step's index + 1)
    ended: int = 0                        # steps ended
    wait: Optional[Wait] = None
    since: float = field(default_factory=time.monotonic)
    flushes: List[Tuple[int, int]] = field(default_factory=list)  # (flush() number, steps ended), the last few
    joined_at: Optional[int] = None
    error: Optional[str] = None
    thread: Optional[int] = None          # the training thread (where it is, for the others)


class StallInspector:
    """See the module docstring. ``board``: the transport's status board (None: warnings without
    rank names, and ``flush()`` keeps its collective check); ``error_type``: what a verdict raises
    (the transport's own PeerLostError, so that Horovod elastic sees the failure it expects)."""

    def __init__(self, rank: int, size: int, board: Optional[StatusBoard], name: str, *,
                 error_type: Type[PeerLostError] = PeerLostError, transport: str = "",
                 settings: Optional[StallSettings] = None) -> None:
        self.rank, self.size, self.board, self.name = rank, size, board, name
        self.error_type, self.transport = error_type, transport
        self.settings = settings if settings is not None else StallSettings.from_env()
        self.comm: Any = None  # the transport it was made for (for_comm)
        self.status = _Status()
        self.verdict: Optional[BaseException] = None   # a peer that can never come: waits raise this
        self.knows: List[int] = []                      # ranks this rank has judged gone
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._waiter: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._answered = -1          # the last request this rank answered
        self._dirty = False          # a change the monitor must publish without being asked
        self._asked: Optional[Tuple[int, float]] = None  # (request number, when) of this wait's question
        self._warned = 0
        self._said: set = set()
        self._statuses: List[Optional[Dict[str, Any]]] = []
        self._board_down: Optional[Tuple[str, float]] = None  # (why, since when) the board has not answered

    @classmethod
    def for_comm(cls, comm: Any, name: str, settings: Optional[StallSettings] = None) -> "StallInspector":
        """The inspector of a pipeline over ``comm`` (its board, if the transport has one; the
        process's shared communicator is seen through, comm/ordered.py)."""
        transport = getattr(comm, "inner", comm)
        make_board = getattr(transport, "status_board", None)
        board = make_board(name) if make_board is not None and comm.size > 1 else None
        inspector = cls(comm.rank, comm.size, board, name, error_type=getattr(transport, "error_type", PeerLostError),
                        transport=type(transport).__name__, settings=settings)
        inspector.comm = comm
        return inspector

    # ------------------------------------------------------------------ training-thread side
    def step_begun(self, step: int) -> None:
        st = self.status
        st.begun, st.thread = step + 1, threading.get_ident()
        if self._thread is None and self.board is not None:
            self._start()  # from now on this rank answers the others' questions

    def step_ended(self, steps: int) -> None:
        st = self.status
        st.ended, st.since = steps, time.monotonic()  # "outside the pipeline" counts from here

    def set_phase(self, phase: str, publish: bool = True, **fields: Any) -> None:
        """A rare transition (flush, join, exit, failure): the others may read it at once."""
        st = self.status
        st.phase, st.since, st.thread = phase, time.monotonic(), threading.get_ident()
        for key, value in fields.items():
            setattr(st, key, value)
        if publish:
            self._publish_quietly()

    def failed(self, exc: BaseException) -> None:
        """This rank's pipeline stopped at ``exc``: published by the monitor at its next tick, not
        here (the store may be what failed, and this thread is about to raise)."""
        if self.status.phase != "failed":
            self.set_phase("failed", publish=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            self._dirty = True
            self._ensure_started()

    def wait(self, reduction: Any, step: int, bucket: Optional[int], what: str) -> Any:
        """``reduction.wait()``, but a verdict (a peer that can never come, a stall shutdown)
        ends it with an error instead of a silent wait. When the result is already there (the
        usual case in a pipeline) this is one ``done()`` call and the wait itself."""
        try:
            return self._wait(reduction, step, bucket, what)
        except PeerLostError as exc:
            # A peer that leaves tells the board before its process ends and closes its
            # connections, but the closed connection can reach this rank before the monitor's next
            # look at the board: look now, so that the error names the rank and why it left.
            verdict = self._verdict_after_loss(step)
            if verdict is None or verdict is exc:
                raise
            raise verdict from exc

    def _verdict_after_loss(self, step: int) -> Optional[BaseException]:
        if self.verdict is None and self.board is not None:
            try:
                self._judge(self._read(), step)
            except BoardUnavailable:
                pass
        return self.verdict

    def _wait(self, reduction: Any, step: int, bucket: Optional[int], what: str) -> Any:
        if reduction.done():
            return reduction.wait()
        self.status.wait = Wait(step, bucket, what, time.monotonic())
        self._ensure_started()
        try:
            # A reduction on a thread: wait for its Future in slices, then its own wait() (which no
            # longer blocks). A blocking one: run it on a helper thread, so that this one can give up.
            own = reduction.future is None
            future = self._helper().submit(reduction.wait) if own else reduction.future
            while not concurrent.futures.wait([future], timeout=SLICE_S).done:
                verdict = self.verdict
                if verdict is not None:
                    if self.board is None or self.board.process_exit:
                        # The thread that runs the wait stays blocked on the peer that never
                        # comes, and interpreter exit joins it: bound the exit.
                        exit_if_stuck(f"the pipeline stopped at {type(verdict).__name__}")
                    raise verdict
            return future.result() if own else reduction.wait()
        finally:
            self.status.wait = None

    def blocking(self, step: int, what: str) -> "_Blocking":
        """A wait this thread cannot leave (a check's collective): warned about, not interrupted."""
        return _Blocking(self, Wait(step, None, what, time.monotonic()))

    # ------------------------------------------------------------------------------ flush()
    def agree_at_flush(self, ended: int, timeout: Optional[float] = None) -> str:
        """``flush()``'s step check through the board (no collective): returns "agreed" when every
        rank flushes at the same step (or is in ``join()``), "behind" when some rank is blocked
        waiting for this rank's share of a step it never ran (it ran out of data: its ``join()``
        will serve them); raises StepCountMismatchError when ranks flush at different steps, and
        the transport's error when a rank stopped or the timeout passes."""
        assert self.board is not None
        st = self.status
        seq = (st.flushes[-1][0] + 1) if st.flushes else 1
        before = (st.phase, st.since)  # (a joined rank flushes at an auto check and stays joined)
        # A few past ones too: a rank that agreed may be in its next flush() before the others read it.
        self.set_phase("flush", publish=False, flushes=(st.flushes + [(seq, ended)])[-FLUSHES_KEPT:])
        self._ensure_started()
        try:
            return self._agree_at_flush(seq, ended, timeout)
        except BoardUnavailable as exc:  # lost: nobody listens where the store was (its server's process is gone)
            raise self.error_type(f"flush() cannot agree on step counts: {exc}; {self._server_name()}, which serves "
                                  "the pipeline's store, is lost") from None
        finally:
            st.wait = None
            st.phase = before[0]
            st.since = time.monotonic() if before[0] == "train" else before[1]

    def _agree_at_flush(self, seq: int, ended: int, timeout: Optional[float]) -> str:
        """Asks and reads until the entries decide. A board that does not answer (rank 0 frozen or
        slow) is asked again until the timeout, with the stall warning meanwhile: one call that
        timed out is no reason to fail a job; one that is lost (refused) is raised at once."""
        st = self.status
        timeout = timeout if timeout is not None else default_timeout()
        started = time.monotonic()
        st.wait = Wait(ended, None, "the step-count agreement of flush()", started)
        pause, asked, asked_at = 0.001, 0, None
        statuses: List[Optional[Dict[str, Any]]] = list(self._statuses)
        try:
            while True:
                try:
                    if asked_at is None or time.monotonic() - asked_at > self.settings.period_s:  # fresh news
                        asked, asked_at = self._ask(), time.monotonic()
                    statuses = self._read()
                    outcome = rules.flush_outcome(statuses, self.rank, seq, ended, self.error_type)
                    if outcome is not None:
                        return outcome
                except BoardUnavailable as exc:
                    if exc.lost:
                        raise
                    self._board_failed(exc)
                    asked_at = None
                if timeout is not None and time.monotonic() - started > timeout:
                    waiting = [r for r in range(self.size) if r != self.rank]
                    raise self.error_type(
                        f"flush() waited {timeout:g} s (PIPESGD_TIMEOUT) for rank(s) {waiting} to flush, join or "
                        f"wait for this rank: {self._describe_ranks(statuses, asked, ended)}")
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        finally:
            st.wait = None

    # -------------------------------------------------------------------------------- exit
    def check_at_exit(self, ended: int, grace: float = 5.0) -> Optional[str]:
        """At interpreter exit: says (to the others first) that this rank is leaving after
        ``ended`` steps, and returns what to report if some rank still needs it (it began a step
        this rank never ran, so it waits, or will, for this rank's share): the caller prints it
        and ends with status 1. None when nobody needs it, or no board answers."""
        if self.board is None:
            return None
        self.set_phase("exit", publish=False)
        try:
            first = self._ask()
            asked_at = started = time.monotonic()
            statuses = self._read()
            while True:
                fresh = rules.all_fresh(statuses, self.rank, first)
                if fresh and not rules.undecided(statuses, self.rank, ended):
                    break
                now = time.monotonic()
                if now - started > (grace if fresh else 2 * self.settings.period_s + 1.0):
                    break  # no answer (gone, frozen): nobody to tell; or still undecided after the grace
                if now - asked_at > self.settings.period_s:  # news of the undecided
                    self._ask()
                    asked_at = now
                time.sleep(0.05)
                statuses = self._read()
            needing = rules.needing(statuses, self.rank, ended)
            if not needing:
                return None
            # Until each of them has read this (its monitor lists this rank as gone), or the grace ends.
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if all(self.rank in (s or {}).get("knows", []) or (s or {}).get("phase") in ("exit", "failed")
                       for r, s in enumerate(statuses) if r in needing):
                    break
                time.sleep(0.05)
                statuses = self._read()
        except BoardUnavailable:
            return None
        details = "; ".join(f"rank {r}: {rules.doing(statuses[r])}" for r in needing)
        return (f"this rank exits after {ended} step(s) while rank(s) {needing} still need its share of later steps "
                f"({details}): it left the training loop early, after an error (see above) or without join(). When "
                "ranks have different numbers of batches, call psgd.join() (pipesgd_hvd.torch.join()) on each rank "
                "once it runs out, instead of leaving the loop; the other ranks stop with an error naming this rank")

    # -------------------------------------------------------------------------- monitor side
    def _ensure_started(self) -> None:
        if self._thread is None:
            self._start()

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, name=f"pipesgd-stall-{self.name}", daemon=True)
            self._thread.start()
        # Stopped as interpreter exit begins (the hook concurrent.futures uses; Python's own API,
        # underscored): a daemon thread inside a store call while the interpreter tears the
        # store down would abort the process.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            try:
                register(self._stop_at_exit)
            except RuntimeError:  # exit has begun
                self._stop.set()

    def _stop_at_exit(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2 * self.settings.period_s + 6.0)  # a store call waits 5 s at most

    def _helper(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._waiter is None:
            self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pipesgd-wait")
        return self._waiter

    def close(self) -> None:
        self._stop.set()
        if self._waiter is not None:
            self._waiter.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.period_s):
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - the inspector must never take the process down
                self._say_once(f"bug:{type(exc).__name__}", logging.WARNING,
                               f"pipesgd_hvd stall inspector: unexpected {type(exc).__name__}: {exc}")

    def _tick(self) -> None:
        """One look: answer a question, judge, and warn about a long wait. The board's part may
        fail (rank 0, which serves it, frozen or lost; each call is bounded): the warning is
        given all the same, and names the board's server."""
        board, st = self.board, self.status
        if board is not None:
            try:
                request = board.requests()
                if self._dirty:
                    self._dirty = False
                    self._publish(max(self._answered, 0))
                if request != self._answered:  # someone asked: look, judge what can be judged, answer
                    self._statuses = self._read()
                    self._judge(self._statuses, self._need())
                    self._publish(request)
                    self._say_if_in_horovod_join()
                self._board_answered()
            except BoardUnavailable as exc:
                self._board_failed(exc)
        wait = st.wait
        if wait is None:
            self._asked, self._warned = None, 0
            return
        now = time.monotonic()
        if board is not None and now - wait.since >= self.settings.ask_after_s:
            try:
                if self._asked is None or now - self._asked[1] > max(4 * self.settings.period_s, 2.0):
                    self._asked = (self._ask(), now)
                self._statuses = self._read()
                self._board_answered()
                self._judge(self._statuses, wait.step)
                self._publish(max(self._answered, 0))
            except BoardUnavailable as exc:
                self._board_failed(exc)
        waited = time.monotonic() - wait.since  # (the board's calls may have taken seconds)
        check, shutdown = self.settings.check_s, self.settings.shutdown_s
        if check and waited >= check * (self._warned + 1):
            self._warned = int(waited // check)
            log.warning(self._stall_message(wait, waited))
        if shutdown and waited >= shutdown and self.verdict is None:
            message = (f"{self._stall_message(wait, waited)} Ending the wait after "
                       f"PIPESGD_STALL_SHUTDOWN_TIME_SECONDS={shutdown:g} s")
            log.error(message)
            self.verdict = self.error_type(message)

    def _board_failed(self, exc: BoardUnavailable) -> None:
        if self._board_down is None:  # since the call that has not answered began
            self._board_down = (str(exc), time.monotonic() - getattr(exc, "waited_s", 0.0))
        self._say_once("board", logging.INFO, f"pipesgd_hvd stall inspector: {exc}; rank names are not available "
                                              "until it answers")

    def _board_answered(self) -> None:
        if self._board_down is not None:
            self._board_down = None
            self._said.discard("board")

    def _server_name(self) -> str:
        server = getattr(self.board, "server_rank", None)
        return f"rank {server}" if server is not None else "the board's server"

    def _need(self) -> int:
        """The latest step whose shares this rank needs from everyone (waiting or not)."""
        wait = self.status.wait
        return wait.step if wait is not None else self.status.begun - 1

    def _judge(self, statuses: List[Optional[Dict[str, Any]]], step: int) -> None:
        """A verdict for a rank that can never give its share of ``step``: exiting, stopped at an
        error, or inside Horovod's own join. Sticky: such a rank does not come back."""
        if self.verdict is not None or step < 0:
            return
        gone = rules.gone(statuses, self.rank, step)
        if gone is not None:
            rank, why = gone
            self.knows.append(rank)
            log.error(f"pipesgd_hvd: {why}")
            self.verdict = self.error_type(why)
            self._publish_quietly()

    def _say_if_in_horovod_join(self) -> None:
        st = self.status
        where, in_join, _ = rules.where(self.status.thread)
        if in_join and st.phase not in ("join", "exit") and st.ended > 0:
            self._say_once("hvd.join", logging.ERROR, (
                f"pipesgd_hvd: this rank is inside Horovod's own hvd.join() ({where}) after {st.ended} step(s) while "
                "other ranks wait for its share of the pipelined optimizer's steps: Horovod's join does not take part "
                "in them. Call pipesgd_hvd.torch.join() instead (psgd.join(), or hvd.join() after "
                "`import pipesgd_hvd.torch as hvd`); the other ranks stop with an error naming this rank"))

    def _say_once(self, key: str, level: int, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.log(level, message)

    # ----------------------------------------------------------------------------- the board
    def _ask(self) -> int:
        assert self.board is not None
        self._publish_quietly()
        return self.board.poke()

    def _read(self) -> List[Optional[Dict[str, Any]]]:
        assert self.board is not None
        return self.board.read()

    def _publish_quietly(self) -> None:
        if self.board is None:
            return
        try:
            self._publish(max(self._answered, 0))
        except BoardUnavailable:
            pass

    def _publish(self, answers: int) -> None:
        st, now = self.status, time.monotonic()
        where, in_join, in_horovod = rules.where(st.thread)
        wait = st.wait
        entry = {"rank": self.rank, "phase": st.phase, "begun": st.begun, "ended": st.ended,
                 "wait": [wait.step, wait.bucket, wait.what, round(now - wait.since, 1)] if wait else None,
                 "for_s": round(now - st.since, 1), "where": where, "hvd_join": in_join, "in_horovod": in_horovod,
                 "flushes": [list(f) for f in st.flushes], "joined_at": st.joined_at, "error": st.error,
                 "knows": list(self.knows), "answers": answers, "host": socket.gethostname(), "pid": os.getpid()}
        assert self.board is not None
        self.board.publish(entry)
        self._answered = max(self._answered, answers)

    # -------------------------------------------------------------------------------- words
    def _stall_message(self, wait: Wait, waited: float) -> str:
        bucket = f", bucket {wait.bucket}" if wait.bucket is not None else ""
        if self.board is None:
            missing = (f"unknown with this transport ({self.transport}); the default transport under Horovod, the "
                       "pipeline channel, names them")
        else:
            # A rank that had two ticks to answer the latest question and did not: frozen, or blocked in C.
            asked = self._asked
            unanswered = asked[0] if asked and time.monotonic() - asked[1] > 2 * self.settings.period_s + 0.5 else 0
            missing = self._describe_ranks(self._statuses, unanswered, wait.step)
        timeout = default_timeout()
        return (f"pipesgd_hvd stall: rank {self.rank} has waited {waited:.0f} s for {wait.what} of step {wait.step}"
                f"{bucket} (pipeline {self.name}). Not arrived: {missing}. Likely causes: {CAUSES}. "
                f"PIPESGD_STALL_CHECK_TIME_SECONDS sets this warning's threshold"
                f"{f'; PIPESGD_TIMEOUT={timeout:g} s ends the wait' if timeout else ''}")

    def _describe_ranks(self, statuses: List[Optional[Dict[str, Any]]], asked: int, step: int) -> str:
        parts = []
        down = self._board_down
        server = getattr(self.board, "server_rank", None)
        if down is not None:
            asked = 0  # no fresh answers can come: what follows is each rank's last news
            silent = time.monotonic() - down[1]
            last = statuses[server] if server is not None and server < len(statuses) else None
            seen = f"last seen {rules.doing(last)}" if last is not None else "no entry of it read yet"
            if server == self.rank:  # this process serves it: its store is flooded or overloaded
                parts.append(f"(the status board this rank serves has not answered for {silent:.0f} s: its store is "
                             "overloaded; each rank's last news follows)")
            else:
                parts.append(f"{self._server_name()} (neither it nor the status board it serves has answered for "
                             f"{silent:.0f} s: its process or host is frozen, lost or overloaded; {seen})")
        for r, s in enumerate(statuses):
            if r == self.rank or (down is not None and r == server):
                continue
            if s is None:
                parts.append(f"rank {r} (no status yet)")
            elif s["phase"] not in ("exit", "failed") and s["answers"] < asked:
                parts.append(f"rank {r} (does not answer the status board: frozen, or its Python is blocked in a C "
                             f"call; last seen {rules.doing(s)})")
            elif s["begun"] <= step or s["phase"] != "train":
                parts.append(f"rank {r} ({rules.doing(s)})")
        return ", ".join(parts) if parts else "every rank has begun this step (a transport problem, or a lost peer)"


class _Blocking:
    def __init__(self, inspector: StallInspector, wait: Wait) -> None:
        self._inspector, self._wait = inspector, wait

    def __enter__(self) -> None:
        self._inspector.status.wait = self._wait
        self._inspector._ensure_started()

    def __exit__(self, *exc: Any) -> None:
        self._inspector.status.wait = None
