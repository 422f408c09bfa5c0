"""Every rank must hold the same tensors and settings, or the collectives mismatch and hang."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Sequence, Tuple

from .comm.base import Communicator

if TYPE_CHECKING:  # the engine imports this module
    from .engine import PipelineConfig

# The op name must not depend on anything rank-local (a differing name would itself hang).
CHECK_OP_NAME = "pipesgd.check"


def describe(mine: Dict[str, Sequence[Tuple[Any, ...]]], everyone: List[Dict[str, Any]]) -> None:
    """Raises the same ValueError on every rank where ``everyone`` (all ranks' ``mine``) differ."""
    for label in mine:
        ref = everyone[0][label]
        for rank, theirs_all in enumerate(everyone):
            theirs = theirs_all.get(label)
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


def check_ranks_agree(comm: Communicator, mine: Dict[str, Sequence[Tuple[Any, ...]]]) -> None:
    """One small allgather of ``mine`` (label -> list of entries); see :func:`describe`."""
    describe(mine, comm.allgather_object(mine, CHECK_OP_NAME))


def settings_entries(config: "PipelineConfig", codec_name: str) -> List[Tuple[str, Any]]:
    """The settings that must be equal on every rank, as (name, value) pairs."""
    return [("width", config.width), ("warmup_steps", config.warmup_steps), ("op", config.op.value),
            ("fusion_threshold_bytes", config.fusion_threshold_bytes),
            ("gradient_predivide_factor", config.gradient_predivide_factor), ("compression", codec_name)]
