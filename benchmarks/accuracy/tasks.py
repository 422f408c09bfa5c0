"""The study's tasks and configurations (what runs), and the learning-rate schedule over calls.

A configuration is how the optimizer is wrapped (width, staleness correction, codec); a task is
the data, the model and the optimizer recipe. ``split_batch`` takes two calls per update (a
look-ahead half, then a real half), so its runs get half the batch per call and twice the calls:
each update sees the synchronous run's samples, and the schedule is defined over calls.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

#: staleness_correction name -> short form in configuration keys.
CORRECTIONS = {"weight_prediction": "wp", "adam_prediction": "adam", "delay_compensation": "dc", "eager": "eager",
               "split_batch": "split"}
SGD_CORRECTIONS = ("weight_prediction", "delay_compensation", "eager", "split_batch")  # adam_prediction: Adam only


@dataclass(frozen=True)
class Config:
    key: str
    width: int
    correction: Optional[str]   # None or a staleness_correction name
    compression: str            # "none" or "int8" (psgd.Compression.int8: 8-bit codes, error feedback)

    @property
    def calls_per_update(self) -> int:
        return 2 if self.correction == "split_batch" else 1

    @property
    def label(self) -> str:
        base = "sync (width 1)" if self.width == 1 else "width 2" + (f" + {self.correction}" if self.correction else "")
        return base + (", int8+EF" if self.compression == "int8" else "")


def _config(width: int, correction: Optional[str], compression: str) -> Config:
    key = ("sync" if width == 1 else "w2" + (f"-{CORRECTIONS[correction]}" if correction else "")) \
        + ("-int8" if compression == "int8" else "")
    return Config(key, width, correction, compression)


_SHAPES = [(1, None), (2, None), *((2, c) for c in CORRECTIONS)]   # (width, correction)
CONFIGS = {c.key: c for c in (_config(w, corr, codec) for w, corr in _SHAPES for codec in ("none", "int8"))}
LM_CONFIGS = tuple(CONFIGS)   # sync, width 2, every correction; each with and without int8+EF
# The standard LM runs every configuration too: 14 x 3 seeds, trained side by side, about 0.05 s per
# update and run on 2 cores (2026-12-07: the language models took 1.9 h beside other jobs).
STANDARD_CONFIGS = LM_CONFIGS
SGD_CONFIGS = ("sync", "w2", *(f"w2-{CORRECTIONS[c]}-int8" for c in SGD_CORRECTIONS))
# The recipes: does the optimizer tolerate the plain delay, and does split_batch still help it (the
# rule of staleness_correction="auto" for optimizers that are neither SGD nor Adam's kin)
RECIPE_CONFIGS = ("sync", "w2", "w2-split")


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
    """The rate's factor at ``call`` (0-based) of ``total`` optimizer calls: 1 for "constant";
    "cosine": linear warm-up over WARMUP_FRACTION of the calls, then a half cosine reaching 0 one
    call after the last. Over calls, so a split_batch run (twice the calls) has the same curve."""
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
