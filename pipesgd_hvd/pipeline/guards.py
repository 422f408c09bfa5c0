"""Cross-rank guards: every rank must hold the same tensors and settings, or the collectives
mismatch and hang; and while training runs, the ranks must still agree on step counts and weights.

Framework-free (numpy host arrays in, one ``allgather_object`` through the Communicator), so
every adapter uses the same checks and gets the same messages. Each check raises the same error
on every rank, since every rank compares the same gathered values.

* :func:`check_pipeline_agrees`, :func:`check_ranks_agree`: settings and tensors, at construction
  and for each new set of trainable tensors; :func:`agree_pipeline_name`: collective names.
* :func:`check_steps_agree`: every rank has ended the same number of steps (run at ``flush()``
  and at each replica check). A rank that called ``step()`` more or fewer times would otherwise
  leave a reduction that never completes.
* :func:`check_replicas`: a 64-bit checksum of every parameter's bytes, compared across ranks
  (``check_replicas_every=N``). Replicas are bitwise identical by design; a difference means
  something changed one rank's weights alone, and the first tensor that differs is named.
* :class:`StepWatchdog`: ends the process when a step has been running for longer than
  ``PIPESGD_TIMEOUT``, for transports whose collectives cannot be waited on with a timeout (a
  Horovod op inside a traced TensorFlow step blocks in the graph executor, not in Python).
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..comm.base import TIMEOUT_CAUSES, Communicator
from .config import PipelineConfig, settings_entries
from .fusion import TensorSpec

# Op names must not depend on anything rank-local (a differing name would itself hang).
CHECK_OP_NAME = "pipesgd.check"
INSTANCE_OP_NAME = "pipesgd.instance"
STEPS_OP_NAME = "pipesgd.steps"
REPLICAS_OP_NAME = "pipesgd.replicas"


class StepCountMismatchError(RuntimeError):
    """Ranks ended different numbers of steps."""


class ReplicaDriftError(RuntimeError):
    """Ranks hold different weights."""


def checksum(array: Any) -> bytes:
    """8 bytes of BLAKE2b over the array's raw bytes (C order): equal iff bitwise equal, in practice."""
    return hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=8).digest()


def _steps_message(steps: List[int], where: str) -> str:
    counts = ", ".join(f"rank {r}: {s}" for r, s in enumerate(steps))
    return (f"ranks are at different steps at {where} ({counts} step(s) ended). Every rank must call step() "
            "the same number of times: give every rank the same number of batches (DistributedSampler with "
            "drop_last=True, or a fixed number of steps per epoch), and skip a batch on all ranks or on none")


def check_steps_agree(comm: Communicator, step: int, where: str) -> None:
    """Raises :class:`StepCountMismatchError` on every rank if the ranks' step counts differ."""
    steps = [int(s) for s in comm.allgather_object(int(step), STEPS_OP_NAME)]
    if len(set(steps)) > 1:
        raise StepCountMismatchError(_steps_message(steps, where))


# How to re-sync the weights after a drift, per framework (the message ends with it).
TORCH_RESYNC = "hvd.broadcast_parameters(model.state_dict(), root_rank=0)"


def check_replicas(comm: Communicator, step: int, named: Sequence[Tuple[str, Any]],
                   last_agreed: int = 0, resync: str = TORCH_RESYNC, joined: bool = False) -> None:
    """Compares a checksum of every (name, host array) across ranks; raises
    :class:`ReplicaDriftError` on every rank naming the first tensor that differs.
    ``last_agreed``: the step of the previous check that passed (for the message). ``joined``:
    this rank has joined (uneven data): it sends its step count only; its weights, which no
    longer follow the others' until the broadcast after ``join()``, are not compared."""
    mine = (int(step), [] if joined else [checksum(array) for _, array in named], bool(joined))
    everyone = comm.allgather_object(mine, REPLICAS_OP_NAME)
    raise_if_replicas_differ(everyone, step, [name for name, _ in named], last_agreed, resync)


def raise_if_replicas_differ(everyone: Sequence[Tuple[Any, ...]], step: int, names: Sequence[str],
                             last_agreed: int = 0, resync: str = TORCH_RESYNC) -> None:
    """The comparison of :func:`check_replicas`, given every rank's (step, checksums[, joined]) in
    rank order (gathered by any means: the TensorFlow adapter gathers them inside its traced step).
    Joined ranks are left out of the weight comparison; the first rank still training is the
    reference."""
    steps = [int(entry[0]) for entry in everyone]
    if len(set(steps)) > 1:
        raise StepCountMismatchError(_steps_message(steps, f"the replica check of step {step}"))
    training = [r for r, entry in enumerate(everyone) if not (len(entry) > 2 and entry[2])]
    if not training:
        return
    ref = training[0]
    reference = everyone[ref][1]
    for i, name in enumerate(names):
        differing = [r for r in training if everyone[r][1][i] != reference[i]]
        if differing:
            ranks = ", ".join(str(r) for r in differing)
            raise ReplicaDriftError(
                f"replicas differ at step {step}: parameter '{name}' on rank(s) {ranks} differs from rank {ref} "
                f"(they were identical at step {last_agreed}). Something changed some ranks' weights alone: an "
                "update or weight edit run on some ranks only, load_state_dict() on one rank, or a rank-dependent "
                f"branch. Fix that code, then resume every rank from the same checkpoint (or re-sync with {resync})")


