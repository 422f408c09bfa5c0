"""What the ranks' status-board entries mean: the rules the stall inspector decides by.

Pure functions of the entries every rank publishes (:mod:`pipesgd_hvd.comm.board`; the fields are
those :meth:`~pipesgd_hvd.pipeline.stall.StallInspector._publish` writes: ``phase``, ``begun``,
``ended``, ``wait`` = [step, bucket, what, seconds], ``flushes`` = [[flush() number, steps ended],
...] of the last few, ``in_horovod``, ``hvd_join``, ``where``, ``for_s``, ``answers``, ``knows``), so that
every rank reading the same entries decides the same, and each rule is tested on its own. Plus
:func:`where`, which says where a thread is.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

from .guards import StepCountMismatchError, _steps_message

Entry = Optional[Dict[str, Any]]  # None: no entry yet, or one that failed its check
HOROVOD_BLOCKED_S = 1.0  # a rank this long in one Horovod call after its step is blocked there
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flush_outcome(entries: Sequence[Entry], me: int, seq: int, ended: int,
                  error_type: Type[Exception]) -> Optional[str]:
    """``flush()`` number ``seq`` of rank ``me``, after ``ended`` steps: "agreed" (every rank
    flushes at the same step, or is in ``join()``, which takes part in whatever steps run),
    "behind" (a rank ran a step this one never did and is blocked on this rank's share: this rank
    ran out of data, and its ``join()`` will serve it), None (a rank is still training toward its
    own flush: ask again). Raises StepCountMismatchError when the ranks flush at different steps
    and ``error_type`` when one stopped at an error."""
    counts: List[int] = []
    behind = False
    for r, s in enumerate(entries):
        if r == me:
            counts.append(ended)
            continue
        if s is None:
            return None
        if s["phase"] == "join":
            counts.append(ended)  # (after its own flush() too)
            continue
        theirs = dict((n, count) for n, count in s["flushes"])
        if seq in theirs:  # even if it failed or flushed again since: it saw the same
            counts.append(theirs[seq])
            continue
        if s["flushes"] and s["flushes"][0][0] > seq:  # long past this flush(): it agreed or went behind
            counts.append(ended)
            continue
        if s["phase"] == "failed":
            raise error_type(f"rank {r} stopped at an error while this rank was in flush(): {s['error']}")
        if s["phase"] == "exit":
            counts.append(s["ended"])
            continue
        wait = s["wait"]
        blocked_here = wait is not None and wait[1] is not None and wait[0] >= ended
        # A metric hvd.allreduce after its step waits in Horovod for this rank's join() instead.
        blocked_in_horovod = wait is None and s["in_horovod"] and s["for_s"] >= HOROVOD_BLOCKED_S
        if s["begun"] > ended and (blocked_here or blocked_in_horovod):
            behind = True
            counts.append(ended)
            continue
        return None
    if len(set(counts)) > 1:
        raise StepCountMismatchError(_steps_message(counts, "flush()"))
    return "behind" if behind else "agreed"


def needing(entries: Sequence[Entry], me: int, ended: int) -> List[int]:
    """The ranks that began a step rank ``me`` never ran (after ``ended`` steps): they wait, or
    will, for its share. One that failed already counts: it may have stopped at this very exit."""
    return [r for r, s in enumerate(entries) if r != me and s is not None and s["phase"] != "exit" and s["begun"] > ended]


def undecided(entries: Sequence[Entry], me: int, ended: int) -> bool:
    """A rank at ``me``'s step count, between steps: it may begin the next step (and then need
    ``me``'s share) or flush (and not)."""
    return any(r != me and s is not None and s["phase"] == "train" and s["wait"] is None and s["begun"] == ended
               for r, s in enumerate(entries))


def all_fresh(entries: Sequence[Entry], me: int, asked: int) -> bool:
    """Every other rank answered question number ``asked`` (or said its last word: exit, failure)."""
    return all(s is not None and (s["answers"] >= asked or s["phase"] in ("exit", "failed"))
               for r, s in enumerate(entries) if r != me)


def gone(entries: Sequence[Entry], me: int, step: int) -> Optional[Tuple[int, str]]:
    """A rank that can never give its share of ``step`` (it is exiting, stopped at an error, or
    inside Horovod's own join, which does not take part in the pipeline), and why, in words."""
    if step < 0:
        return None
    for r, s in enumerate(entries):
        if r == me or s is None or s["ended"] > step:
            continue
        if s["phase"] == "exit":
            return r, (f"rank {r} is exiting after {s['ended']} step(s) while this rank waits for its share of step "
                       f"{step}: it left the training loop without join() (uneven data per rank), or after an error "
                       "(see its log). When ranks have different numbers of batches, call psgd.join() "
                       "(pipesgd_hvd.torch.join()) on each rank once it runs out, instead of leaving the loop")
        if s["phase"] == "failed":
            return r, (f"rank {r} stopped at an error ({s['error']}); this rank waits for its share of step {step}, "
                       f"which will never come. The first error in rank {r}'s log is the cause")
        if s["hvd_join"] and s["phase"] != "join":
            return r, (f"rank {r} is inside Horovod's own hvd.join() ({s['where']}) after {s['ended']} step(s), "
                       f"while this rank waits for its share of step {step}: Horovod's join does not take part in "
                       "the pipelined optimizer's steps. Call pipesgd_hvd.torch.join() instead (psgd.join(), or "
                       "hvd.join() after `import pipesgd_hvd.torch as hvd`): it runs Horovod's join too")
    return None


def doing(s: Entry) -> str:
    """One rank's entry in words."""
    if s is None:
        return "no status"
    at = f", at {s['where']}" if s.get("where") else ""
    ended = f"has ended {s['ended']} step(s)"
    phase = s["phase"]
    if s.get("hvd_join") and phase != "join":
        return f"inside Horovod's own hvd.join(){at}, {ended}"
    if s.get("in_horovod") and s["wait"] is None and phase == "train":
        return f"inside a Horovod call for {s['for_s']:.0f} s{at}, {ended}"
    if phase == "flush":
        return f"in flush() for {s['for_s']:.0f} s, {ended}"
    if phase == "join":
        return f"in join() since step {s['joined_at']}"
    if phase == "exit":
        return f"exiting, {ended}"
    if phase == "failed":
        return f"stopped at an error: {s['error']}"
    if s["wait"] is not None:
        step, _, what, seconds = s["wait"]
        return f"waiting {seconds:.0f} s for {what} of step {step}, {ended}"
    return f"outside the pipeline for {s['for_s']:.0f} s{at}, {ended}"


def where(thread: Optional[int]) -> Tuple[Optional[str], bool, bool]:
    """Where thread ``thread`` is: its innermost frame outside this package, the standard library
    and installed packages (``file:line in function``); whether it is inside Horovod's own join;
    whether it is inside any Horovod call (a metric ``hvd.allreduce`` waits there for ranks that
    left)."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    at, in_join, in_horovod = None, False, False
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}horovod{os.sep}" in path:
            in_horovod = True
            in_join = in_join or frame.f_code.co_name == "join"
        if at is None and not _internal(path):
            at = f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return at, in_join, in_horovod


def _internal(path: str) -> bool:
    return (path.startswith(_PACKAGE) or "site-packages" in path or "dist-packages" in path
            or path.startswith(os.path.dirname(os.__file__)) or path.startswith("<"))
