"""Accuracy study: synchronous vs width 2 vs width 2 + staleness correction, with and without int8+EF.

Run ``.venv/bin/python -m benchmarks.accuracy`` (or ``make accuracy``) from the repository root.
The parent launches itself (``--worker``) once per task under
``horovodrun -np 2 -H localhost:2 --mpi``; each launch trains every configuration and seed side by
side (epoch by epoch, each its own model and optimizer on the same data order), times each run's
training steps on its own, and evaluates on the test set at the real weights
(``opt.real_weights()``) after every epoch. Rank 0 prints one JSON line (marker below); the parent
measures what the correction costs per step in-process, then writes ``docs/accuracy.md`` and
``docs/img/accuracy.png``.

Tasks:

* ``digits``: sklearn's 8x8 handwritten digits (1,797 images, shipped with scikit-learn), an MLP.
* ``shapes``: 16x16 images of 8 shape classes (bars, outlines, filled shapes, crosses) at random
  positions, sizes and intensities under Gaussian noise, generated from a fixed seed, and a small
  CNN. Generated rather than digits upsampled: upsampled digits carry no more information than
  task 1 and a CNN would only re-learn it, while shapes at random positions need translation-
  invariant features (what convolutions are for), and size and noise set the difficulty.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "accuracy.md"
PLOT = ROOT / "docs" / "img" / "accuracy.png"
MARKER = "ACCURACY_JSON "
TARGET_POINTS = 0.5  # issue 8: width 2 + correction + int8+EF within 0.5 point of synchronous


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    width: int
    correction: bool
    compression: str
    warmup_epochs: int = 0   # synchronous epochs first (warmup_steps), then width 2
    momentum_scale: float = 1.0  # times the task's momentum (a momentum correction for the delay)


CONFIGS = (
    Config("sync", "sync (width 1)", 1, False, "none"),
    Config("sync-int8", "sync, int8+EF", 1, False, "int8"),
    Config("w2", "width 2", 2, False, "none"),
    Config("w2-int8", "width 2, int8+EF", 2, False, "int8"),
    Config("w2-pred", "width 2 + correction", 2, True, "none"),
    Config("w2-pred-int8", "width 2 + correction, int8+EF", 2, True, "int8"),
    Config("w2-pred-int8-warm", "width 2 + correction, int8+EF, first epoch synchronous", 2, True, "int8", 1),
    Config("w2-pred-int8-m08", "width 2 + correction, int8+EF, momentum x 0.8", 2, True, "int8", 0, 0.8),
)
BY_KEY = {c.key: c for c in CONFIGS}


@dataclass(frozen=True)
class Task:
    name: str
    data: str         # "digits" or "shapes": the data set and its model
    title: str
    epochs: int
    batch: int        # per rank
    lr: float         # per rank, scaled by the number of ranks (Horovod's convention)
    momentum: float


# Learning rates where staleness costs accuracy (trials with --lr); each task at two, to show the
# gap growing with the step size.
TASKS = {
    "digits": Task("digits", "digits", "sklearn digits, MLP 64-128-10", epochs=30, batch=32, lr=0.05, momentum=0.9),
    "digits-lr0.075": Task("digits-lr0.075", "digits", "sklearn digits, MLP 64-128-10, higher learning rate",
                           epochs=30, batch=32, lr=0.075, momentum=0.9),
    "shapes-lr0.01": Task("shapes-lr0.01", "shapes", "generated 16x16 shapes (8 classes), CNN, lower learning rate",
                          epochs=24, batch=32, lr=0.01, momentum=0.9),
    "shapes": Task("shapes", "shapes", "generated 16x16 shapes (8 classes), CNN", epochs=24, batch=32, lr=0.02,
                   momentum=0.9),
}
SHAPE_CLASSES = ("horizontal bar", "vertical bar", "square outline", "filled square", "ring", "filled disk",
                 "plus", "diagonal cross")


# ------------------------------------------------------------------------------ data and models

def digits_data() -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    return tuple(train_test_split(x, digits.target, test_size=0.25, random_state=0, stratify=digits.target))


def shapes_data(n_train: int = 3000, n_test: int = 1000, size: int = 16, noise: float = 0.2,
                seed: int = 1234) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Balanced classes; each image one shape of SHAPE_CLASSES, centre, half-size (2-5 pixels),
    stroke intensity (0.4-1.0) drawn at random, plus N(0, noise^2) pixel noise."""
    rng = np.random.default_rng(seed)
    n = n_train + n_test
    labels = np.arange(n) % len(SHAPE_CLASSES)
    rng.shuffle(labels)
    yy, xx = np.mgrid[0:size, 0:size].astype("float32")
    images = np.empty((n, 1, size, size), dtype="float32")
    for i, label in enumerate(labels):
        r = rng.uniform(2.0, 5.0)
        cy, cx = rng.uniform(r, size - 1 - r, size=2)
        dy, dx = yy - cy, xx - cx
        box = np.maximum(np.abs(dy), np.abs(dx))
        dist = np.hypot(dy, dx)
        mask = {
            0: (np.abs(dy) <= 0.6) & (np.abs(dx) <= r),
            1: (np.abs(dx) <= 0.6) & (np.abs(dy) <= r),
            2: np.abs(box - r) <= 0.5,
            3: box <= r,
            4: np.abs(dist - r) <= 0.6,
            5: dist <= r,
            6: ((np.abs(dy) <= 0.6) | (np.abs(dx) <= 0.6)) & (box <= r),
            7: ((np.abs(dy - dx) <= 0.8) | (np.abs(dy + dx) <= 0.8)) & (box <= r),
        }[int(label)]
        images[i, 0] = mask * rng.uniform(0.4, 1.0) + rng.normal(0.0, noise, (size, size))
    return images[:n_train], images[n_train:], labels[:n_train], labels[n_train:]


