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
            f"{t['schedule']}" + (f" ({WARMUP_FRACTION:.0%} warm-up, then cosine, stepped once per update)"
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


def target_words(t: Mapping[str, Any]) -> str:
    target = TARGETS[t["metric"]]
    return (f"mean within {target['mean']:g} point, worst seed within {target['worst']:g} of sync's worst"
            if t["metric"] == "accuracy" else f"mean perplexity within {target['mean']:g}%")


def verdict_table(tasks: Sequence[Mapping[str, Any]], verdicts: Sequence[Mapping[str, Any]]) -> str:
    """Per task and world size: the accurate mode (split_batch, ACCO's rule, a quarter fresh)
    against synchronous training, and the one-line change against plain width 2."""
    rows = []
    for t, v in zip(tasks, verdicts):
        def cell(key: str) -> str:
            row = v["accurate"].get(key)
            if row is None:
                return "-"
            text = vs_sync(t, row["gap"]) + (f" (worst {vs_sync(t, row['worst_gap'])})" if "worst" in TARGETS[t["metric"]]
                                              else "")
            return f"**{text}**" if row["met"] else f"{text} missed"
        one = next(iter(v["one_line"].values()), None)
        one_cell = "-" if one is None else (f"{vs_sync(t, one['gap'])} against {vs_sync(t, shortfall(t, one['against']))}"
                                            + (": not worse" if one["met"] else ": **worse**"))
        rows.append([f"`{t['task']}`", v["ranks"], v["optimizer_class"], "judged" if v["judged"] else "stress",
                     target_words(t), cell("w2-split-int8"), cell("w2-acco-int8"), cell("w2-splitq-int8"), one_cell])
    return table(["task", "ranks", "optimizer", "regime", "target vs sync", "split_batch, int8+EF (vs sync)",
                  "acco, int8+EF", "split_batch, a quarter fresh", "one-line change vs plain width 2 (both vs sync)"],
                 rows)


def rule_line(rule: Mapping[str, Any]) -> str:
    split, acco = rule["w2-split-int8"], rule["w2-acco-int8"]
    alone = ", ".join(rule["acco_alone_meets"]) or "none"
    return (f"On the judged tasks, `split_batch` (one all-reduce per update) met the target in {split['met']} of "
            f"{split['of']} runs (worst score {split['worst_score']:.2f}; at most 1 meets it), ACCO's rule (two) in "
            f"{acco['met']} of {acco['of']} (worst {acco['worst_score']:.2f}); where ACCO's met it and split_batch's "
            f"did not: {alone}.")


def plot(tasks: Sequence[Mapping[str, Any]], path: Path) -> None:
    """One row per task: the metric (mean of seeds) against updates and against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    colors = {None: "tab:red", "weight_prediction": "tab:blue", "adam_prediction": "tab:purple",
              "delay_compensation": "tab:green", "eager": "tab:orange", "split_batch": "tab:brown",
              "acco": "tab:olive", "auto": "tab:cyan"}
    fig, axes = plt.subplots(len(tasks), 2, figsize=(12, 3.6 * len(tasks)), squeeze=False)
    for row, t in zip(axes, tasks):
        acc = t["metric"] == "accuracy"
        for key in dict.fromkeys(r["config"] for r in t["runs"]):
            cfg, runs = CONFIGS[key], [r for r in t["runs"] if r["config"] == key]
            values = np.array([r["value"] for r in runs], dtype=float)
            mean = (100 * values if acc else np.exp(values)).mean(axis=0)
            style = dict(color="k" if cfg.width == 1 else colors[cfg.correction],
                         ls=":" if cfg.fresh != 0.5 else "--" if cfg.compression == "int8" else "-", label=cfg.label)
            row[0].plot(t["updates_per_eval"] * np.arange(1, len(mean) + 1), mean, **style)
            row[1].plot(np.mean([r["time"] for r in runs], axis=0), mean, **style)
        label = "test accuracy, %" if acc else "validation perplexity"
        for ax, x in zip(row, ("update", "training seconds (slowest rank)")):
            ax.set(title=f"{t['task']}, {t.get('ranks', 2)} ranks ({OPTIMIZER_CLASS[t['optimizer']]})", xlabel=x,
                   ylabel=f"{label}, mean of seeds")
            sync = statistics.mean(finals(t, "sync")) if any(r["config"] == "sync" for r in t["runs"]) else None
            if sync is not None:
                ax.set_ylim(*((sync - 15, min(100.5, sync + 5)) if acc else (0.9 * sync, 1.6 * sync)))
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def notes(tasks: Sequence[Mapping[str, Any]]) -> str:
    out = ["- `split_batch` and `acco` take two optimizer calls per update (a look-ahead part, then a fresh part): "
           "their runs split each update's batch with `psgd.halves` and step the schedule once per update, as "
           "docs/options.md says. The one-line change keeps one call per update (`staleness_correction=\"auto\"`, "
           "the loop unchanged).",
           "- More ranks keep each rank's batch (a Horovod user's convention), so the batch per update grows with "
           "them; SGD's rate is scaled by the ranks, AdamW's is not (the study's recipes)."]
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


def document(record: Mapping[str, Any], kept: str) -> str:
    tasks, s = record["tasks"], record["summary"]
    sections = "\n\n".join(f"### `{t['task']}`, {t.get('ranks', 2)} ranks: {t['title']}\n\n{settings(t)}\n\n"
                            f"{results_table(t)}" for t in tasks)
    return f"""# Accuracy: the accurate mode, the one-line change, and what staleness costs

Written by `python -m benchmarks.accuracy` (`make accuracy`): {record['machine']}; commit {record['commit']};
{record['elapsed']:.0f} s of launches. Every per-seed curve and the verdicts are in `docs/accuracy.json`. Per task
and world size, one `horovodrun -np N` launch trains its configurations and seeds side by side (one torch thread
per rank); runs of a seed start from the same weights and see the same samples per update. Metrics: at the real
weights (`opt.real_weights()`; the last after `flush()`), the mean over ranks. "Training s": training steps only,
slowest rank, on 2 cores shared by every rank (docs/benchmarks.md has the speed study).

## Verdicts

Targets against synchronous training (width 1, no codec). The accurate mode is used as docs/options.md says
(`staleness_correction="split_batch"`, each batch through `psgd.halves`, the schedule per update); the one-line
change is `staleness_correction="auto"` with the training loop as it was.

{verdict_table(tasks, s['verdicts'])}

{rule_line(s['rule'])}

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
