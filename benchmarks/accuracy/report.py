"""docs/accuracy.md and docs/img/accuracy.png from the study's record: table writers, a plot and
a short fixed template. The existing page's hand-written blocks (between ``<!-- BEGIN name -->``
and ``<!-- END name -->``: what each correction does, the history of earlier measurements) are kept."""
from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from .optimizers import RAMP_LEFT, nadam_mu
from .summary import OPTIMIZER_CLASS, TARGETS, finals, shortfall, worst
from .tasks import CONFIGS, WARMUP_FRACTION

KEEP = re.compile(r"<!-- BEGIN ([\w-]+) -->.*?<!-- END \1 -->", re.S)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def fmt(task: Mapping[str, Any], value: float) -> str:
    return f"{value:.2f}" if task["metric"] == "accuracy" else f"{value:.3f}"


def vs_sync(task: Mapping[str, Any], gap: float) -> str:
    """A shortfall in the tables' signs: accuracy points gained (negative: worse), or percent of
    perplexity added (positive: worse)."""
    return f"{0.0 - gap:+.2f}" if task["metric"] == "accuracy" else f"{gap:+.2f}%"   # 0.0 - 0.0: no "-0.00"


def results_table(task: Mapping[str, Any]) -> str:
    """Per configuration: the mean and worst seed, both against synchronous, every seed, training
    seconds (mean over seeds, slowest rank), wire bytes per float32 byte, and how far ranks differ."""
    acc = task["metric"] == "accuracy"
    rows = []
    for key in dict.fromkeys(r["config"] for r in task["runs"]):
        runs = [r for r in task["runs"] if r["config"] == key]
        vals = finals(task, key)
        has_sync = any(r["config"] == "sync" for r in task["runs"])
        rows.append([CONFIGS[key].label, fmt(task, statistics.mean(vals)), fmt(task, worst(task, vals)),
                     vs_sync(task, shortfall(task, key)) if has_sync else "",
                     vs_sync(task, shortfall(task, key, of_worst=True)) if has_sync else "",
                     " ".join(fmt(task, v) for v in vals), f"{statistics.mean(r['time'][-1] for r in runs):.1f}",
                     f"{statistics.mean(r['wire_ratio'] for r in runs):.3f}",
                     f"{max(r['spread'][-1] for r in runs) * (100 if acc else 1):.2g}"])
    what = "test accuracy %" if acc else "perplexity"
    unit = "points" if acc else "perplexity %"
    return table(["configuration", f"{what}, mean", "worst seed", f"vs sync ({unit})", "worst vs sync's worst",
                  "per seed", "training s", "wire bytes / fp32", "ranks differ by" + (" (points)" if acc else
                                                                                    " (loss)")], rows)


def settings(task: Mapping[str, Any]) -> str:
    t = task
    opt = (f"SGD momentum {t['momentum']}, lr {t['lr']:g} x {t['ranks']} ranks" if t["optimizer"] == "sgd" else
           f"{OPTIMIZER_CLASS[t['optimizer']]} lr {t['lr']:g}, betas {tuple(t['betas'])}, weight decay "
           f"{t['weight_decay']:g}")
    unit = "test images" if t["metric"] == "accuracy" else "validation bytes"
    text = (f"{t['train_size']:,} training / {t['test_size']:,} {unit}; {t['ranks']} ranks x batch "
            f"{t['batch']}; {t['updates']} updates, evaluated every {t['updates_per_eval']}; {opt}; schedule "
            f"{t['schedule']}" + (f" ({WARMUP_FRACTION:.0%} warm-up, then cosine, over calls)"
                                  if t["schedule"] == "cosine" else ""))
    if t["lr_grid"]:
        grid = ", ".join(f"{g['lr']:g}: {math.exp(g['value']) if t['metric'] == 'val_loss' else 100 * g['value']:.3f}"
                         for g in t["lr_grid"])
        text += f". Rate chosen by synchronous seed 0 over the grid ({grid}): {t['lr']:g}"
        if t["lr"] in (min(g["lr"] for g in t["lr_grid"]), max(g["lr"] for g in t["lr_grid"])):
            text += " (at the grid's edge: the best rate may lie beyond it)"
    elif t["lr_source"] != "task":
        text += f". Rate from {t['lr_source']}"
    return text + "."


