"""``staleness_correction="auto"``: which correction to use with which optimizer.

The choice is per optimizer family, from the accuracy study (``docs/accuracy.md``, its rule
section has the measurements behind each row). The framework packages say which family the
wrapped optimizer belongs to (:data:`FAMILIES`); :func:`choose` maps it to a correction.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

#: adaptive: Adam and its kin (per-coordinate step sizes: Adam, AdamW, NAdam, RAdam, Adamax,
#: Adagrad, Adadelta, RMSprop); sgd: SGD with or without momentum; other: anything else
#: (Muon, LBFGS, Lion, custom optimizers).
FAMILIES = ("adaptive", "sgd", "other")

#: The correction each family gets at width 2, from the accuracy study (docs/accuracy.md, "Which
#: correction per optimizer class"): split_batch was the one within the target on every task,
#: AdamW's, SGD's (the only one on all four) and the NAdamW and Muon recipes' ("other" rests on
#: Muon's). Kept per family: the fallbacks differ, and so may later measurements.
RULE: Dict[str, Optional[str]] = {"adaptive": "split_batch", "sgd": "split_batch", "other": "split_batch"}

#: Where the family's correction cannot run with the other settings (width="auto" or
#: compression="auto": the pipeline is rebuilt mid-run, which the corrections that keep per-step
#: state do not survive; split_batch at width >= 3; a GradScaler), the one that runs with all.
FALLBACK: Dict[str, Optional[str]] = {"adaptive": "weight_prediction", "sgd": "weight_prediction", "other": None}


def family_by_class(optimizer: Any, framework: str, adaptive: Sequence[str]) -> str:
    """The family of ``optimizer`` from the first class of its MRO defined in the module tree
    ``framework`` ("torch.optim", "keras"), so that a user's subclass keeps its base's: "adaptive"
    where its name is in ``adaptive`` (the framework's names for Adam's kin), "sgd" for SGD, and
    "other" for anything else."""
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith(framework):
            if cls.__name__ in adaptive:
                return "adaptive"
            if cls.__name__ == "SGD":
                return "sgd"
    return "other"


def choose(family: Optional[str], fits: Callable[[str], bool] = lambda correction: True) -> Optional[str]:
    """The correction for an optimizer of ``family`` (None: no correction); ``fits(name)``: whether
    that correction runs with the other settings (if not, :data:`FALLBACK`'s)."""
    if family not in FAMILIES:
        raise ValueError(f"staleness_correction='auto' needs the wrapped optimizer's family, one of {FAMILIES}; "
                         f"got {family!r}: pass a correction by name instead")
    first = RULE[family]
    return first if first is None or fits(first) else FALLBACK[family]
