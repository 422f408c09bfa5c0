"""The table of ``staleness_correction=`` values: each name and the
:class:`~pipesgd_hvd.staleness.correction.Correction` behind it (docs/options.md describes each)."""
from __future__ import annotations

from typing import Dict, Optional, Type

from .acco import Acco
from .correction import Correction, CorrectionContext
from .prediction import AdamPrediction, WeightPrediction
from .split_batch import SplitBatch
from .stale_gradient import DelayCompensation, EagerMix

#: Every correction by its ``staleness_correction=`` name.
CORRECTIONS: Dict[str, Type[Correction]] = {cls.name: cls for cls in (
    WeightPrediction, AdamPrediction, DelayCompensation, EagerMix, SplitBatch, Acco)}


def correction_class(name: Optional[str]) -> Type[Correction]:
    """The class behind ``staleness_correction=name`` (None: the identity)."""
    if name is None:
        return Correction
    found = CORRECTIONS.get(name)
    if found is None:
        raise ValueError(f"unknown staleness_correction {name!r}; one of {sorted(CORRECTIONS)}")
    return found


def build(name: Optional[str], context: CorrectionContext) -> Correction:
    """The correction ``name`` for ``context``, or the identity where it has nothing to do at
    ``context.width`` (width 1: every gradient is fresh)."""
    cls = correction_class(name)
    return cls(context) if cls.active_at(context.width) else Correction(context)
