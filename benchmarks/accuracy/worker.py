"""The rank side of one task (``python -m benchmarks.accuracy --worker --task NAME``, under
``horovodrun -np 2``): every configuration and seed side by side, segment by segment (an epoch, or
``updates_per_eval`` updates), each run its own model and optimizer(s) on the same data; runs of a
seed start from the same weights and see the same batches. After each segment every rank evaluates
its replica at the real weights (``opt.real_weights()``; the last time after ``flush()``). Rank 0
writes the task's result (JSON) to ``--out``; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from .optimizers import build, nadam_momentum_decay
from .problems import Batch, problem as make_problem
from .tasks import CONFIGS, TASKS, WARMUP_FRACTION, Config, Task, configs_for, lr_factor


def calls(batches: Iterable[Batch], config: Config) -> Iterator[Tuple[Batch, bool]]:
    """Each update's batch as the optimizer's calls take it, with whether the call ends the update:
    whole, or (two calls per update) split by ``psgd.halves`` as docs/options.md says, so an
    update sees the synchronous run's samples."""
    import pipesgd_hvd.torch as psgd

    for x, y in batches:
        if config.calls_per_update == 1:
            yield (x, y), True
            continue
        parts = list(psgd.halves(x, y, fresh_fraction=config.fresh))
        yield parts[0], False
        yield parts[1], True


@dataclass
class Run:
    config: Config
    seed: int
    lr: float
    model: torch.nn.Module
    opts: List[Any]
    schedulers: List[Any]
    seconds: float = 0.0
    done: bool = False   # flushed (at the end, or early when its metric stopped being finite)
    out: Dict[str, Any] = field(default_factory=lambda: {"value": [], "spread": [], "time": [], "loss": []})


def make_run(task: Task, prob: Any, cfg: Config, seed: int, lr: float, size: int, updates: int, tag: str,
             communicator: Optional[Callable[[], Any]] = None) -> Run:
    """A run's model and wrapped optimizer(s), each with its schedule over the run's calls.
    ``communicator``: a factory of one per optimizer (tests: an in-process world); default Horovod."""
    import pipesgd_hvd.torch as psgd

    model = prob.model(seed)
    if communicator is None:
        import horovod.torch as hvd

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    warmup = round(WARMUP_FRACTION * updates) if task.schedule == "cosine" else 0
    # names unique per run: the runs share a process, and Horovod refuses two in-flight collectives of one name
    opts = [psgd.DistributedOptimizer(inner, named_parameters=[(f"{tag}.{i}.{n}", p) for n, p in named],
                                      width=cfg.width, compression=getattr(psgd.Compression, cfg.compression),
                                      staleness_correction=cfg.correction or False,
                                      **({"fresh_fraction": cfg.fresh} if cfg.correction == "split_batch" else {}),
                                      communicator=communicator() if communicator else None)
            for i, (inner, named) in enumerate(build(task.optimizer, list(model.named_parameters()), lr, size,
                                                     task.momentum, task.betas, task.weight_decay, warmup))]
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda update: lr_factor(task.schedule, update, updates))
                  for opt in opts]
    return Run(cfg, seed, lr, model, opts, schedulers)


def train_segment(run: Run, prob: Any, segment: int, last: bool) -> None:
    if run.done:   # ended early: its metric stopped being finite
        run.out["loss"].append(math.nan)
        return
    run.model.train()
    losses = []
    start = time.perf_counter()
    for (x, y), update_ends in calls(prob.batches(run.seed, segment), run.config):
        for opt in run.opts:
            opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(run.model(x).flatten(0, -2), y.flatten())
        loss.backward()
        for opt, scheduler in zip(run.opts, run.schedulers):
            opt.step()
            if update_ends:
                scheduler.step()
        losses.append(float(loss.detach()))
    if last:
        for opt in run.opts:
            opt.flush()   # apply what is still in flight
        run.done = True
    run.seconds += time.perf_counter() - start
    run.out["loss"].append(sum(losses) / len(losses))


def local_value(run: Run, prob: Any) -> float:
    """This rank's metric of its own replica (replicas differ with ``eager``) at the real weights;
    a run that ended early keeps its value."""
    if run.done and run.out["value"] and not math.isfinite(run.out["value"][-1]):
        return math.inf
    run.model.eval()
    with contextlib.ExitStack() as stack:
        for opt in run.opts:
            stack.enter_context(opt.real_weights())
        value = prob.evaluate(run.model)
    return value if math.isfinite(value) else math.inf


def keep(run: Run, values: List[float], metric: str) -> None:
    """The mean over ranks and their spread; a value not finite on a rank ends the run (flushed) on all."""
    bad = not all(math.isfinite(v) for v in values)
    run.out["value"].append(math.inf if bad and metric == "val_loss" else sum(values) / len(values))
    run.out["spread"].append(0.0 if bad else max(values) - min(values))
    run.out["time"].append(run.seconds)
    if bad and not run.done:
        for opt in run.opts:
            opt.flush()
        run.done = True