class StepWatchdog:
    """A daemon thread that ends the process (status 1) when a step has been in progress for
    longer than ``timeout`` seconds, with a message naming ``PeerLostError`` and the causes.

    ``progress()`` returns (steps begun, steps ended); a step is in progress while the first is
    ahead. Why end the process instead of raising: where this is used, the wait is a collective
    inside a traced TensorFlow step, which runs in the graph executor; Python cannot interrupt it,
    and Horovod's shutdown (the only thing that would fail the op) itself waits forever for a frozen
    peer under MPI. Without this a lost peer that the transport does not notice is a hang.
    ``stop()`` ends the thread (at interpreter exit, before the transport shuts down)."""

    def __init__(self, progress: Callable[[], Tuple[int, int]], timeout: float, what: str,
                 period: Optional[float] = None) -> None:
        self._progress = progress
        self.timeout = float(timeout)
        self._what = what
        self._period = period if period is not None else min(1.0, self.timeout / 10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pipesgd-step-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        seen: Optional[Tuple[int, int]] = None
        since = time.monotonic()
        while not self._stop.wait(self._period):
            try:
                begun, ended = self._progress()
            except Exception:  # noqa: BLE001 - what it watched is gone (garbage-collected, shut down)
                return
            now = time.monotonic()
            if begun <= ended:  # between steps: a rank may legitimately idle (evaluation, saving)
                seen = None
            elif (begun, ended) != seen:
                seen, since = (begun, ended), now
            elif now - since > self.timeout:
                self._fire(now - since)
                return

    def _fire(self, waited: float) -> None:
        sys.stderr.write(
            f"pipesgd_hvd: PeerLostError: {self._what} did not complete within {self.timeout:g} s "
            f"(PIPESGD_TIMEOUT; waited {waited:.1f} s): {TIMEOUT_CAUSES}. A collective inside a traced "
            "TensorFlow step cannot be interrupted from Python, so the process ends now with status 1; restart "
            "every rank from the last checkpoint\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


class _InstanceCounter:
    """Pipelined optimizers built in this process so far. Like Horovod's own handle counter, a
    fact about the process: every optimizer in it needs collective names of its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0

    def propose(self) -> int:
        with self._lock:
            self._next += 1
            return self._next - 1

    def agreed(self, number: int) -> None:
        with self._lock:  # every later proposal here is above the agreed number
            self._next = max(self._next, number + 1)


_INSTANCES = _InstanceCounter()


def provisional_name() -> str:
    """A name for a pipeline that cannot agree on one yet (a worker joining a Horovod elastic
    job issues no collective until every rank syncs; :func:`agree_pipeline_name` runs then)."""
    return f"psgd.p{_INSTANCES.propose()}"


def agree_pipeline_name(comm: Communicator) -> str:
    """The prefix of one optimizer's collective names: the same on every rank, distinct from every
    other optimizer's in this process (two models of one class, an optimizer per experiment, one
    per optimizer class over one model), and independent of anything rank-local, so that ranks
    whose models differ still reach the construction check and get its error instead of a hang.
    One small allgather: the ranks take the largest instance number any of them proposes, so
    ranks that built different numbers of optimizers before still agree."""
    agreed = max(int(n) for n in comm.allgather_object(_INSTANCES.propose(), INSTANCE_OP_NAME))
    _INSTANCES.agreed(agreed)
    return f"psgd.{agreed}"


def describe(mine: Dict[str, Sequence[Tuple[Any, ...]]], everyone: List[Dict[str, Any]]) -> None:
    """Raises the same ValueError on every rank where ``everyone`` (all ranks' ``mine``) differ."""
    for label in mine:
        ref = everyone[0].get(label)
        for rank, theirs_all in enumerate(everyone):
            theirs = theirs_all.get(label) if isinstance(theirs_all, dict) else None
            if theirs is None or ref is None:
                # Not the same check: ranks are at different points of the program.
                raise ValueError(f"ranks ran different checks at once (rank 0: {sorted(everyone[0])}, rank {rank}: "
                                 f"{sorted(theirs_all) if isinstance(theirs_all, dict) else theirs_all!r}). Every rank "
                                 "must create the same optimizers, in the same order, and call them alike")
            if theirs == ref:
                continue
            for pos, (a, b) in enumerate(zip(ref, theirs)):
                if a != b:
                    raise ValueError(
                        f"{label} differ across ranks at entry {pos}: rank 0 has {a}, rank {rank} has {b}. "
                        "Every rank must build the same model (parameter names, shapes, dtypes, order) and "
                        "pass the same optimizer settings")
            longer, owner = (ref, 0) if len(ref) > len(theirs) else (theirs, rank)
            raise ValueError(f"{label} differ across ranks: rank 0 has {len(ref)} entries, rank {rank} has "
                             f"{len(theirs)}; the first extra one is rank {owner}'s {longer[min(len(ref), len(theirs))]}. "
                             "Every rank must build the same model and optimizer")


def check_ranks_agree(comm: Communicator, mine: Dict[str, Sequence[Tuple[Any, ...]]],
                      name: str = CHECK_OP_NAME) -> None:
    """One small allgather of ``mine`` (label -> list of entries); see :func:`describe`. ``name``
    tells apart checks that could run at the same time (one optimizer's construction beside
    another's step); it must be the same on every rank."""
    describe(mine, comm.allgather_object(mine, name))


def pipeline_entries(config: PipelineConfig, codec_name: str,
                     specs: Sequence[TensorSpec]) -> Dict[str, List[Tuple[Any, ...]]]:
    """What one pipeline checks across ranks when it is built: settings and tensors."""
    return {"settings": settings_entries(config, codec_name),
            "tensors": [(s.name, tuple(s.shape), s.dtype) for s in specs]}


def check_pipeline_agrees(comm: Communicator, config: PipelineConfig, codec_name: str,
                          specs: Sequence[TensorSpec]) -> None:
    """The check every pipeline runs when it is built (the eager engine and TensorFlow's alike)."""
    check_ranks_agree(comm, pipeline_entries(config, codec_name, specs), f"{config.name}.check")
