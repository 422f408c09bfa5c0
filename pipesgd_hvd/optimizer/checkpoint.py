"""The pipeline's checkpoint entry: one versioned format for every framework.

PyTorch's ``optimizer.state_dict()["pipesgd"]`` and Keras's ``optimizer.pipeline_state_dict()``
are this dict (the wrapped optimizer's own state sits beside it, in the framework's format)::

    {"format": 2,
     "step": steps ended,            "settings": [(name, value), ...] (must match to resume),
     "in_flight": [{"step": s, "meta": loss scale or None, "grads": {tensor name: averaged gradient}}],
                                      oldest first: reduced already (the same bytes on every rank)
     "codec": {"residuals": {key: tensor}} (error feedback; per rank),
     "residuals_of": {"rank": r, "size": n}: whose residuals "codec" holds (new in issue 40; an
                    entry without it reads as None: unknown, loaded as before),
     "stats": {"steps", "bytes_sent", "fp32_bytes"},
     "auto": the auto mode's state, or None,
     "prediction": weight prediction's state (real and previous weights by name), or None,
     "corrections": delay compensation's or eager mixing's per-step state (per rank), or None:
                    {"kind", "flags": [bool per slot], "slots": [{tensor name: tensor}]}}

Format 1 (before 2026-12) kept the auto and prediction parts in two more keys of PyTorch's state
dict, ``"pipesgd_auto"`` and ``"pipesgd_prediction"``; :func:`read` takes both.

Error-feedback residuals are one rank's quantization errors for its chunks of each bucket, in a
world of one size and one bucket layout. A resume that cannot use them (:func:`usable_residuals`:
another rank's file, as when every rank loads rank 0's, Horovod's usual habit; another world
size; another fusion threshold, compression or hierarchical setting) says why in a warning and
restarts them at zero, instead of using rank 0's on every rank or dropping them without a word.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

FORMAT = 2
KEY = "pipesgd"                                      # the entry in PyTorch's optimizer state dict
_FORMAT1_EXTRAS = {"auto": "pipesgd_auto", "prediction": "pipesgd_prediction"}


def compose(engine_state: Dict[str, Any], auto: Optional[Dict[str, Any]] = None,
            prediction: Optional[Dict[str, Any]] = None,
            corrections: Optional[Dict[str, Any]] = None,
            residuals_of: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
    """The entry, from the engine's (or TensorFlow pipeline's) state and the optional parts.
    ("corrections" and "residuals_of" are new in format 2's later versions; an entry without them
    reads as None.) ``residuals_of``: :func:`owner` of the rank that saves it."""
    return {"format": FORMAT, **engine_state, "auto": auto, "prediction": prediction, "corrections": corrections,
            "residuals_of": residuals_of}


def owner(rank: int, size: int) -> Dict[str, int]:
    """Whose error-feedback residuals an entry holds: the saving rank and its world's size."""
    return {"rank": int(rank), "size": int(size)}


# Settings that change what a residual means: the buckets (fusion), the codec, the two-level split.
_RESIDUAL_SETTINGS = ("compression", "fusion_threshold_bytes", "hierarchical")


def residuals_refusal(entry: Mapping[str, Any], rank: int, size: int,
                      settings: Sequence[Sequence[Any]]) -> Optional[str]:
    """Why this rank cannot use the entry's error-feedback residuals (None: it can)."""
    reasons = []
    saved_by = entry.get("residuals_of")
    if saved_by is not None:
        if saved_by.get("size") != size:
            reasons.append(f"they were saved in a world of {saved_by.get('size')} ranks and this one has {size} (a "
                           "residual belongs to a rank's chunk of a bucket, and the world's size sets the chunks)")
        elif saved_by.get("rank") != rank:
            reasons.append(f"they are rank {saved_by.get('rank')}'s, not this rank's (this rank loaded another rank's "
                           "file: a residual is the quantization error of the rank that saved it, and every rank "
                           "adding one rank's error would count it once per rank)")
    saved, mine = dict(tuple(e) for e in entry.get("settings", [])), dict(tuple(e) for e in settings)
    for name in _RESIDUAL_SETTINGS:
        if name in saved and saved[name] != mine.get(name):
            reasons.append(f"they were saved with {name}={saved[name]!r} and this pipeline has {mine.get(name)!r} "
                           "(other buckets or another codec: they would not match what they correct)")
    return "; ".join(reasons) if reasons else None


def usable_residuals(entry: Dict[str, Any], rank: int, size: int,
                     settings: Sequence[Sequence[Any]]) -> Dict[str, Any]:
    """``entry``, less its error-feedback residuals where this rank cannot use them (then a
    warning says why, and they restart at zero: at most one step's quantization error is lost)."""
    if not any((entry.get("codec") or {}).values()):  # nothing per rank in it (no residual yet, or no codec state)
        return entry
    why = residuals_refusal(entry, rank, size, settings)
    if why is None:
        return entry
    warnings.warn(f"pipesgd_hvd: the checkpoint's error-feedback residuals were not loaded on rank {rank}: {why}. They "
                  "restart at zero (at most one step's quantization error is lost). To resume them exactly, let each "
                  "rank save and load its own file, in a world of the same size, with the same compression, "
                  "fusion_threshold_mb and hierarchical settings")
    return {**entry, "codec": {}}


def read(outer: Mapping[str, Any]) -> Tuple[Optional[Dict[str, Any]], Dict[str, Any]]:
    """Splits a framework state dict into (our entry or None, the rest); the entry is returned in
    format 2 whatever format it was saved in."""
    rest = dict(outer)
    entry = rest.pop(KEY, None)
    extras = {part: rest.pop(key, None) for part, key in _FORMAT1_EXTRAS.items()}
    if entry is None:
        return None, rest
    version = entry.get("format")
    if version == 1:
        entry = compose({k: v for k, v in entry.items() if k != "format"}, **extras)
    elif version != FORMAT:
        raise ValueError(f"not a pipesgd_hvd checkpoint entry this version reads (format {version!r}; this "
                         f"version reads 1 and {FORMAT}): save it again with this version")
    return _prediction_as_correction(entry), rest


def _prediction_as_correction(entry: Dict[str, Any]) -> Dict[str, Any]:
    """Weight prediction's state was a part of its own ("prediction", kind-less) before every
    correction's was one part ("corrections", with its kind): read as the latter."""
    saved = entry.get("prediction")
    if saved is None or entry.get("corrections") is not None:
        return entry
    corrections = {"kind": "weight_prediction", **saved,
                   "real_weights": saved["current"] if saved.get("started") else None}
    return {**entry, "prediction": None, "corrections": corrections}


def check_resumable(saved: Sequence[Sequence[Any]], mine: List[Tuple[str, Any]]) -> None:
    """The in-flight gradients resume exactly only with the width and warm-up they were saved with."""
    pick = lambda entries: [tuple(e) for e in entries if e[0] in ("width", "warmup_steps")]  # noqa: E731
    if pick(saved) != pick(mine):
        raise ValueError(f"checkpoint was written with {[tuple(s) for s in saved]}, this pipeline has {mine}: "
                         "width and warmup_steps must match to resume the in-flight gradients exactly")
