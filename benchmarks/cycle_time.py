"""Horovod's cycle time beside a pipelined optimizer: what Horovod's background loop costs a step
on a CPU machine whose ranks fill the cores, and what a longer cycle gives back.

Horovod's background thread wakes every cycle (``HOROVOD_CYCLE_TIME`` ms, ``horovodrun
--cycle-time-ms``) to negotiate the ops ranks have submitted, whether or not there are any. A
pipesgd optimizer's reductions go through its own channel, not through that loop, so only the
user's own Horovod ops (metric averaging, broadcasts) wait for it. This runs the same ranks
under ``horovodrun -np 2`` (one host, ``--gloo`` and ``--mpi``) with Horovod's default cycle and
with ``--cycle-ms``, alternating launches, each launch timing every configuration in rounds:
compute alone (Horovod initialized, nothing reduced), Horovod's ``DistributedOptimizer``, pipesgd
width 2 + int8, and the same with an unnamed ``hvd.allreduce`` of the loss after every step.
Writes the "cycle_time" section of docs/benchmarks.md.

    python -m benchmarks.cycle_time [--reps 3] [--cycle-ms 20] [--controllers gloo mpi]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

MARKER = "CYCLE_TIME_RESULT "
CONFIGS = ("compute", "horovod", "w2-int8", "w2-int8+metric")
LABELS = {"compute": "compute alone (Horovod initialized)", "horovod": "Horovod DistributedOptimizer (sync)",
          "w2-int8": "pipesgd width 2 + int8", "w2-int8+metric": "pipesgd width 2 + int8, `hvd.allreduce(loss)` per step"}
DEFAULT = "default"


# ---------------------------------------------------------------------------------- one rank
def rank_main(rounds: int, steps: int) -> None:
    """Times every configuration in ``rounds`` interleaved rounds of ``steps`` steps; rank 0
    prints each configuration's step times, the slowest rank's per step."""
    import horovod.torch as hvd
    import torch

    import pipesgd_hvd.torch as psgd

    hvd.init()
    torch.set_num_threads(1)
    x = torch.randn(1024, 1024)

    def make(config: str):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
        inner = torch.optim.SGD(model.parameters(), lr=1e-6)
        if config == "compute":
            return model, inner
        if config == "horovod":
            return model, hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
        return model, psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), width=2,
                                                compression=psgd.Compression.int8)

    runs = {config: make(config) for config in CONFIGS}

    def step(config: str) -> float:
        model, opt = runs[config]
        start = time.perf_counter()
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        if config.endswith("+metric"):
            hvd.allreduce(loss.detach())  # unnamed, as Horovod's examples average a metric
        return time.perf_counter() - start

    times: Dict[str, List[float]] = {config: [] for config in CONFIGS}
    for r in range(rounds):
        for config in CONFIGS[r % len(CONFIGS):] + CONFIGS[: r % len(CONFIGS)]:
            step(config)  # untimed: refills a pipeline flushed at the end of its last segment
            hvd.allreduce(torch.zeros(1), name=f"cycle.go.{r}.{config}")
            times[config] += [step(config) for _ in range(steps)]
            if hasattr(runs[config][1], "flush"):
                runs[config][1].flush()
    everyone = hvd.allgather_object(times, name="cycle.result")
    if hvd.rank() == 0:
        slowest = {c: [max(rank[c][i] for rank in everyone) for i in range(len(times[c]))] for c in CONFIGS}
        sys.stdout.write(MARKER + json.dumps(slowest) + "\n")
        sys.stdout.flush()


# ---------------------------------------------------------------------------------- driver
def launch(controller: str, cycle_ms: Optional[float], rounds: int, steps: int, timeout: float) -> Dict[str, List[float]]:
    """One ``horovodrun -np 2 --<controller>`` launch; Horovod's default cycle when ``cycle_ms``
    is None (the variable unset: an empty value is not the default, it reads as 0)."""
    env = dict(os.environ)
    env.pop("HOROVOD_CYCLE_TIME", None)
    if cycle_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = f"{cycle_ms:g}"
    horovodrun = str(Path(sys.executable).with_name("horovodrun"))
    cmd = [horovodrun, "-np", "2", "-H", "localhost:2", f"--{controller}", sys.executable, "-m",
           "benchmarks.cycle_time", "--rank", "--rounds", str(rounds), "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                         cwd=Path(__file__).resolve().parents[1])
    for line in out.stdout.splitlines():
        if MARKER in line:
            return json.loads(line.split(MARKER, 1)[1])
    raise RuntimeError(f"{' '.join(cmd)} gave no result (status {out.returncode}):\n{out.stdout[-3000:]}\n"
                       f"{out.stderr[-3000:]}")


def summarize(samples: Dict[str, Dict[str, List[List[float]]]]) -> Dict[str, Dict[str, float]]:
    """samples[setting][config] = one list of step seconds per launch -> the median over launches
    of each launch's median step (the launches ran alternately, so drift hits both settings)."""
    return {setting: {config: statistics.median(statistics.median(run) for run in runs)
                      for config, runs in per_config.items()}
            for setting, per_config in samples.items()}


