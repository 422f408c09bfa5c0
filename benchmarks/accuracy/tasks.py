"""The study's tasks and configurations (what runs), and the learning-rate schedule over updates.

A configuration is how the optimizer is wrapped (width, staleness correction, codec); a task is
the data, the model and the optimizer recipe. ``split_batch`` and ``acco`` take two calls per
update (a look-ahead part, then a fresh part), used as docs/options.md says: each batch split by
``psgd.halves``, the schedule stepped once per update, so each update sees the synchronous run's
samples at its rate. ``auto`` is the one-line change: ``staleness_correction="auto"`` with the
loop unchanged (one call per update).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

#: staleness_correction name -> short form in configuration keys.
CORRECTIONS = {"weight_prediction": "wp", "adam_prediction": "adam", "delay_compensation": "dc", "eager": "eager",
               "split_batch": "split", "acco": "acco", "auto": "auto"}
#: The modes that make one update of two calls.
TWO_CALLS = ("split_batch", "acco")


@dataclass(frozen=True)
class Config:
    key: str
    width: int
    correction: Optional[str]   # None or a staleness_correction name ("auto": the one-line change)
    compression: str            # "none" or "int8" (psgd.Compression.int8: 8-bit codes, error feedback)
    fresh: float = 0.5          # split_batch's fresh_fraction

    @property
    def calls_per_update(self) -> int:
        return 2 if self.correction in TWO_CALLS else 1

    @property
    def label(self) -> str:
        if self.width == 1:
            base = "sync (width 1)"
        elif self.correction == "auto":
            base = "width 2 + 'auto', loop unchanged (the one-line change)"
        elif self.correction == "split_batch":
            base = "width 2 + split_batch" + (f" (fresh {self.fresh:g})" if self.fresh != 0.5 else "")
        else:
            base = "width 2" + (f" + {self.correction}" if self.correction else "")
        return base + (", int8+EF" if self.compression == "int8" else "")


def _config(width: int, correction: Optional[str], compression: str, fresh: float = 0.5) -> Config:
    key = ("sync" if width == 1 else "w2" + (f"-{CORRECTIONS[correction]}" if correction else "")) \
        + ("q" if fresh == 0.25 else "") + ("-int8" if compression == "int8" else "")
    return Config(key, width, correction, compression, fresh)


_SHAPES = [(1, None, 0.5), (2, None, 0.5), *((2, c, 0.5) for c in CORRECTIONS), (2, "split_batch", 0.25)]
CONFIGS = {c.key: c for c in (_config(w, corr, codec, f) for w, corr, f in _SHAPES for codec in ("none", "int8"))}
# What issue 39 asks of the accurate mode, int8+EF throughout: synchronous, plain width 2, the
# one-line change, split_batch (one all-reduce per update) against ACCO's rule (two), and a quarter
# of the batch fresh instead of half. The other corrections' rows are in the record of commit
# 98bf675 (docs/accuracy.md there).
LM_CONFIGS = ("sync", "w2-int8", "w2-auto-int8", "w2-split-int8", "w2-acco-int8", "w2-splitq-int8")
STANDARD_CONFIGS = LM_CONFIGS
SGD_CONFIGS = ("sync", "w2-int8", "w2-auto-int8", "w2-split-int8", "w2-acco-int8")
RECIPE_CONFIGS = ("sync", "w2", "w2-auto", "w2-split")


@dataclass(frozen=True)
class Task:
    name: str
    problem: str            # "digits", "shapes", "pydoc" or "stdlib" (data and model: problems.py)
    title: str
    optimizer: str          # "sgd", "adamw", "nadamw", "muon" (optimizers.py)
    updates_per_eval: int   # 0: one pass over the rank's shard (classification epochs)
    evals: int
    batch: int              # samples (windows) per rank and update
    lr: float               # SGD: per rank, times the ranks (Horovod's convention); others: as is
    seeds: int = 3
    configs: Tuple[str, ...] = SGD_CONFIGS
    momentum: float = 0.9                   # SGD
    betas: Tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    schedule: str = "constant"              # or "cosine": linear warm-up, then cosine decay
    lr_grid: Tuple[float, ...] = ()         # synchronous, seed 0, best final metric wins (unless lr_from)
    lr_from: Optional[str] = None           # take the rate another task of the same run chose
    judged: bool = True                     # counts toward the verdicts and the per-optimizer summary
    model: Dict[str, int] = field(default_factory=dict)  # the transformer's size


# batch 4 windows per rank (8 per update) and 3 evaluations
STANDARD = dict(problem="stdlib", updates_per_eval=500, evals=3, batch=4, lr=1e-3, betas=(0.9, 0.95),
                weight_decay=0.1, schedule="cosine", model=dict(dim=128, layers=4, heads=4))
TASKS: Dict[str, Task] = {t.name: t for t in (
    Task("digits", "digits", "sklearn digits, MLP 64-128-10", "sgd", 0, 30, 32, 0.05, seeds=5),
    Task("digits-lr0.075", "digits", "sklearn digits, MLP 64-128-10, higher rate", "sgd", 0, 30, 32, 0.075, seeds=5),
    Task("shapes-lr0.01", "shapes", "generated 16x16 shapes, CNN, lower rate", "sgd", 0, 24, 32, 0.01, seeds=5),
    Task("shapes", "shapes", "generated 16x16 shapes, CNN", "sgd", 0, 24, 32, 0.02, seeds=5),
    Task("stdlib-lm", title="standard: stdlib source, byte-level transformer 4x128, AdamW", optimizer="adamw",
         configs=STANDARD_CONFIGS, lr_grid=(5e-4, 1e-3, 2e-3, 4e-3), **STANDARD),
    Task("stdlib-nadamw", title="standard, NAdamW recipe (betas 0.99, 0.999)", optimizer="nadamw",
         configs=RECIPE_CONFIGS, seeds=2, lr_from="stdlib-lm", **{**STANDARD, "betas": (0.99, 0.999)}),
    Task("stdlib-muon", title="standard, Muon recipe (hidden matrices; AdamW for the rest)", optimizer="muon",
         configs=RECIPE_CONFIGS, seeds=2, lr_from="stdlib-lm", **STANDARD),
    Task("pydoc-lm", "pydoc", "stress: pydoc text, byte-level transformer 2x64, AdamW lr 1e-2, no warm-up", "adamw",
         50, 8, 16, 1e-2, configs=LM_CONFIGS, weight_decay=0.01, judged=False, model=dict(dim=64, layers=2, heads=4)),
)}

#: Fraction of the calls spent in the linear warm-up of the "cosine" schedule.
WARMUP_FRACTION = 0.1


def lr_factor(schedule: str, call: int, total: int) -> float:
    """The rate's factor at update ``call`` (0-based) of ``total`` updates: 1 for "constant";
    "cosine": linear warm-up over WARMUP_FRACTION of the updates, then a half cosine reaching 0
    one update after the last. Stepped once per update, in every configuration."""
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"unknown schedule {schedule!r}: use 'constant' or 'cosine'")
    warmup = max(1, round(WARMUP_FRACTION * total))
    if call < warmup:
        return (call + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (call - warmup) / max(1, total - warmup)))


def configs_for(task: Task, keys: Optional[Sequence[str]]) -> Tuple[str, ...]:
    """The task's configurations, or ``keys`` less those its optimizer refuses
    (``adam_prediction`` needs Adam/AdamW; NAdam and Muon are neither)."""
    if keys is None:
        return task.configs
    return tuple(k for k in keys if task.optimizer == "adamw" or CONFIGS[k].correction != "adam_prediction")
