"""Unnamed Horovod ops beside a pipelined optimizer: what a per-step ``hvd.allreduce(metric)``
without ``name=`` costs once a job has run for a while, against the same op with a name.

Horovod names an unnamed op ``allreduce.noname.<handle>``, a new name every call. Each new name
takes an entry of Horovod's response cache (``HOROVOD_CACHE_CAPACITY``, 1024 by default), and its
background loop keeps the entries' state in step across ranks every cycle, op or not
(``horovod/common/response_cache.cc``). A named op reuses one entry. On a CPU machine whose ranks
fill the cores that loop's CPU is taken from compute, and a pipelined step that hides its
reduction is compute-bound. Each launch (2 emulated hosts, ``benchmarks/cluster/``) first runs
``--before`` metric all-reduces, as many steps of a job would have, then times pipesgd width 2
training steps, each followed by the metric all-reduce; launches alternate between unnamed and
named. Writes the "metric_names" section of docs/benchmarks.md.

    python -m benchmarks.metric_names [--reps 3] [--rate 133mbit] [--before 1500]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.cycle_time import summarize

MARKER = "METRIC_NAMES_RESULT "
SETTINGS = ("unnamed", "named")
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------- one rank
def rank_main(setting: str, before: int, steps: int, codec: str) -> None:
    """``before`` metric all-reduces, then ``steps`` timed steps (after 3 untimed); rank 0 prints
    the slowest rank's step times and each rank's CPU per step beside the training thread."""
    import horovod.torch as hvd
    import torch

    import pipesgd_hvd.torch as psgd

    hvd.init()
    torch.set_num_threads(1)
    name = "metric" if setting == "named" else None  # None: Horovod's per-call name
    x = torch.randn(1024, 1024)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-6),
                                    named_parameters=model.named_parameters(), width=2,
                                    compression=getattr(psgd.Compression, codec))
    for _ in range(before):
        hvd.allreduce(torch.zeros(1), name=name)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        hvd.allreduce(loss.detach(), name=name)
        return time.perf_counter() - start

    for _ in range(3):
        step()
    usage, main_cpu = resource.getrusage(resource.RUSAGE_SELF), time.thread_time()
    times = [step() for _ in range(steps)]
    after = resource.getrusage(resource.RUSAGE_SELF)
    process_cpu = (after.ru_utime + after.ru_stime) - (usage.ru_utime + usage.ru_stime)
    others = (process_cpu - (time.thread_time() - main_cpu)) / steps
    opt.flush()
    everyone = hvd.allgather_object({"times": times, "others": others}, name="metric_names.result")
    if hvd.rank() == 0:
        slowest = [max(rank["times"][i] for rank in everyone) for i in range(steps)]
        result = {"step": slowest, "others": [rank["others"] for rank in everyone]}
        sys.stdout.write(MARKER + json.dumps(result) + "\n")
        sys.stdout.flush()


# ---------------------------------------------------------------------------------- driver
def launch(setting: str, rate: str, before: int, steps: int, codec: str, timeout: float) -> Dict[str, List[float]]:
    from benchmarks.cluster import gloo
    from benchmarks.cluster.netns import Cluster

    cmd = [sys.executable, "-m", "benchmarks.metric_names", "--rank", setting, "--before", str(before),
           "--steps", str(steps), "--codec", codec]
    env = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)}
    with Cluster(2, rate=rate) as cluster:
        proc = gloo.run(cluster, cmd, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if MARKER in line:
            return json.loads(line.split(MARKER, 1)[1])
    raise RuntimeError(f"no result (status {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def render(medians: Dict[str, Dict[str, float]], rate: str, codec: str, before: int, reps: int, steps: int) -> str:
    """``medians[setting]``: the median over launches of the step ("step") and of the CPU per
    step of a rank's other threads ("others"), in seconds."""
    from benchmarks.report import machine_line, table

    calls = {"unnamed": "`hvd.allreduce(loss)`", "named": "`hvd.allreduce(loss, name=\"metric\")`"}
    rows = [[calls[s], f"{medians[s]['step'] * 1e3:.0f}", f"{medians[s]['others'] * 1e3:.0f}"] for s in SETTINGS]
    ratio = medians["unnamed"]["step"] / medians["named"]["step"]
    return (f"## Unnamed Horovod ops beside pipesgd (`benchmarks/metric_names.py`)\n\n"
            f"{machine_line()}. 2 emulated hosts at {rate}, gloo controller, Horovod's defaults; pipesgd width 2 + "
            f"{codec}, 4 x Linear(1024, 1024), batch 1024, one torch thread per rank, an `hvd.allreduce` of the loss "
            f"after every step. Each launch first ran {before} such all-reduces (a job that has averaged a metric "
            f"for {before} steps), then {steps} timed steps; {reps} launches of each, alternating. Step: the "
            f"slowest rank's, median per launch, median over launches. Other threads: a rank's CPU per step beside "
            f"the training thread (Horovod's background loop and transport, the pipeline's threads), median over "
            f"ranks and launches.\n\n"
            + table(["metric all-reduce", "step ms", "other threads' CPU per step, ms"], rows)
            + f"\n\nUnnamed / named step: **{ratio:.2f}**. An unnamed op gets a new name at every call, and each new "
              "name takes an entry of Horovod's response cache, whose state its background loop keeps in step "
              "across ranks every cycle; a named op reuses one entry. Name the collectives a training loop "
              "repeats.\n")


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="launches per setting")
    parser.add_argument("--rate", default="133mbit")
    parser.add_argument("--codec", default="int4")
    parser.add_argument("--before", type=int, default=1500, help="metric all-reduces before the timed steps")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--no-doc", action="store_true", help="print the section, leave docs/ alone")
    parser.add_argument("--rank", choices=SETTINGS, help=argparse.SUPPRESS)  # one rank of a launch
    args = parser.parse_args(argv)
    if args.rank:
        return rank_main(args.rank, args.before, args.steps, args.codec)
    from benchmarks.report import progress, write_section

    samples: Dict[str, Dict[str, List[List[float]]]] = {s: {"step": [], "others": []} for s in SETTINGS}
    total, done, started = args.reps * len(SETTINGS), 0, time.perf_counter()
    for _ in range(args.reps):
        for setting in SETTINGS:
            result = launch(setting, args.rate, args.before, args.steps, args.codec, args.timeout)
            samples[setting]["step"].append(result["step"])
            samples[setting]["others"].append(result["others"])
            done += 1
            print(f"[{done}/{total}] {setting}: step {statistics.median(result['step']) * 1e3:.0f} ms, other threads "
                  + " / ".join(f"{c * 1e3:.0f}" for c in result["others"])
                  + f" ms per step; {progress(done, total, started)}", flush=True)
    text = render(summarize(samples), args.rate, args.codec, args.before, args.reps, args.steps)
    if not args.no_doc:
        write_section("metric_names", text)
    print(text)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
