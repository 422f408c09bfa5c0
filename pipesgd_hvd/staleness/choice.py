"""``staleness_correction="auto"``, and the advice a pipelined optimizer prints at construction.

"auto" never changes what a call means: it picks, per family of the wrapped optimizer, the
correction that was best in the accuracy study (``docs/accuracy.md``, "Which correction per
optimizer class") among those where one call of ``step()`` is one update. The accurate mode,
``"split_batch"``, makes one update of two calls (two halves of the batch), which only the user
can arrange: it is chosen by name, and the advice says when and how.

The framework packages say which family the wrapped optimizer belongs to (:data:`FAMILIES`).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

#: adam: Adam and AdamW (their moments are read by "adam_prediction"); adaptive: the other
#: per-coordinate step sizes (NAdam, RAdam, Adamax, Adagrad, Adadelta, RMSprop); sgd: SGD with or
#: without momentum; other: anything else (Muon, LBFGS, Lion, custom optimizers).
FAMILIES = ("adam", "adaptive", "sgd", "other")

#: The one-call correction each family gets from "auto", from the accuracy study. AdamW (stdlib-lm,
#: int8+EF): adam_prediction +5.62% perplexity against synchronous training, weight_prediction
#: +5.79%, plain width 2 +21.0%. SGD (four tasks): weight_prediction within the target on 3 of 4
#: (worst 0.92 point below synchronous), eager on 2, plain width 2 on 1 (8.8 points below).
RULE: Dict[str, Optional[str]] = {"adam": "adam_prediction", "adaptive": "weight_prediction",
                                  "sgd": "weight_prediction", "other": None}

#: Where the rule's correction cannot run with the other settings, the one that runs with all.
FALLBACK: Dict[str, Optional[str]] = {"adam": "weight_prediction", "adaptive": None, "sgd": None, "other": None}

#: What the study measured for each family pipelined without the accurate mode (docs/accuracy.md),
#: quoted by the advice: ({correction or None: what it trained like against synchronous training},
#: why). AdamW: stdlib-lm, 2 ranks, int8+EF. NAdamW: the stdlib-nadamw task. SGD: the four
#: classification tasks at 2 and 4 ranks (the learning rate scaled by the ranks), int8+EF.
MEASURED: Dict[str, Any] = {
    "adam": ({None: "+21% perplexity", "weight_prediction": "+5.8% perplexity",
              "adam_prediction": "+5.6% perplexity", "eager": "+8.0% perplexity",
              "delay_compensation": "+20% perplexity", "split_batch": "-0.04% perplexity"},
             "A whole gradient one step stale stays far from synchronous accuracy with Adam's kin"),
    "adaptive": ({None: "+4.9% perplexity (NAdamW)",
                  "split_batch": "-0.04% perplexity with AdamW (NAdamW not measured)"},
                 "A whole gradient one step stale stays far from synchronous accuracy with Adam's kin"),
    "sgd": ({None: "up to 24 points of test accuracy lower at 2 ranks and up to 78 at 4",
             "weight_prediction": "within 1 point of test accuracy at 2 ranks but up to 70 points lower at 4",
             "split_batch": "within 0.6 point of test accuracy at 2 and 4 ranks"},
            "With SGD what a stale gradient costs grows with the learning rate, hence with the ranks"),
}


class AccuracyWarning(UserWarning):
    """A pipelined optimizer's setting that costs accuracy, or changes what a call means, with the
    measured figure and the fix (``warnings.filterwarnings("ignore", category=AccuracyWarning)``
    silences it)."""


def family_by_class(optimizer: Any, framework: str, adaptive: Sequence[str]) -> str:
    """The family of ``optimizer`` from the first class of its MRO defined in the module tree
    ``framework`` ("torch.optim", "keras"), so that a user's subclass keeps its base's: "adam"
    for Adam and AdamW, "adaptive" where its name is in ``adaptive`` (the framework's names for
    Adam's other kin), "sgd" for SGD, and "other" for anything else."""
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith(framework):
            if cls.__name__ in ("Adam", "AdamW"):
                return "adam"
            if cls.__name__ in adaptive:
                return "adaptive"
            if cls.__name__ == "SGD":
                return "sgd"
    return "other"


def choose(family: Optional[str], fits: Callable[[str], bool] = lambda correction: True) -> Optional[str]:
    """The correction "auto" gives an optimizer of ``family`` (None: no correction); ``fits(name)``:
    whether that correction runs with the other settings (if not, :data:`FALLBACK`'s)."""
    if family not in FAMILIES:
        raise ValueError(f"staleness_correction='auto' needs the wrapped optimizer's family, one of {FAMILIES}; "
                         f"got {family!r}: pass a correction by name instead")
    first = RULE[family]
    if first is None or fits(first):
        return first
    second = FALLBACK[family]
    return second if second is None or fits(second) else None


HOW_TO_SPLIT = ("make each update two calls of half the batch: in PyTorch put `for x, y in psgd.halves(x, y):` "
                "around the body of your training loop (forward, backward, step); in Keras halve fit's "
                "batch_size (docs/options.md, 'The accurate mode')")


def advice(family: Optional[str], optimizer_name: str, width: Any, correction: Optional[str],
           chosen_by_auto: bool, calls_per_update: int) -> Optional[str]:
    """The message a new optimizer prints once (rank 0), or None: when the mode makes an update
    of two calls (what a call and a batch mean change), and when an optimizer of a family the study
    measured (Adam's kin, SGD) runs pipelined without the accurate mode (the measured gap, and the fix)."""
    if calls_per_update == 2:
        return (f"pipesgd_hvd: staleness_correction={correction!r}: two optimizer steps make one update (PyTorch's "
                f"step(), Keras's train steps: a look-ahead half and a fresh half of the batch), so {HOW_TO_SPLIT}. A "
                "loop left as it was makes half the updates, each of twice the batch.")
    if width == 1 or family not in MEASURED:
        return None
    gaps, why = MEASURED[family]
    how = f"with staleness_correction={correction!r}" + (" (chosen by 'auto')" if chosen_by_auto else "") \
        if correction else "without a staleness correction"
    gap = gaps.get(correction)
    measured = f": in docs/accuracy.md this trained {gap} against synchronous training" if gap else ""
    if width == "auto":
        pipelined = "with width='auto' (which " + \
            ("then stays synchronous for it)" if family in ("adam", "adaptive") else "may pipeline it)")
    else:
        pipelined = f"pipelined (width={width})"
    return (f"pipesgd_hvd: {optimizer_name} {pipelined} {how}{measured}. {why}; for synchronous accuracy use "
            f"staleness_correction='split_batch' ({gaps['split_batch']}) and {HOW_TO_SPLIT}.")
