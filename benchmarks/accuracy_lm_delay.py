"""Why the language model's staleness gap stays: the study's task trained with a plain delayed
AdamW, without pipesgd or Horovod, one process.

The study (``benchmarks/accuracy.py``) measures width 2 on the language model far behind
synchronous training, with every correction. This script separates the delay from the
implementation and probes what the gap depends on: each setting trains the study's tiny
transformer twice from the same weights on the same batches, once synchronously and once with
every gradient applied one step late (what ``width=2`` does on one rank; 2 ranks x 16 windows =
one batch of 32 here), and measures validation perplexity along the way. Settings: the study's
own (lr 1e-2, 400 steps), lower rates, Adam's beta2 at 0.95, a warm-up + cosine schedule, the
first half synchronous, and three times the steps.

Run ``.venv/bin/python -m benchmarks.accuracy_lm_delay`` from the repository root (about 3 min on
2 cores); it rewrites the marked ``lm-delay`` section of docs/accuracy.md (the study keeps it).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks.report import write_section

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "accuracy.md"
SECTION = "lm-delay"  # the marked section of docs/accuracy.md this script owns
BATCH = 32          # 2 ranks x 16 windows, as in the study
EVALS = 4           # validation points per run


@dataclass(frozen=True)
class Setting:
    label: str
    lr: float
    steps: int = 400
    betas: Tuple[float, float] = (0.9, 0.999)
    schedule: str = "constant"
    sync_first: int = 0   # synchronous steps before the delay starts (the delayed run only)


SETTINGS = (
    Setting("the study's: lr 1e-2, 400 steps", 1e-2),
    Setting("lr 3e-3", 3e-3),
    Setting("lr 1e-3", 1e-3),
    Setting("lr 1e-2, betas (0.9, 0.95)", 1e-2, betas=(0.9, 0.95)),
    Setting("lr 1e-2, warm-up + cosine decay", 1e-2, schedule="cosine"),
    Setting("lr 1e-2, first 200 steps synchronous", 1e-2, sync_first=200),
    Setting("lr 3e-3, 1200 steps", 3e-3, steps=1200),
)


def train(setting: Setting, delayed: bool, seed: int = 0) -> List[float]:
    """Validation perplexity at EVALS evenly spaced steps of one run (the last at the end,
    after applying the gradient still pending, as ``flush()`` does)."""
    import torch

    from benchmarks.accuracy import lr_factor
    from benchmarks.accuracy_lm import TinyTransformer, lm_data, train_batch, val_loss, val_windows

    torch.set_num_threads(1)
    train_text, val_text = lm_data()
    windows = val_windows(val_text)
    model = TinyTransformer(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=setting.lr, weight_decay=0.01, betas=setting.betas)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(setting.schedule, s, setting.steps))
    generator = torch.Generator().manual_seed(seed)
    pending: List[List[torch.Tensor]] = []
    curve = []

    def apply(grads: List[torch.Tensor]) -> None:
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
        schedule.step()

    for step in range(setting.steps):
        inputs, targets = train_batch(train_text, BATCH, generator)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        pending.append([p.grad.clone() for p in model.parameters()])
        # a delayed run keeps one gradient back (the first delayed step applies nothing, as a
        # pipeline's fill step does); a synchronous step applies its own
        if len(pending) > (1 if delayed and step >= setting.sync_first else 0):
            apply(pending.pop(0))
        if step == setting.steps - 1 and pending:
            apply(pending.pop(0))
        if (step + 1) % (setting.steps // EVALS) == 0:
            model.eval()
            curve.append(math.exp(val_loss(model, windows)))
            model.train()
    return curve


def _job(args: Tuple[Setting, bool]) -> Tuple[Setting, bool, List[float], float]:
    start = time.perf_counter()
    curve = train(*args)
    return args[0], args[1], curve, time.perf_counter() - start


def measure(settings: Sequence[Setting], workers: int = 2) -> Dict[Setting, Dict[bool, List[float]]]:
    """Every setting synchronous and delayed, ``workers`` processes at a time (a synchronous run
    does not depend on ``sync_first``, so it is trained once per distinct rest of the setting)."""
    def sync_of(s: Setting) -> Setting:
        return replace(s, label="", sync_first=0)

    jobs = list(dict.fromkeys([(sync_of(s), False) for s in settings] + [(s, True) for s in settings]))
    curves: Dict[Tuple[Setting, bool], List[float]] = {}
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        for setting, delayed, curve, seconds in pool.map(_job, jobs):
            curves[setting, delayed] = curve
            what = setting.label or f"lr {setting.lr:g}, betas {setting.betas}, {setting.schedule}, {setting.steps} steps"
            print(f"  {'delayed' if delayed else 'synchronous'}, {what}: {seconds:.0f} s", file=sys.stderr, flush=True)
    return {s: {False: curves[sync_of(s), False], True: curves[s, True]} for s in settings}


def section(results: Dict[Setting, Dict[bool, List[float]]], elapsed: float) -> str:
    rows = []
    for s, runs in results.items():
        sync, delayed = runs[False], runs[True]
        marks = " / ".join(str(s.steps * (i + 1) // EVALS) for i in range(EVALS))
        rows.append(f"| {s.label} | {marks} | {' / '.join(f'{v:.2f}' for v in sync)} | "
                    f"{' / '.join(f'{v:.2f}' for v in delayed)} | {100 * (delayed[-1] / sync[-1] - 1):+.1f}% |")
    table = "\n".join(rows)
    return f"""## Why the language model's gap stays: plain delayed AdamW

`benchmarks/accuracy_lm_delay.py` ({elapsed:.0f} s, one seed, one process, no pipesgd and no
Horovod): the study's transformer and data, batch {BATCH}, AdamW (weight decay 0.01), trained
once synchronously and once with each gradient applied one step late, from the same weights on
the same batches; validation perplexity at four points of each run.

| setting | at step | synchronous | delayed by one step | delayed vs synchronous, end |
|---|---|---|---|---|
{table}

What these runs show: the gap is the delay's, not the implementation's (at the study's setting
the plain delayed rule falls as far behind as width 2 does in the study's table). It shrinks as
the learning rate falls, but synchronous training then reaches less in the same steps (compare
the synchronous column across rates). A warm-up and cosine decay does not remove it, and a delay
switched on after synchronous steps makes the model worse than it was at the switch: at a rate
synchronous AdamW trains well with, the delayed iteration is unstable where the synchronous one
is not. (Our reading, not measured here: a delay shrinks the range of curvature a momentum method
tolerates at a given step size, and Adam's normalised steps keep it near the edge of that range
whatever the learning rate.) Given three times the steps the delayed run gets through and the gap
narrows, so on this task the delay mostly costs time. With Adam, then: take the correction the
rule names, and expect width 2 to need more steps or a lower learning rate than synchronous
training at the rate tuned for it; check against synchronous training before relying on it."""


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-doc", action="store_true", help="print the section, leave docs/ alone")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    text = section(measure(SETTINGS, args.workers), time.perf_counter() - start)
    if args.no_doc:
        print(text)
    else:
        write_section(SECTION, text, DOC)
        print(f"wrote the lm-delay section of {DOC.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