def make_model(task: str, seed: int):
    import torch

    torch.manual_seed(seed)
    nn = torch.nn
    if task == "digits":
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, len(SHAPE_CLASSES)))


def load(task: str):
    x_train, x_test, y_train, y_test = digits_data() if task == "digits" else shapes_data()
    return x_train, x_test, y_train, y_test


# ------------------------------------------------------------------------------------ rank side

def _worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import pipesgd_hvd.torch as psgd

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    task = TASKS[args.task]
    lr = args.lr if args.lr is not None else task.lr
    momentum = args.momentum if args.momentum is not None else task.momentum
    epochs = args.epochs or task.epochs
    x_train, x_test, y_train, y_test = (torch.from_numpy(np.asarray(a)) for a in load(task.data))
    y_train, y_test = y_train.long(), y_test.long()
    x_train, y_train = x_train[rank::size], y_train[rank::size]  # each rank its own shard
    steps = len(x_train) // task.batch

    runs: List[Dict[str, Any]] = []
    for seed in range(args.seeds):
        for key in args.configs:
            cfg = BY_KEY[key]
            model = make_model(task.data, seed)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            inner = torch.optim.SGD(model.parameters(), lr=lr * size, momentum=momentum * cfg.momentum_scale)
            # Names unique per run: the runs share one process, and Horovod refuses two in-flight
            # collectives of one name (pipesgd names them after the parameters).
            named = [(f"{key}.{seed}.{n}", p) for n, p in model.named_parameters()]
            opt = psgd.DistributedOptimizer(inner, named_parameters=named, width=cfg.width,
                                            compression=cfg.compression, staleness_correction=cfg.correction,
                                            warmup_steps=cfg.warmup_epochs * steps)
            runs.append({"config": key, "seed": seed, "model": model, "opt": opt, "seconds": 0.0,
                         "accuracy": [], "time": [], "loss": []})

    for epoch in range(epochs):
        for run in runs:
            # the same data order for every configuration of a seed, a different one per seed and rank
            order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(
                10_000 * run["seed"] + 100 * epoch + rank))
            model, opt = run["model"], run["opt"]
            model.train()
            total = 0.0
            start = time.perf_counter()
            for s in range(steps):
                batch = order[s * task.batch:(s + 1) * task.batch]
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
                loss.backward()
                opt.step()
                total += float(loss.detach())
            if epoch == epochs - 1:
                opt.flush()  # apply the gradient still in flight
            run["seconds"] += time.perf_counter() - start
            model.eval()
            with opt.real_weights(), torch.no_grad():
                correct = (model(x_test).argmax(dim=1) == y_test).double().mean()
            run["accuracy"].append(float(correct))  # replicas are identical: the same on every rank
            run["time"].append(run["seconds"])
            run["loss"].append(total / steps)
            if not math.isfinite(run["loss"][-1]) and rank == 0:
                print(f"diverged: {run['config']} seed {run['seed']} epoch {epoch}", file=sys.stderr, flush=True)
        if rank == 0:
            print(f"{task.name} epoch {epoch + 1}/{epochs}", file=sys.stderr, flush=True)

    # Wall time: the slowest rank's, per epoch (training steps only, evaluation excluded).
    times = hvd.allgather_object([run["time"] for run in runs], name="accuracy.times")
    out = []
    for i, run in enumerate(runs):
        slowest = [max(t[i][e] for t in times) for e in range(epochs)]
        out.append({"config": run["config"], "seed": run["seed"], "accuracy": run["accuracy"], "time": slowest,
                    "loss": run["loss"], "wire_ratio": run["opt"].stats.ratio})
    if rank == 0:
        print(MARKER + json.dumps({"task": task.name, "lr": lr, "momentum": momentum, "epochs": epochs,
                                   "batch": task.batch, "ranks": size, "steps_per_epoch": steps,
                                   "train_size": len(x_train) * size, "test_size": len(x_test), "runs": out}),
              flush=True)


