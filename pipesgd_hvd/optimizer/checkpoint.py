"""The pipeline's checkpoint entry: one versioned format for every framework.

PyTorch's ``optimizer.state_dict()["pipesgd"]`` and Keras's ``optimizer.pipeline_state_dict()``
are this dict (the wrapped optimizer's own state sits beside it, in the framework's format)::

    {"format": 2,
     "step": steps ended,            "settings": [(name, value), ...] (must match to resume),
     "in_flight": [{"step": s, "meta": loss scale or None, "grads": {tensor name: averaged gradient}}],
                                      oldest first: reduced already (the same bytes on every rank)
     "codec": {"residuals": {key: tensor}} (error feedback; per rank),
     "stats": {"steps", "bytes_sent", "fp32_bytes"},
     "auto": the auto mode's state, or None,
     "prediction": weight prediction's state (real and previous weights by name), or None,
     "corrections": delay compensation's or eager mixing's per-step state (per rank), or None:
                    {"kind", "flags": [bool per slot], "slots": [{tensor name: tensor}]}}

Format 1 (before 2026-12) kept the auto and prediction parts in two more keys of PyTorch's state
dict, ``"pipesgd_auto"`` and ``"pipesgd_prediction"``; :func:`read` takes both.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

FORMAT = 2
KEY = "pipesgd"                                      # the entry in PyTorch's optimizer state dict
_FORMAT1_EXTRAS = {"auto": "pipesgd_auto", "prediction": "pipesgd_prediction"}


def compose(engine_state: Dict[str, Any], auto: Optional[Dict[str, Any]] = None,
            prediction: Optional[Dict[str, Any]] = None,
            corrections: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The entry, from the engine's (or TensorFlow pipeline's) state and the optional parts.
    ("corrections" is new in format 2's later versions; an entry without it reads as None.)"""
    return {"format": FORMAT, **engine_state, "auto": auto, "prediction": prediction, "corrections": corrections}


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
    return entry, rest


def check_resumable(saved: Sequence[Sequence[Any]], mine: List[Tuple[str, Any]]) -> None:
    """The in-flight gradients resume exactly only with the width and warm-up they were saved with."""
    pick = lambda entries: [tuple(e) for e in entries if e[0] in ("width", "warmup_steps")]  # noqa: E731
    if pick(saved) != pick(mine):
        raise ValueError(f"checkpoint was written with {[tuple(s) for s in saved]}, this pipeline has {mine}: "
                         "width and warmup_steps must match to resume the in-flight gradients exactly")
