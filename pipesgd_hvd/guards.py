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
"""
from __future__ import annotations

import hashlib
from typing import Any, List, Sequence, Tuple

import numpy as np

from .comm.base import Communicator

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


def check_replicas(comm: Communicator, step: int, named: Sequence[Tuple[str, Any]],
                   last_agreed: int = 0) -> None:
    """Compares a checksum of every (name, host array) across ranks; raises
    :class:`ReplicaDriftError` on every rank naming the first tensor that differs.
    ``last_agreed``: the step of the previous check that passed (for the message)."""
    mine = (int(step), [checksum(array) for _, array in named])
    everyone = comm.allgather_object(mine, REPLICAS_OP_NAME)
    steps = [s for s, _ in everyone]
    if len(set(steps)) > 1:
        raise StepCountMismatchError(_steps_message(steps, f"the replica check of step {step}"))
    reference = everyone[0][1]
    for i, (name, _) in enumerate(named):
        differing = [r for r, (_, sums) in enumerate(everyone) if sums[i] != reference[i]]
        if differing:
            ranks = ", ".join(str(r) for r in differing)
            raise ReplicaDriftError(
                f"replicas differ at step {step}: parameter '{name}' on rank(s) {ranks} differs from rank 0 "
                f"(they were identical at step {last_agreed}). Something changed some ranks' weights alone: an "
                "update or weight edit run on some ranks only, load_state_dict() on one rank, or a rank-dependent "
                "branch. Fix that code, then resume every rank from the same checkpoint (or re-sync with "
                "hvd.broadcast_parameters(model.state_dict(), root_rank=0))")
