"""Accuracy study: synchronous vs width 2 vs width 2 + each staleness correction, with and without int8+EF.

Run ``.venv/bin/python -m benchmarks.accuracy`` (or ``make accuracy``) from the repository root.
The parent launches itself (``--worker``) once per task under
``horovodrun -np 2 -H localhost:2 --mpi``; each launch trains every configuration and seed side by
side (epoch by epoch, each its own model and optimizer on the same data order), times each run's
training steps on its own, and evaluates on every rank at the real weights
(``opt.real_weights()``) after every epoch. Rank 0 prints one JSON line (marker below); the parent
measures what weight prediction costs per step in-process, then ``benchmarks.accuracy_doc`` writes
``docs/accuracy.md`` and ``docs/img/accuracy.png``.

Tasks (each one ``Task``; its data and model behind one small interface, ``Classification`` here
or ``benchmarks.accuracy_lm.LanguageModel``, so one training loop serves both):

* ``digits``: sklearn's 8x8 handwritten digits (1,797 images, shipped with scikit-learn), an MLP.
* ``shapes``: 16x16 images of 8 shape classes (bars, outlines, filled shapes, crosses) at random
  positions, sizes and intensities under Gaussian noise, generated from a fixed seed, and a small
  CNN. Generated rather than digits upsampled: upsampled digits carry no more information than
  task 1 and a CNN would only re-learn it, while shapes at random positions need translation-
  invariant features (what convolutions are for), and size and noise set the difficulty.
* ``pydoc-lm``: byte-level language modelling of Python's documentation text with a tiny causal
  transformer and AdamW (``benchmarks/accuracy_lm.py``); validation loss and perplexity.

Trials: ``--tasks``, ``--configs``, ``--seeds 1``, ``--lr``, ``--epochs``, ``--no-doc``.
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


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    width: int
    correction: Optional[str]  # staleness_correction: None or one of pipesgd_hvd's names
    compression: str
    warmup_epochs: int = 0   # synchronous epochs first (warmup_steps), then width 2
    momentum_scale: float = 1.0  # times the task's momentum (a momentum correction for the delay)


#: staleness_correction names, the short form in configuration keys, and the label.
CORRECTIONS = (("weight_prediction", "wp", "weight prediction"), ("delay_compensation", "dc", "delay compensation"),
               ("eager", "eager", "eager"), ("adam_prediction", "adam", "Adam prediction"))
CONFIGS = (
    Config("sync", "sync (width 1)", 1, None, "none"),
    Config("sync-int8", "sync, int8+EF", 1, None, "int8"),
    Config("w2", "width 2", 2, None, "none"),
    Config("w2-int8", "width 2, int8+EF", 2, None, "int8"),
    *(Config(f"w2-{short}{suffix}", f"width 2 + {label}{', int8+EF' if codec == 'int8' else ''}", 2, name, codec)
      for name, short, label in CORRECTIONS for suffix, codec in (("", "none"), ("-int8", "int8"))),
    # measured in the run of 2026-12-03 (docs/accuracy.md's history), not in the default run
    Config("w2-wp-int8-warm", "width 2 + weight prediction, int8+EF, first epoch synchronous", 2,
           "weight_prediction", "int8", 1),
    Config("w2-wp-int8-m08", "width 2 + weight prediction, int8+EF, momentum x 0.8", 2, "weight_prediction",
           "int8", 0, 0.8),
)
BY_KEY = {c.key: c for c in CONFIGS}
#: SGD tasks: each correction that applies to SGD (adam_prediction refuses any other optimizer),
#: with int8+EF. The language model: every correction with and without it.
SGD_CONFIGS = ("sync", "sync-int8", "w2", "w2-int8", "w2-wp-int8", "w2-dc-int8", "w2-eager-int8")
ADAMW_CONFIGS = ("sync", "sync-int8", "w2", "w2-int8", "w2-wp", "w2-wp-int8", "w2-dc", "w2-dc-int8", "w2-eager",
                 "w2-eager-int8", "w2-adam", "w2-adam-int8")


@dataclass(frozen=True)
class Task:
    name: str
    data: str         # "digits", "shapes" (classification) or "pydoc" (language model): data and model
    title: str
    epochs: int
    batch: int        # per rank
    lr: float         # SGD: per rank, scaled by the number of ranks (Horovod's convention); AdamW: as is
    momentum: float = 0.0      # SGD
    optimizer: str = "sgd"     # "sgd" (with momentum) or "adamw"
    weight_decay: float = 0.0  # AdamW
    steps: int = 0    # steps per epoch (language model); 0: one pass over the rank's shard
    configs: Tuple[str, ...] = SGD_CONFIGS
    schedule: str = "constant"  # or "cosine": linear warm-up, then cosine decay to 0 (lr_factor)


#: Fraction of the run spent in the linear learning-rate warm-up of the "cosine" schedule.
WARMUP_FRACTION = 0.1


def lr_factor(schedule: str, step: int, total: int) -> float:
    """The learning rate's factor at ``step`` (0-based) of ``total``: 1 for "constant"; for
    "cosine" a linear warm-up over the first WARMUP_FRACTION of the steps, then a half cosine that
    reaches 0 one step after the last (the usual transformer recipe)."""
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"unknown schedule {schedule!r}: use 'constant' or 'cosine'")
    warmup = max(1, round(WARMUP_FRACTION * total))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


# Learning rates where staleness costs accuracy (trials with --lr); each SGD task at two, to show
# the gap growing with the step size.
TASKS = {
    "digits": Task("digits", "digits", "sklearn digits, MLP 64-128-10", epochs=30, batch=32, lr=0.05, momentum=0.9),
    "digits-lr0.075": Task("digits-lr0.075", "digits", "sklearn digits, MLP 64-128-10, higher learning rate",
                           epochs=30, batch=32, lr=0.075, momentum=0.9),
    "shapes-lr0.01": Task("shapes-lr0.01", "shapes", "generated 16x16 shapes (8 classes), CNN, lower learning rate",
                          epochs=24, batch=32, lr=0.01, momentum=0.9),
    "shapes": Task("shapes", "shapes", "generated 16x16 shapes (8 classes), CNN", epochs=24, batch=32, lr=0.02,
                   momentum=0.9),
    "pydoc-lm": Task("pydoc-lm", "pydoc", "Python's documentation text, byte-level causal transformer (AdamW)",
                     epochs=8, batch=16, lr=1e-2, optimizer="adamw", weight_decay=0.01, steps=50,
                     configs=ADAMW_CONFIGS),
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


class Classification:
    """A classification task on one rank (the interface ``benchmarks.accuracy_lm.LanguageModel``
    shares): ``steps`` per epoch, ``model(seed)``, ``batches(seed, epoch)`` (this rank's shard in
    an order of its own per seed, epoch and rank) and ``evaluate(model)`` (test accuracy, a
    fraction: higher is better)."""

    metric = "accuracy"

    def __init__(self, task: Task, rank: int, size: int) -> None:
        import torch

        x_train, x_test, y_train, y_test = (torch.from_numpy(np.asarray(a)) for a in load(task.data))
        self.x_train, self.y_train = x_train[rank::size], y_train[rank::size].long()  # each rank its own shard
        self.x_test, self.y_test = x_test, y_test.long()
        self.data, self.rank, self.batch = task.data, rank, task.batch
        self.steps = len(self.x_train) // task.batch
        self.train_size, self.test_size = len(x_train), len(x_test)

    def model(self, seed: int):
        return make_model(self.data, seed)

    def batches(self, seed: int, epoch: int):
        import torch

        order = torch.randperm(len(self.x_train), generator=torch.Generator().manual_seed(
            10_000 * seed + 100 * epoch + self.rank))
        for s in range(self.steps):
            batch = order[s * self.batch:(s + 1) * self.batch]
            yield self.x_train[batch], self.y_train[batch]

    def evaluate(self, model) -> float:
        return float((model(self.x_test).argmax(dim=1) == self.y_test).double().mean())


def configs_for(task: Task, keys: Optional[Sequence[str]]) -> List[str]:
    """The task's own configurations, or ``keys`` less those that do not apply to its optimizer
    (``adam_prediction`` needs Adam/AdamW)."""
    if keys is None:
        return list(task.configs)
    return [k for k in keys if task.optimizer == "adamw" or BY_KEY[k].correction != "adam_prediction"]


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
    schedule = args.schedule or task.schedule
    if task.data == "pydoc":
        from benchmarks.accuracy_lm import LanguageModel

        problem: Any = LanguageModel(rank, task.steps, task.batch)
    else:
        problem = Classification(task, rank, size)

    runs: List[Dict[str, Any]] = []
    for seed in range(args.seeds):
        for key in configs_for(task, args.configs):
            cfg = BY_KEY[key]
            model = problem.model(seed)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            if task.optimizer == "sgd":
                inner = torch.optim.SGD(model.parameters(), lr=lr * size, momentum=momentum * cfg.momentum_scale)
            else:
                inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=task.weight_decay)
            # Names unique per run: the runs share one process, and Horovod refuses two in-flight
            # collectives of one name (pipesgd names them after the parameters).
            named = [(f"{key}.{seed}.{n}", p) for n, p in model.named_parameters()]
            opt = psgd.DistributedOptimizer(inner, named_parameters=named, width=cfg.width,
                                            compression=cfg.compression,
                                            staleness_correction=cfg.correction or False,
                                            warmup_steps=cfg.warmup_epochs * problem.steps)
            # attached to the distributed optimizer, as a Horovod user attaches it
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda step: lr_factor(schedule, step, epochs * problem.steps))
            runs.append({"config": key, "seed": seed, "model": model, "opt": opt, "scheduler": scheduler,
                         "seconds": 0.0,
                         "value": [], "spread": [], "time": [], "loss": []})

    for epoch in range(epochs):
        for run in runs:
            # the same data for every configuration of a seed, different per seed and rank
            model, opt = run["model"], run["opt"]
            model.train()
            total = 0.0
            start = time.perf_counter()
            for inputs, targets in problem.batches(run["seed"], epoch):
                opt.zero_grad()
                logits = model(inputs)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())
                loss.backward()
                opt.step()
                run["scheduler"].step()
                total += float(loss.detach())
            if epoch == epochs - 1:
                opt.flush()  # apply the gradient still in flight
            run["seconds"] += time.perf_counter() - start
            model.eval()
            with opt.real_weights(), torch.no_grad():
                value = problem.evaluate(model)
            # Every rank evaluates its own replica: with "eager" they differ between steps (each
            # rank mixes in its own fresh gradient), and with Adam still after flush() (their
            # moments differ); the others' are identical. Reported: the mean over ranks.
            values = hvd.allgather_object(value, name=f"accuracy.eval.{run['config']}.{run['seed']}")
            run["value"].append(statistics.mean(values))
            run["spread"].append(max(values) - min(values))
            run["time"].append(run["seconds"])
            run["loss"].append(total / problem.steps)
            if not math.isfinite(run["loss"][-1]) and rank == 0:
                print(f"diverged: {run['config']} seed {run['seed']} epoch {epoch}", file=sys.stderr, flush=True)
        if rank == 0:
            print(f"{task.name} epoch {epoch + 1}/{epochs}", file=sys.stderr, flush=True)

    # Wall time: the slowest rank's, per epoch (training steps only, evaluation excluded).
    times = hvd.allgather_object([run["time"] for run in runs], name="accuracy.times")
    out = []
    for i, run in enumerate(runs):
        slowest = [max(t[i][e] for t in times) for e in range(epochs)]
        out.append({"config": run["config"], "seed": run["seed"], "value": run["value"], "spread": run["spread"],
                    "time": slowest, "loss": run["loss"], "wire_ratio": run["opt"].stats.ratio})
    if rank == 0:
        print(MARKER + json.dumps({"task": task.name, "metric": problem.metric, "optimizer": task.optimizer,
                                   "lr": lr, "momentum": momentum, "weight_decay": task.weight_decay,
                                   "schedule": schedule,
                                   "epochs": epochs, "batch": task.batch, "ranks": size,
                                   "steps_per_epoch": problem.steps, "train_size": problem.train_size,
                                   "test_size": problem.test_size, "runs": out}),
              flush=True)


# ---------------------------------------------------------------------------------- parent side

def _launch(task: str, args: argparse.Namespace) -> Dict[str, Any]:
    bindir = Path(sys.executable).parent  # the venv's bin, without resolving its python symlink
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    cmd = [str(bindir / "horovodrun"), "-np", "2", "-H", "localhost:2", "--mpi",
           str(bindir / "python"), "-m", "benchmarks.accuracy", "--worker", "--task", task,
           "--seeds", str(args.seeds)] + (["--configs", *args.configs] if args.configs else [])
    for flag, value in (("--epochs", args.epochs), ("--lr", args.lr), ("--momentum", args.momentum),
                        ("--schedule", args.schedule)):
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
    from pipesgd_hvd.ops.torch import TORCH_OPS

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
            opt._core._restore_real_weights()  # the core's pair, timed alone
            opt._core._predict_weights()
        pair.append((time.perf_counter() - start) / steps)
    for correction in (False, True):
        setups[correction][1].flush()
    params = sum(p.numel() for p in model.parameters())
    return {"step_ms": 1e3 * statistics.median(plain), "step_corrected_ms": 1e3 * statistics.median(corrected),
            "pair_ms": 1e3 * statistics.median(pair), "params": params, "extra_bytes": 2 * 4 * params}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--task", choices=sorted(TASKS), help=argparse.SUPPRESS)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=sorted(TASKS))
    parser.add_argument("--configs", nargs="+", choices=list(BY_KEY),
                        help="instead of each task's own (those that do not apply to its optimizer are skipped)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, help="override each task's epochs (trials)")
    parser.add_argument("--lr", type=float, help="override each task's learning rate (trials)")
    parser.add_argument("--momentum", type=float, help="override each task's momentum (trials)")
    parser.add_argument("--schedule", choices=("constant", "cosine"), help="override each task's schedule (trials)")
    parser.add_argument("--no-doc", action="store_true", help="print the tables, leave docs/ alone (trials)")
    parser.add_argument("--save", type=Path, help="also write the results (JSON) here")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    from benchmarks import accuracy_doc
    from benchmarks.report import machine_line

    start = time.perf_counter()
    results = [_launch(task, args) for task in args.tasks]
    cost = correction_cost("digits")
    elapsed = time.perf_counter() - start
    if args.save:
        args.save.write_text(json.dumps({"results": results, "cost": cost, "elapsed": elapsed}))
    if args.no_doc:
        print(accuracy_doc.sections(results, BY_KEY, TASKS))
        print(accuracy_doc.verdict_lines(results, BY_KEY), cost, sep="\n")
        return
    accuracy_doc.write(results, cost, elapsed, machine_line(), BY_KEY, TASKS)
    print(f"wrote {DOC.relative_to(ROOT)} and {PLOT.relative_to(ROOT)} ({elapsed:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