def train_side_by_side(runs: List[Run], prob: Any, task: Task, evals: int, rank: int, phase: str) -> None:
    import horovod.torch as hvd

    start = time.perf_counter()
    for segment in range(evals):
        local = []
        for run in runs:
            train_segment(run, prob, segment, segment == evals - 1)
            local.append(local_value(run, prob))
            if rank == 0 and (task.updates_per_eval or segment == evals - 1):   # LM segments take minutes
                print(f"{task.name} {phase} {segment + 1}/{evals}: {run.config.key} seed {run.seed} lr {run.lr:g}: "
                      f"{local[-1]:.4f} on rank 0 ({run.seconds:.0f} s)", file=sys.stderr, flush=True)
        # one gather per segment: each Horovod op waits for Horovod's cycle (20 ms here)
        gathered = hvd.allgather_object(local, name=f"acc.eval.{phase}.{segment}")
        for i, run in enumerate(runs):
            keep(run, [values[i] for values in gathered], prob.metric)
        if rank == 0:
            left = (time.perf_counter() - start) / (segment + 1) * (evals - segment - 1)
            print(f"{task.name} {phase}: {segment + 1}/{evals} done, {time.perf_counter() - start:.0f} s in, "
                  f"~{left:.0f} s left", file=sys.stderr, flush=True)


def result(run: Run, times: List[List[List[float]]], i: int) -> Dict[str, Any]:
    """A run's record; its time per segment is the slowest rank's (training steps only)."""
    sent, fp32 = (sum(getattr(o.stats, f) for o in run.opts) for f in ("bytes_sent", "fp32_bytes"))
    return {"config": run.config.key, "seed": run.seed, **run.out, "wire_ratio": sent / fp32 if fp32 else 1.0,
            "time": [max(s) for s in zip(*(t[i] for t in times))]}


def work(args: argparse.Namespace) -> None:
    import horovod.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    task = TASKS[args.task]
    per_eval, evals = task.updates_per_eval, task.evals
    prob = make_problem(task.problem, rank, size, task.batch, per_eval, task.model)
    per_eval = prob.updates
    if args.steps:   # trials: about this many updates per run
        if task.updates_per_eval:
            per_eval = prob.updates = max(1, args.steps // evals)
        else:
            evals = max(1, round(args.steps / per_eval))
    updates = per_eval * evals
    grid: List[Dict[str, float]] = []
    lr, chosen = args.lr if args.lr is not None else task.lr, None
    if task.lr_grid and args.lr is None:   # as a user tunes it: synchronous, one seed, the full run
        grid_runs = [make_run(task, prob, CONFIGS["sync"], 0, g, size, updates, f"grid{j}")
                     for j, g in enumerate(task.lr_grid)]
        train_side_by_side(grid_runs, prob, task, evals, rank, "lr grid")
        grid = [{"lr": r.lr, "value": r.out["value"][-1]} for r in grid_runs]
        chosen = min(grid_runs, key=lambda r: r.out["value"][-1] * (1 if prob.metric == "val_loss" else -1))
        lr = chosen.lr
    keys = list(configs_for(task, args.configs))
    seeds = range(args.seeds or task.seeds)
    runs = [make_run(task, prob, CONFIGS[k], s, lr, size, updates, f"main.{k}.{s}") for s in seeds for k in keys
            if not (chosen is not None and k == "sync" and s == 0)]
    train_side_by_side(runs, prob, task, evals, rank, "main")
    if chosen is not None and "sync" in keys:
        runs.insert(0, chosen)   # the grid's winner is the synchronous run of seed 0, trained once
    runs.sort(key=lambda r: (keys.index(r.config.key), r.seed))
    times = hvd.allgather_object([r.out["time"] for r in runs], name="acc.times")
    if rank == 0:
        record = {"task": task.name, "problem": task.problem, "title": task.title, "optimizer": task.optimizer,
                  "metric": prob.metric, "judged": task.judged, "lr": lr, "lr_grid": grid,
                  "lr_source": "grid" if grid else (args.lr_source or "task"),
                  "schedule": task.schedule, "momentum": task.momentum, "betas": list(task.betas),
                  "weight_decay": task.weight_decay, "batch": task.batch, "ranks": size, "evals": evals,
                  "updates_per_eval": per_eval, "updates": updates, "model": task.model,
                  "train_size": prob.train_size, "test_size": prob.test_size, "data_sha256": prob.sha256,
                  "python": sys.version.split()[0], "torch": torch.__version__,
                  "runs": [result(r, times, i) for i, r in enumerate(runs)]}
        if task.optimizer == "nadamw":
            record["nadam_momentum_decay"] = nadam_momentum_decay(round(WARMUP_FRACTION * updates))
        Path(args.out).write_text(json.dumps(record))


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--task", choices=list(TASKS), required=True)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS))
    parser.add_argument("--seeds", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--lr-source", help="where --lr comes from (the record says it)")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)