def render(medians: Dict[str, Dict[str, float]], controllers: Sequence[str], cycle_ms: float, reps: int,
           rounds: int, steps: int) -> str:
    from benchmarks.report import machine_line, table

    longer = f"{cycle_ms:g} ms"
    rows = []
    for config in CONFIGS:
        row = [LABELS[config]]
        for controller in controllers:
            base, tuned = medians[f"{controller}/{DEFAULT}"][config], medians[f"{controller}/{longer}"][config]
            row += [f"{base * 1e3:.0f}", f"{tuned * 1e3:.0f}", f"{tuned / base:.2f}"]
        rows.append(row)
    head = ["configuration"]
    for controller in controllers:
        head += [f"{controller}: default cycle, ms", f"{controller}: cycle {longer}, ms", f"{controller}: ratio"]
    return (f"## Horovod's cycle time beside pipesgd (`benchmarks/cycle_time.py`)\n\n"
            f"{machine_line()}. `horovodrun -np 2 -H localhost:2` on this one machine (one rank per core), "
            f"4 x Linear(1024, 1024), batch 1024, one torch thread per rank. Horovod's default cycle (the "
            f"variable unset) against `HOROVOD_CYCLE_TIME={cycle_ms:g}`, {reps} launches of each, alternating; "
            f"each launch ran {rounds} interleaved rounds of {steps} steps per configuration. Step time: the "
            f"slowest rank's, median per launch, median over launches; ratio = cycle {longer} / default.\n\n"
            + table(head, rows)
            + "\n\nHorovod's background loop wakes every cycle whether or not an op is waiting, on the cores "
              "compute needs. pipesgd's reductions do not go through that loop (they use the pipeline's own "
              "channel), so a longer cycle only delays the user's own Horovod ops, by up to one cycle each: "
              "the last row keeps one unnamed `hvd.allreduce` per step.\n")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="launches per (controller, cycle)")
    parser.add_argument("--cycle-ms", type=float, default=20.0)
    parser.add_argument("--controllers", nargs="+", choices=("gloo", "mpi"), default=["gloo", "mpi"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--no-doc", action="store_true", help="print the section, leave docs/ alone")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # one rank of a launch
    args = parser.parse_args(argv)
    if args.rank:
        return rank_main(args.rounds, args.steps)
    from benchmarks.report import progress

    settings = [(DEFAULT, None), (f"{args.cycle_ms:g} ms", args.cycle_ms)]
    samples: Dict[str, Dict[str, List[List[float]]]] = {}
    total, done, started = args.reps * len(args.controllers) * len(settings), 0, time.perf_counter()
    for _ in range(args.reps):
        for controller in args.controllers:
            for name, cycle in settings:
                result = launch(controller, cycle, args.rounds, args.steps, args.timeout)
                for config, steps in result.items():
                    samples.setdefault(f"{controller}/{name}", {}).setdefault(config, []).append(steps)
                done += 1
                print(f"[{done}/{total}] {controller}, cycle {name}: "
                      + ", ".join(f"{c} {statistics.median(s) * 1e3:.0f} ms" for c, s in result.items())
                      + f"; {progress(done, total, started)}", flush=True)
    text = render(summarize(samples), args.controllers, args.cycle_ms, args.reps, args.rounds, args.steps)
    if not args.no_doc:
        from benchmarks.report import write_section

        write_section("cycle_time", text)
    print(text)


if __name__ == "__main__":
    main()
