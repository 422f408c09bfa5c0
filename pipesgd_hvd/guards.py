"""Checks that the ranks still agree while training runs: step counts and replica checksums.

Framework-free (numpy host arrays in, one ``allgather_object`` through the Communicator), so
every adapter uses the same checks and gets the same messages. Each check raises the same error
on every rank, since every rank compares the same gathered values.

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
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from .comm.base import TIMEOUT_CAUSES, Communicator

# Op names must not depend on anything rank-local (a differing name would itself hang).
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
                   last_agreed: int = 0, resync: str = TORCH_RESYNC) -> None:
    """Compares a checksum of every (name, host array) across ranks; raises
    :class:`ReplicaDriftError` on every rank naming the first tensor that differs.
    ``last_agreed``: the step of the previous check that passed (for the message)."""
    mine = (int(step), [checksum(array) for _, array in named])
    everyone = comm.allgather_object(mine, REPLICAS_OP_NAME)
    raise_if_replicas_differ(everyone, step, [name for name, _ in named], last_agreed, resync)


def raise_if_replicas_differ(everyone: Sequence[Tuple[int, Sequence[Any]]], step: int, names: Sequence[str],
                             last_agreed: int = 0, resync: str = TORCH_RESYNC) -> None:
    """The comparison of :func:`check_replicas`, given every rank's (step, checksums) in rank
    order (gathered by any means: the TensorFlow adapter gathers them inside its traced step)."""
    steps = [int(s) for s, _ in everyone]
    if len(set(steps)) > 1:
        raise StepCountMismatchError(_steps_message(steps, f"the replica check of step {step}"))
    reference = everyone[0][1]
    for i, name in enumerate(names):
        differing = [r for r, (_, sums) in enumerate(everyone) if sums[i] != reference[i]]
        if differing:
            ranks = ", ".join(str(r) for r in differing)
            raise ReplicaDriftError(
                f"replicas differ at step {step}: parameter '{name}' on rank(s) {ranks} differs from rank 0 "
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