def verdict_table(tasks: Sequence[Mapping[str, Any]], verdicts: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for t, v in zip(tasks, verdicts):
        target = TARGETS[t["metric"]]
        words = (f"mean within {target['mean']:g} point, worst seed within {target['worst']:g} of sync's worst"
                 if t["metric"] == "accuracy" else f"mean perplexity within {target['mean']:g}%")
        best = v["candidates"].get(v["best"]) if v["best"] else None
        rows.append([f"`{t['task']}`", v["optimizer_class"], "judged" if v["judged"] else "stress (not judged)", words,
                     f"{CONFIGS[best['config']].label}" if best else "-",
                     vs_sync(t, best["gap"]) if best else "-", vs_sync(t, best["worst_gap"]) if best else "-",
                     ("**yes**" if v["met"] else "no") if best else "-"])
    return table(["task", "optimizer", "regime", "target vs sync", "best width 2 (int8+EF where run)", "vs sync (mean)",
                  "worst seed vs sync's worst", "met"], rows)


def optimizer_table(by_opt: Mapping[str, Mapping[str, Any]]) -> str:
    rows = []
    for cls, e in by_opt.items():
        ranking = "; ".join(f"`{r['correction']}` {r['worst_score']:.2f} ({r['met']}/{len(e['tasks'])})"
                            for r in e["ranked"])
        rows.append([cls, ", ".join(e["tasks"]), f"`{e['best']}`", ", ".join(f"`{c}`" for c in e["meets_all"]) or
                     "none", ranking])
    return table(["optimizer class", "judged tasks", "best", "meets the target on all", "ranking: worst score "
                  "(tasks met)"], rows)


def plot(tasks: Sequence[Mapping[str, Any]], path: Path) -> None:
    """One row per task: the metric (mean of seeds) against updates and against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    colors = {None: "tab:red", "weight_prediction": "tab:blue", "adam_prediction": "tab:purple",
              "delay_compensation": "tab:green", "eager": "tab:orange", "split_batch": "tab:brown"}
    fig, axes = plt.subplots(len(tasks), 2, figsize=(12, 3.6 * len(tasks)), squeeze=False)
    for row, t in zip(axes, tasks):
        acc = t["metric"] == "accuracy"
        for key in dict.fromkeys(r["config"] for r in t["runs"]):
            cfg, runs = CONFIGS[key], [r for r in t["runs"] if r["config"] == key]
            values = np.array([r["value"] for r in runs], dtype=float)
            mean = (100 * values if acc else np.exp(values)).mean(axis=0)
            style = dict(color="k" if cfg.width == 1 else colors[cfg.correction],
                         ls="--" if cfg.compression == "int8" else "-", label=cfg.label)
            row[0].plot(t["updates_per_eval"] * np.arange(1, len(mean) + 1), mean, **style)
            row[1].plot(np.mean([r["time"] for r in runs], axis=0), mean, **style)
        label = "test accuracy, %" if acc else "validation perplexity"
        for ax, x in zip(row, ("update", "training seconds (slowest rank)")):
            ax.set(title=f"{t['task']} ({OPTIMIZER_CLASS[t['optimizer']]})", xlabel=x, ylabel=f"{label}, mean of seeds")
            sync = statistics.mean(finals(t, "sync")) if any(r["config"] == "sync" for r in t["runs"]) else None
            if sync is not None:
                ax.set_ylim(*((sync - 15, min(100.5, sync + 5)) if acc else (0.9 * sync, 1.6 * sync)))
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def notes(tasks: Sequence[Mapping[str, Any]]) -> str:
    out = ["- `split_batch` takes two optimizer calls per update (a look-ahead half, then a real half): its runs "
           "get each update's batch in two halves, and the schedule spans twice the calls."]
    for t in tasks:
        if t["optimizer"] == "nadamw":
            md, b1, n = t["nadam_momentum_decay"], t["betas"][0], t["updates"]
            warm = round(WARMUP_FRACTION * n)
            out.append(f"- NAdam's momentum ramp (`{t['task']}`): PyTorch's NAdam uses mu_t = beta1 (1 - 0.5 * "
                       f"0.96^(momentum_decay t)); at its default 0.004 mu would be {nadam_mu(b1, 0.004, n):.3f} "
                       f"after {n} updates, far from beta1 = {b1:g}, so the run sets momentum_decay {md:.3g}: mu "
                       f"{nadam_mu(b1, md, warm):.3f} when the warm-up ends ({RAMP_LEFT:g} of the ramp left).")
        if t["optimizer"] == "muon":
            out.append(f"- Muon (`{t['task']}`): `torch.optim.Muon` (momentum 0.95, Nesterov, `adjust_lr_fn="
                       "'match_rms_adamw'`, so it takes AdamW's rate and weight decay) for the blocks' 2-D weights, "
                       "the fused QKV projection as one matrix; AdamW for embeddings, head, norms and biases. Two "
                       "`DistributedOptimizer`s in one process, each with its own pipeline; wire bytes summed.")
    return "\n".join(out)


def rule_line() -> str:
    """What ``staleness_correction="auto"`` picks today (pipesgd_hvd/staleness/rule.py), beside the
    ranking above that it was set from."""
    from pipesgd_hvd.staleness.rule import FALLBACK, RULE

    def name(c: Any) -> str:
        return f"`{c}`" if c else "none"

    rows = ", ".join(f"{family}: {name(c)}" for family, c in RULE.items())
    fallbacks = ", ".join(f"{family}: {name(c)}" for family, c in FALLBACK.items())
    return (f"`staleness_correction=\"auto\"` picks, per family of the wrapped optimizer "
            f"(`pipesgd_hvd/staleness/rule.py`): {rows}; where that correction cannot run with the other "
            f"settings (`width`/`compression=\"auto\"`, `split_batch` at width >= 3, a GradScaler): {fallbacks}.")


def document(record: Mapping[str, Any], kept: str) -> str:
    tasks, s = record["tasks"], record["summary"]
    sections = "\n\n".join(f"### `{t['task']}`: {t['title']}\n\n{settings(t)}\n\n{results_table(t)}" for t in tasks)
    return f"""# Accuracy: staleness, its corrections, and int8 with error feedback

Written by `python -m benchmarks.accuracy` (`make accuracy`): {record['machine']}, commit {record['commit']},
{record['elapsed']:.0f} s; every per-seed curve, the verdicts and the per-optimizer summary are in
`docs/accuracy.json`. Per task, one `horovodrun -np 2` launch trains its configurations and seeds side by side
(one torch thread per rank); runs of a seed start from the same weights and see the same samples per update.
Metrics: at the real weights (`opt.real_weights()`; the last after `flush()`), the mean over ranks. "Training s":
training steps only, slowest rank (docs/benchmarks.md has the speed study). The language models run every
correction with and without int8+EF, the SGD tasks each correction with int8+EF, the NAdamW and Muon recipes
plain width 2 and `split_batch` without a codec (`--configs` chooses others).

## Verdicts: the best width-2 configuration against synchronous training

{verdict_table(tasks, s['verdicts'])}

## Which correction per optimizer class

Score: the shortfall against synchronous training in units of the task's target (the larger of the mean's and
the worst seed's; at most 1 meets it), ranked by the worst over the class's judged tasks; `none`: plain width 2.

{optimizer_table(s['by_optimizer'])}

{rule_line()}

## Results

![the metric against updates and training seconds, per task](img/accuracy.png)

{sections}

{notes(tasks)}

{kept}
"""


def write(record: Mapping[str, Any], doc: Path, image: Path) -> None:
    old = doc.read_text() if doc.exists() else ""
    kept = "\n\n".join(m.group(0) for m in KEEP.finditer(old))
    plot(record["tasks"], image)
    doc.write_text(document(record, kept).rstrip() + "\n")