# ---------------------------------------------------------------------------------- parent side

def _launch(task: str, args: argparse.Namespace) -> Dict[str, Any]:
    bindir = Path(sys.executable).parent  # the venv's bin, without resolving its python symlink
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    cmd = [str(bindir / "horovodrun"), "-np", "2", "-H", "localhost:2", "--mpi",
           str(bindir / "python"), "-m", "benchmarks.accuracy", "--worker", "--task", task,
           "--seeds", str(args.seeds), "--configs", *args.configs]
    for flag, value in (("--epochs", args.epochs), ("--lr", args.lr), ("--momentum", args.momentum)):
        if value is not None:
            cmd += [flag, str(value)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    print(f"  {task}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    for line in re.sub(r"\[\d+(,\d+)?\]<std(out|err)>:", "", proc.stdout).splitlines():
        if MARKER in line:
            return json.loads(line.split(MARKER, 1)[1])
    raise RuntimeError(f"no result from {' '.join(cmd)} (rc {proc.returncode}):\n"
                       f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def correction_cost(task: str, steps: int = 300, rounds: int = 5) -> Dict[str, float]:
    """Per-step time of width 2 with and without the correction on one in-process rank (no
    communication to hide anything), interleaved in rounds; and the restore + predict pair alone."""
    import torch

    import pipesgd_hvd.torch as psgd
    from pipesgd_hvd.comm.local import LocalWorld
    from pipesgd_hvd.frameworks.torch_ops import TORCH_OPS

    torch.set_num_threads(1)
    x_train, _, y_train, _ = load(task)
    x, y = torch.from_numpy(np.asarray(x_train[:32])), torch.from_numpy(np.asarray(y_train[:32])).long()
    setups = {}
    for correction in (False, True):
        model = make_model(task, 0)
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                        named_parameters=model.named_parameters(), width=2,
                                        communicator=LocalWorld(1, TORCH_OPS).communicator(0),
                                        staleness_correction=correction)
        setups[correction] = (model, opt)

    def run(correction: bool, n: int) -> float:
        model, opt = setups[correction]
        start = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return (time.perf_counter() - start) / n

    run(False, 20), run(True, 20)
    plain, corrected = [], []
    for _ in range(rounds):
        plain.append(run(False, steps))
        corrected.append(run(True, steps))
    model, opt = setups[True]
    pair = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            opt._restore_real_weights()
            opt._predict_weights()
        pair.append((time.perf_counter() - start) / steps)
    for correction in (False, True):
        setups[correction][1].flush()
    params = sum(p.numel() for p in model.parameters())
    return {"step_ms": 1e3 * statistics.median(plain), "step_corrected_ms": 1e3 * statistics.median(corrected),
            "pair_ms": 1e3 * statistics.median(pair), "params": params, "extra_bytes": 2 * 4 * params}


def _final(result: Dict[str, Any], key: str) -> List[float]:
    return [100 * r["accuracy"][-1] for r in result["runs"] if r["config"] == key]


def _mean_std(xs: Sequence[float]) -> Tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _curves(result: Dict[str, Any], key: str, field: str) -> np.ndarray:
    return np.array([r[field] for r in result["runs"] if r["config"] == key])


def _plot(results: Sequence[Dict[str, Any]], configs: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(11, 4 * len(results)), squeeze=False)
    styles = {"sync": ("k", "-"), "sync-int8": ("k", "--"), "w2": ("tab:red", "-"), "w2-int8": ("tab:red", "--"),
              "w2-pred": ("tab:blue", "-"), "w2-pred-int8": ("tab:blue", "--"),
              "w2-pred-int8-warm": ("tab:green", ":"), "w2-pred-int8-m08": ("tab:purple", "-.")}
    for row, result in zip(axes, results):
        for key in configs:
            acc = 100 * _curves(result, key, "accuracy")
            secs = _curves(result, key, "time")
            mean, std = acc.mean(axis=0), acc.std(axis=0)
            color, ls = styles[key]
            epochs = np.arange(1, acc.shape[1] + 1)
            row[0].plot(epochs, mean, color=color, ls=ls, label=BY_KEY[key].label)
            row[0].fill_between(epochs, mean - std, mean + std, color=color, alpha=0.12)
            row[1].plot(secs.mean(axis=0), mean, color=color, ls=ls, label=BY_KEY[key].label)
        title = f"{result['task']} (lr {result['lr'] * result['ranks']:g}, momentum {result['momentum']})"
        row[0].set(title=f"{title}: vs epoch", xlabel="epoch", ylabel="test accuracy, % (mean of seeds)")
        row[1].set(title=f"{title}: vs wall time", xlabel="training seconds (slowest rank)",
                   ylabel="test accuracy, % (mean of seeds)")
        lo = min(100 * _curves(result, k, "accuracy")[:, -1].min() for k in configs)
        for ax in row:
            ax.set_ylim(max(0.0, lo - 10), 100.5)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--task", choices=sorted(TASKS), help=argparse.SUPPRESS)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=sorted(TASKS))
    parser.add_argument("--configs", nargs="+", default=[c.key for c in CONFIGS], choices=list(BY_KEY))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, help="override each task's epochs (trials)")
    parser.add_argument("--lr", type=float, help="override each task's learning rate (trials)")
    parser.add_argument("--momentum", type=float, help="override each task's momentum (trials)")
    parser.add_argument("--no-doc", action="store_true", help="print the table, leave docs/ alone (trials)")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    from benchmarks.report import machine_line, table

    start = time.perf_counter()
    results = [_launch(task, args) for task in args.tasks]
    cost = correction_cost("digits")
    elapsed = time.perf_counter() - start
    sections, verdicts = [], []
    for result in results:
        task = TASKS[result["task"]]
        image = 100 / result["test_size"]
        sync_mean, _ = _mean_std(_final(result, "sync"))
        rows = []
        for key in args.configs:
            accs = _final(result, key)
            mean, std = _mean_std(accs)
            secs = statistics.mean(r["time"][-1] for r in result["runs"] if r["config"] == key)
            wire = statistics.mean(r["wire_ratio"] for r in result["runs"] if r["config"] == key)
            rows.append([BY_KEY[key].label, f"{mean:.2f} ± {std:.2f}", f"{mean - sync_mean:+.2f}",
                         " ".join(f"{a:.2f}" for a in accs), f"{secs:.1f}", f"{wire:.3f}"])
        header = [f"{task.name}: configuration", "test accuracy % (mean ± std)", "vs sync (points)",
                  "per seed", "training s", "wire bytes / float32"]
        settings = (f"{result['train_size']} training / {result['test_size']} test images, {result['ranks']} ranks, "
                    f"batch {result['batch']} per rank ({result['steps_per_epoch']} steps per epoch), "
                    f"{result['epochs']} epochs, SGD lr {result['lr']} x {result['ranks']} ranks = "
                    f"{result['lr'] * result['ranks']:g}, momentum {result['momentum']}; one test image is "
                    f"{image:.2f} points")
        sections.append(f"### `{task.name}`: {task.title}\n\n{settings}.\n\n{table(header, rows)}")
        if "w2-pred-int8" in args.configs and "sync" in args.configs:
            gap = _mean_std(_final(result, "w2-pred-int8"))[0] - sync_mean
            plain_gap = _mean_std(_final(result, "w2"))[0] - sync_mean if "w2" in args.configs else float("nan")
            verdicts.append((task.name, gap, plain_gap))
    if args.no_doc:
        print("\n\n".join(sections))
        print(verdicts, cost)
        return
    _plot(results, args.configs, PLOT)
    DOC.write_text(_document(results, sections, verdicts, cost, elapsed, machine_line()))
    print(f"wrote {DOC.relative_to(ROOT)} and {PLOT.relative_to(ROOT)} ({elapsed:.0f} s)", file=sys.stderr)


def _target_text(verdicts) -> str:
    missed = [name for name, gap, _ in verdicts if gap < -TARGET_POINTS]
    if not missed:
        return ("Met on every task of this run. The seeds' spread (the std column) is of the same order as "
                "the target, so a difference of a few tenths is within noise.")
    return (f"Missed on {', '.join(missed)}, by the gap above. Tried: weight prediction (with and without "
            "int8+EF) at two learning rates per task; training the CNN longer (24 epochs here; with 12, in the run "
            "committed in b9bbcc9 (this file's git history), the gaps at both rates were larger); and, on top of "
            "the correction with int8+EF, a synchronous first epoch (`warmup_steps`) and a momentum correction "
            "for the delay (momentum x 0.8: the stale gradient already carries momentum of its own): the rows "
            "\"first epoch synchronous\" and \"momentum x 0.8\" above. The warm-up did not help where the gap is "
            "(on `shapes`; switching to "
            "width 2 mid-training at full step size jolts the iteration); the lower momentum narrows the gap at "
            "the higher learning rate but costs accuracy at the lower one, where staleness costs little: it "
            "trades one for the other, as a smaller step size does, rather than correcting the delay.")


def _document(results, sections, verdicts, cost, elapsed, machine) -> str:
    met = [f"**{name}**: {gap:+.2f} points ({'within' if gap >= -TARGET_POINTS else 'not within'} "
           f"{TARGET_POINTS} point; plain width 2: {plain:+.2f})" for name, gap, plain in verdicts]
    overhead = cost["step_corrected_ms"] / cost["step_ms"] - 1
    return f"""# Accuracy: staleness, its correction, and int8 with error feedback

Written by `benchmarks/accuracy.py` (`make accuracy`) from one run; no figure here is typed by hand.
{machine}; {elapsed:.0f} s in all. Each task is one launch of `horovodrun -np 2 -H localhost:2 --mpi`
that trains all configurations and seeds side by side, epoch by epoch (one torch thread per rank):
each run has its own model and optimizer, runs of one seed start from the same weights and see
the same batches in the same order. Test accuracy is measured after every epoch at the real
weights (`with opt.real_weights():`), the last one after `flush()`. "Training s" counts only that
run's training steps (slowest rank), so configurations interleaved in one launch are comparable;
on this 2-core host with 2 local ranks communication is cheap, so width 2 buys little speed here
(docs/benchmarks.md has the speed study); this page is about what staleness costs in accuracy.

Configurations: synchronous (`width=1`, Horovod's rule), `width=2` (Pipe-SGD, staleness 1), and
`width=2, staleness_correction=True` (weight prediction), each with `compression="none"` and
`psgd.Compression.int8` (8-bit codes with error feedback); 3 seeds each (initial weights and data
order). SGD with momentum 0.9; the learning rates were picked in short trials (one seed,
`--lr`) where plain width 2 visibly loses accuracy against synchronous training, and each task
runs at two rates to show how the gap grows with the step size. Staleness 1 with momentum is a
step-size problem: the delayed feedback makes the iteration unstable at step sizes that
synchronous SGD still tolerates, first costing accuracy, then diverging.

![test accuracy vs epoch and vs wall time](img/accuracy.png)

## Results (final test accuracy)

{(chr(10) * 2).join(sections)}

## Issue 8's target: width 2 + correction + int8+EF within {TARGET_POINTS} point of synchronous

Gap of the mean of 3 seeds to synchronous (uncompressed):

{chr(10).join(f"- {m}" for m in met)}

{_target_text(verdicts)}

## What the correction costs, and when to use it

- **Memory:** two extra copies of the weights (the real weights w_t and the previous ones
  w_{{t-1}}; the parameters hold the prediction): {cost['extra_bytes']:,} bytes for the digits MLP
  ({cost['params']:,} float32 parameters); for a 25M-parameter ResNet-50, 200 MB. Checkpoints
  carry both copies too.
- **Time:** three element-wise passes over the weights per step (restore, keep, extrapolate).
  Measured on the digits MLP, one in-process rank, one thread, batch 32, width 2 (median of 5
  rounds of 300 steps, interleaved): {cost['step_ms']:.3f} ms per step without, {cost['step_corrected_ms']:.3f} ms with
  the correction ({100 * overhead:+.0f}%); the restore + predict pair alone, {1e3 * cost['pair_ms']:.0f} µs. On a model
  this small every per-step cost is relatively large; the pair is memory-bound (about 5 reads and
  3 writes of the weights), so on a large model it stays a small fraction of the forward and
  backward passes, which read the weights too and do far more arithmetic per weight.
- **When:** with `width=2` when staleness costs accuracy, which shows as a gap to synchronous
  training at the learning rate you want to use (a large batch, a large learning rate, momentum
  near 0.9; SAPipe saw ResNet-50 on CIFAR-10 lose 3.9 points at staleness 1). Not with `width=1`
  (no staleness to correct). Between steps the model holds the prediction: evaluate and save
  inside `opt.real_weights()` or after `flush()`.
"""


if __name__ == "__main__":
    main()
