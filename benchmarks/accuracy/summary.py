"""The study's numbers from its record: final metrics per seed, shortfalls against synchronous
training, each task's verdict against issue 30's targets and, per optimizer class, the ranking
of the width-2 configurations with int8+EF. The record keeps all of it, so a rule that picks a
correction per optimizer class (``staleness_correction="auto"``) can be checked against it::

    for cls, entry in record["by_optimizer"].items():
        assert rule(cls) in entry["meets_all"] or rule(cls) == entry["best"]
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Mapping, Optional

from .tasks import CONFIGS

#: Issue 30's targets for width 2 with int8+EF against synchronous uncompressed training:
#: language models, the mean of seeds' validation perplexity within 1%; classification, the mean
#: test accuracy within 0.5 point and no seed more than 2 points below synchronous training's worst.
TARGETS = {"val_loss": {"mean": 1.0}, "accuracy": {"mean": 0.5, "worst": 2.0}}
#: The torch.optim class each recipe wraps (the one a per-class rule sees; Muon's run also wraps
#: an AdamW for the non-matrix parameters).
OPTIMIZER_CLASS = {"sgd": "SGD", "adamw": "AdamW", "nadamw": "NAdam", "muon": "Muon"}


def finals(task: Mapping[str, Any], key: str) -> List[float]:
    """Per seed, the final metric as the doc shows it: test accuracy in %, or perplexity."""
    values = [r["value"][-1] for r in task["runs"] if r["config"] == key]
    if task["metric"] == "accuracy":
        return [100 * v for v in values]
    return [math.exp(v) if math.isfinite(v) else math.inf for v in values]


def worst(task: Mapping[str, Any], values: List[float]) -> float:
    return min(values) if task["metric"] == "accuracy" else max(values)


def shortfall(task: Mapping[str, Any], key: str, of_worst: bool = False) -> float:
    """How far ``key`` falls behind synchronous uncompressed training (positive: worse), by the
    mean of seeds or (``of_worst``) worst seed against worst seed: accuracy points below, or
    percent of perplexity above."""
    pick = (lambda v: worst(task, v)) if of_worst else statistics.mean
    mine, sync = pick(finals(task, key)), pick(finals(task, "sync"))
    if task["metric"] == "accuracy":
        return sync - mine
    return 100 * (mine / sync - 1) if math.isfinite(mine) else math.inf


def score(task: Mapping[str, Any], key: str) -> float:
    """The shortfall in units of the target (the larger of the mean's and the worst seed's):
    at most 1 meets it."""
    target = TARGETS[task["metric"]]
    s = shortfall(task, key) / target["mean"]
    return max(s, shortfall(task, key, of_worst=True) / target["worst"]) if "worst" in target else s


def candidates(task: Mapping[str, Any]) -> List[str]:
    """The task's width-2 configurations with int8+EF, in the order they ran; where it ran none
    (the recipes), its uncompressed ones; none without a synchronous run to compare with."""
    keys = [k for k in dict.fromkeys(r["config"] for r in task["runs"]) if CONFIGS[k].width == 2]
    if not any(r["config"] == "sync" for r in task["runs"]):
        return []
    return [k for k in keys if CONFIGS[k].compression == "int8"] or keys


def correction_name(key: str) -> str:
    return CONFIGS[key].correction or "none"


def verdict(task: Mapping[str, Any]) -> Dict[str, Any]:
    """The best width-2 configuration with int8+EF on one task, and whether it meets the target."""
    rows = {correction_name(k): {"config": k, "gap": shortfall(task, k), "worst_gap": shortfall(task, k, True),
                                 "score": score(task, k)} for k in candidates(task)}
    for row in rows.values():
        row["met"] = row["score"] <= 1.0
    best: Optional[str] = min(rows, key=lambda c: rows[c]["score"]) if rows else None
    return {"task": task["task"], "optimizer_class": OPTIMIZER_CLASS[task["optimizer"]], "metric": task["metric"],
            "judged": task["judged"], "candidates": rows, "best": best,
            "met": bool(best is not None and rows[best]["met"])}


def by_optimizer(verdicts: List[Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per optimizer class, over its judged tasks: each correction (with int8+EF; "none" is plain
    width 2) measured on all of them, ranked by its worst score over them, then its mean score."""
    out: Dict[str, Dict[str, Any]] = {}
    for cls in dict.fromkeys(v["optimizer_class"] for v in verdicts if v["judged"]):
        mine = [v for v in verdicts if v["judged"] and v["optimizer_class"] == cls]
        names = [c for c in mine[0]["candidates"] if all(c in v["candidates"] for v in mine)]
        ranked = [{"correction": c, "worst_score": max(v["candidates"][c]["score"] for v in mine),
                   "mean_score": statistics.mean(v["candidates"][c]["score"] for v in mine),
                   "met": sum(v["candidates"][c]["met"] for v in mine),
                   "per_task": {v["task"]: v["candidates"][c]["score"] for v in mine}} for c in names]
        ranked.sort(key=lambda r: (r["worst_score"], r["mean_score"]))
        out[cls] = {"tasks": [v["task"] for v in mine], "ranked": ranked,
                    "best": ranked[0]["correction"] if ranked else None,
                    "meets_all": [r["correction"] for r in ranked if r["met"] == len(mine)]}
    return out


def summarise(tasks: List[Mapping[str, Any]]) -> Dict[str, Any]:
    verdicts = [verdict(t) for t in tasks]
    return {"targets": TARGETS, "verdicts": verdicts, "by_optimizer": by_optimizer(verdicts)}
