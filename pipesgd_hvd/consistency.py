"""Every rank must hold the same tensors and settings, or the collectives mismatch and hang."""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Sequence, Tuple

from .comm.base import Communicator
from .config import PipelineConfig, settings_entries
from .fusion import TensorSpec

# Op names must not depend on anything rank-local (a differing name would itself hang).
CHECK_OP_NAME = "pipesgd.check"
INSTANCE_OP_NAME = "pipesgd.instance"


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
