"""Throughput on the emulated cluster: Horovod's synchronous optimizer against pipesgd_hvd.

    python -m benchmarks.throughput                       (as root; `make bench` runs all three)
    python -m benchmarks.throughput --offload-compute     (compute off the cores)
    python -m benchmarks.throughput --hierarchical        (2 hosts x 2 ranks, flat vs hierarchical)
    python -m benchmarks.throughput --models              (ResNet-50, BERT-base, GPT-2 at real size, 2 and 4 hosts)
    python -m benchmarks.throughput --no-doc --aims 1 5 --configs w2 w2-int8   # a subset, docs/ untouched
    python -m benchmarks.throughput --settings 620mbit:1024 --rounds 1 --no-doc # a fixed RATE:BATCH
    python -m benchmarks.throughput --render build/throughput.json             # tables from a record

Each launch starts the worker (``throughput_worker.py``) on network namespaces with shaped links
(``tools/cluster``); each kind writes its section of docs/benchmarks.md, which says how it runs and
how to read it, and its samples to build/<section>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from .throughput_analysis import Launch
from .throughput_plan import (AIMS, FIRST_RATE, fit_comm, off_aim, plan_rate, rate_bps, second_rate, select_configs,
                              tc_rate, wire_bits)
from .thread_cpu import wait_for_quiet
from .throughput_worker import AUTO, HIERARCHICAL, MARKER, TRAINING
from . import throughput_zoo as zoo

ROOT = Path(__file__).resolve().parents[1]
#: The aims whose launches also run the accurate mode's rows (split_batch): every one of the 2-host study.
SPLIT_AIMS = AIMS


def section_key(args: Dict[str, Any]) -> str:
    """A run's section of docs/benchmarks.md (from its arguments), and the name of its record and plot."""
    if args.get("hierarchical"):
        return "hierarchical"
    if args.get("models") is not None:
        return "model-zoo"
    return "throughput-offloaded" if args.get("offload_compute") else "throughput"


@dataclass(frozen=True)
class Setting:
    hosts: int
    rate: str      # tc rate: "250mbit", "1gbit", ...
    batch: int     # per rank: sets the compute time
    target: Optional[float] = None  # the comm/compute aimed at (None: a fixed --settings rate)
    model: Optional[str] = None     # a model-zoo shape (benchmarks/models.py); None: Linear layers

    @classmethod
    def parse(cls, hosts: int, spec: str) -> "Setting":
        rate, _, batch = spec.partition(":")
        if not batch.isdigit():
            raise ValueError(f"not RATE:BATCH: {spec!r}; write e.g. 620mbit:1024")
        rate_bps(rate)
        return cls(hosts, rate, int(batch))


def launch_configs(configs: Sequence[str], setting: Setting) -> List[str]:
    """A launch's configurations: split_batch rows only at ``SPLIT_AIMS`` and at fixed rates (and in
    every model-zoo launch)."""
    split = setting.model is not None or (
        setting.hosts == 2 and (setting.target is None or setting.target in SPLIT_AIMS))
    return [k for k in configs if split or not k.startswith("w2-split-")]


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def relayed(path: Path) -> Iterator[None]:
    """Copies the lines rank 0 appends to ``path`` to stderr as they come: a launch's own output comes
    back only at its end. (Rank 0 once appended to this process's stderr by its /proc path: where
    that was a file opened without O_APPEND, this process's next lines overwrote them.)"""
    path.touch()
    stop = threading.Event()

    def relay() -> None:
        with open(path) as f:
            while not stop.wait(1.0):
                sys.stderr.write(f.read())
                sys.stderr.flush()
            sys.stderr.write(f.read())

    thread = threading.Thread(target=relay, name="bench-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def horovod_cycle_env(cycle_ms: float) -> Dict[str, str]:
    """The workers' HOROVOD_CYCLE_TIME: ``cycle_ms`` > 0 sets it; 0 leaves Horovod's default (the
    variable must then be unset here, or every rank would inherit it)."""
    if cycle_ms > 0:
        return {"HOROVOD_CYCLE_TIME": f"{cycle_ms:g}"}
    if "HOROVOD_CYCLE_TIME" in os.environ:
        raise ValueError("--horovod-cycle-ms 0 asks for Horovod's default cycle, but HOROVOD_CYCLE_TIME="
                         f"{os.environ['HOROVOD_CYCLE_TIME']} is set in this environment: unset it, or pass its "
                         "value as --horovod-cycle-ms")
    return {}


def device_times(text: str) -> List[float]:
    """``--device-times``: "FORWARD,BACKWARD" in seconds, each finite and >= 0."""
    times = [float(t) for t in text.split(",")]  # not a number: argparse's "invalid device_times value"
    if len(times) != 2 or not all(math.isfinite(t) and t >= 0 for t in times):
        raise argparse.ArgumentTypeError(f"not FORWARD,BACKWARD in seconds (each >= 0): {text!r}")
    return times


def hierarchical_settings(args: argparse.Namespace) -> List["Setting"]:
    """The hierarchical kind's launches: per aim, the rate at which Horovod's ring all-reduce of the
    gradient over the 4 ranks (a host's link carries 2 (N-1)/N of it) takes ``aim`` x the device times."""
    wire = wire_bits(4, 4 * args.layers * (args.dim * args.dim + args.dim))
    return [Setting(2, tc_rate(wire / (aim * sum(args.device_times))), args.batch, aim) for aim in args.aims]


def run_launch(setting: Setting, args: argparse.Namespace, configs: Sequence[str], quick: bool = False) -> Launch:
    """One launch of the worker on a fresh cluster, running ``configs`` beside compute alone."""
    from tools.cluster import gloo, horovodrun, launch
    from tools.cluster.netns import Cluster, leftover_namespaces

    what = f"{setting.hosts} hosts{' x 2 ranks' if args.hierarchical else ''}, {setting.rate}, batch {setting.batch}"
    if setting.model is not None:
        what = f"{setting.model}, {setting.hosts} hosts, {setting.rate}"
    # compute off the cores waits args.device_times (the calibration's, or --device-times) for args.batch;
    # a launch of another batch (the 4-host one) times its own passes
    fixed = args.offload_compute and args.device_times is not None and setting.batch == args.batch
    worker = {**{k: getattr(args, k) for k in ("rounds", "steps", "comm_reps", "dim", "layers", "offload_compute")},
              "batch": setting.batch, "auto_measure_steps": 5, "configs": list(configs), "quick": quick,
              "device_times": args.device_times if fixed else None,
              **(zoo.worker_settings(setting.model) if setting.model is not None else {})}
    with tempfile.TemporaryDirectory(prefix="pipesgd-bench-") as tmp:
        settings, progress = Path(tmp) / "settings.json", Path(tmp) / "progress.log"
        settings.write_text(json.dumps({**worker, "progress": str(progress)}))
        cmd = [sys.executable, "-m", "benchmarks.throughput_worker", str(settings)]
        env = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT),
               **horovod_cycle_env(args.horovod_cycle_ms), **(zoo.KEEP_FREED if setting.model is not None else {})}
        waited, busy = wait_for_quiet(args.max_quiet_wait)
        log(f"[launch] {what} (waited {waited:.0f} s for other jobs; {busy:.1f} cores busy)")
        start = time.perf_counter()
        with Cluster(setting.hosts, rate=setting.rate) as cluster, relayed(progress):
            if args.hierarchical:  # horovodrun itself: a host's ranks share its namespace, their traffic stays on it
                proc = horovodrun.run(cluster, cmd, ranks_per_host=2, env=env, timeout=args.launch_timeout)
            else:
                proc = (gloo if args.controller == "gloo" else launch).run(cluster, cmd, env=env,
                                                                           timeout=args.launch_timeout)
    left = leftover_namespaces(cluster.prefix)
    if left:
        raise RuntimeError(f"tear-down left namespaces behind: {left}")
    log(f"  {what}: {time.perf_counter() - start:.0f} s")
    for line in proc.stdout.splitlines():
        if MARKER in line:  # horovodrun tags each line with its rank
            raw = json.loads(line.split(MARKER, 1)[1])
            return Launch(setting.hosts, setting.rate, setting.batch, raw, waited, busy)
    # the rank that failed first is rarely the last to print: its errors, then the tail; the whole
    # output in a file, since the cause is often a screen above the first "Error"
    kept = ROOT / "build" / "failed-launch.log"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(f"{what}\n{proc.stdout}\n{proc.stderr}")
    first = [line for line in proc.stdout.splitlines() if "Error" in line or "error:" in line][:12]
    raise RuntimeError(f"no result (rc {proc.returncode}); the ranks' first errors:\n" + "\n".join(first)
                       + f"\n...\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\nthe whole output: {kept}")


def calibrate(args: argparse.Namespace, launch: Callable[..., Launch] = run_launch) -> Dict[str, Any]:
    """Two short launches, 2 hosts, batch ``args.batch``: compute alone and the float32 all-reduce
    alone at ``FIRST_RATE``, then at ``second_rate``; then each aim's rate (``throughput_plan``)."""
    short = argparse.Namespace(**{**vars(args), "rounds": 2, "steps": max(3, args.steps), "comm_reps": 2})

    def at(rate: str) -> Launch:
        return launch(Setting(2, rate, args.batch), short, configs=(), quick=True)

    first = at(FIRST_RATE)
    launches = [first, at(second_rate(2, first.grad_bytes, rate_bps(first.rate), first.comm("none"), first.compute,
                                      max(args.aims)))]
    points = [(la.rate, la.compute, la.comm("none")) for la in launches]
    compute = statistics.mean(c for _, c, _ in points)
    fit = fit_comm(2, first.grad_bytes, [(rate_bps(rate), t) for rate, _, t in points])
    plans = [(aim, *plan_rate(fit, aim, compute)) for aim in args.aims]
    log("  calibration: rates " + ", ".join(f"{aim:g}x -> {rate} (predicted {pred:.2f})" for aim, rate, pred in plans))
    out = {"compute_s": compute, "points": points, "fit": dataclasses.asdict(fit), "plans": plans}
    if getattr(args, "offload_compute", False):
        # the waits every aimed launch stands in for compute with: the real passes as the two
        # launches timed them (a launch that timed its own computed 186 ms where the calibration had 243)
        out["device_s"] = [statistics.mean(la.median(f"device-{k}") for la in launches) for k in ("forward", "backward")]
    return out


def measure_zoo(args: argparse.Namespace, launch: Callable[..., Launch] = run_launch,
                available: Callable[[], Optional[int]] = zoo.memory_available) -> Dict[str, Any]:
    """The model-zoo kind: per model, per host count, one launch per aim, the largest first; each
    rate planned from the model's device step, the host's update (timed here) and the fixed cost the
    model's previous launch on as many hosts measured (``throughput_zoo``)."""
    from . import models
    from .report import machine_line

    for name in args.models:  # every launch checked before the first: a refusal loses nothing measured
        for hosts in args.hosts:
            zoo.check_memory(name, 4 * models.zoo(name).parameters, hosts, available())
    load_before, start = os.getloadavg(), time.perf_counter()
    plans, settings, launches = [], [], []
    for name in args.models:
        grad_bytes, update = zoo.host_update_seconds(name)
        plan = zoo.Plan(name, grad_bytes, models.zoo(name).device_step.seconds, update)
        plans.append(plan)
        log(f"[plan] {zoo.describe(plan)}")
        for hosts in args.hosts:
            fixed = zoo.FIXED_GUESS
            for aim in zoo.order(args.aims):
                zoo.check_memory(name, grad_bytes, hosts, available())
                setting = Setting(hosts, zoo.rate_for(plan, hosts, aim, fixed), 0, aim, name)
                la = launch(setting, args, launch_configs(args.configs, setting))
                settings.append(setting)
                launches.append(la)
                fixed = zoo.measured_fixed(hosts, la.grad_bytes, setting.rate, la.comm("none"))
                ratio = la.comm("none") / la.compute
                log(f"  comm/compute {ratio:.2f}: {off_aim(ratio, aim) or f'within 20% of its aim {aim:g}'}")
    return {"machine": machine_line(), "args": vars(args), "elapsed_s": time.perf_counter() - start,
            "plans": [dataclasses.asdict(p) for p in plans], "load_before": load_before,
            "load_after": os.getloadavg(), "settings": [dataclasses.asdict(s) for s in settings],
            "launches": [dataclasses.asdict(la) for la in launches]}


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    """Runs every launch; returns the record that ``throughput_report.render`` turns into tables."""
    from .report import machine_line

    load_before, start = os.getloadavg(), time.perf_counter()
    calibration = None if args.settings or args.hierarchical else calibrate(args)
    if args.settings:
        settings = [Setting.parse(2, spec) for spec in args.settings]
    elif args.hierarchical:
        settings = hierarchical_settings(args)
    else:
        args.device_times = args.device_times or calibration.get("device_s")
        settings = [Setting(2, rate, args.batch, aim) for aim, rate, _ in calibration["plans"]]
    if args.four_hosts:
        settings.append(Setting.parse(4, args.four_hosts))
    launches = []
    for s in settings:
        launches.append(run_launch(s, args, launch_configs(args.configs, s)))
        if s.target is not None:
            ratio = launches[-1].comm("none") / launches[-1].compute
            log(f"  comm/compute {ratio:.2f}: {off_aim(ratio, s.target) or f'within 20% of its aim {s.target:g}'}")
    return {"machine": machine_line(), "args": vars(args), "elapsed_s": time.perf_counter() - start,
            "calibration": calibration, "load_before": load_before, "load_after": os.getloadavg(),
            "settings": [dataclasses.asdict(s) for s in settings], "launches": [dataclasses.asdict(la) for la in launches]}


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line, each kind's defaults applied and checked (``main``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hierarchical", action="store_true", help="2 hosts x 2 ranks, flat and hierarchical "
                        "(defaults: --aims 1 5 --layers 2 --steps 10 --device-times 0.03,0.07)")
    parser.add_argument("--models", nargs="*", metavar="NAME",
                        help="the model-zoo kind: these models (none named: resnet50 bert-base gpt2) at real size, compute "
                             "off the cores at a published GPU step time, on --hosts (defaults: --aims 1 5 --rounds 2 "
                             f"--steps 3 --configs {' '.join(zoo.CONFIGS)})")
    parser.add_argument("--hosts", nargs="+", type=int, default=list(zoo.HOSTS), metavar="N",
                        help="the model-zoo kind's host counts (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed updates per configuration per round")
    parser.add_argument("--comm-reps", type=int, default=1, help="collective timings per round")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--aims", nargs="+", type=float, default=list(AIMS), metavar="X",
                        help="comm/compute of the 2-host launches, one launch each (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1024, help="per rank, in the 2-host launches")
    parser.add_argument("--settings", nargs="+", metavar="RATE:BATCH",
                        help="fixed 2-host launches instead of --aims (no calibration), e.g. 620mbit:1024")
    parser.add_argument("--configs", nargs="+", metavar="NAME",
                        help=f"only these (and Horovod's; with auto those it chooses from): {', '.join((*TRAINING, AUTO))}")
    parser.add_argument("--four-hosts", default="620mbit:512", help="RATE:BATCH of the 4-host launch ('' skips it)")
    parser.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    parser.add_argument("--horovod-cycle-ms", type=float, default=20.0,
                        help="HOROVOD_CYCLE_TIME of every rank (0: Horovod's default)")
    parser.add_argument("--offload-compute", action="store_true",
                        help="forward and backward passes as waits of their measured times, off the cores")
    parser.add_argument("--device-times", type=device_times, metavar="FORWARD,BACKWARD",
                        help="compute off the cores: these waits, in seconds, instead of the calibration's")
    parser.add_argument("--launch-timeout", type=float, default=1800)
    parser.add_argument("--max-quiet-wait", type=float, default=45,
                        help="seconds to wait before each launch for other jobs to leave the cores idle")
    parser.add_argument("--no-doc", action="store_true", help="print the tables; leave docs/ alone")
    parser.add_argument("--render", metavar="JSON", help="no launches: the tables from a saved record")
    args = parser.parse_args(argv)
    if args.models is not None and args.hierarchical:
        parser.error("--models plans its own launches, one rank per host: drop --hierarchical")
    hier = ["horovod", *HIERARCHICAL]
    if args.hierarchical:  # the kind's own defaults; flags given still win
        parser.set_defaults(aims=[1.0, 5.0], layers=2, steps=10, device_times=[0.03, 0.07], offload_compute=True,
                            four_hosts="", configs=hier)
        args = parser.parse_args(argv)
        if args.configs != hier or args.controller != "gloo":
            parser.error("--hierarchical runs its own configurations under horovodrun --gloo: drop --configs / --controller")
    elif args.models is not None:  # the model-zoo kind's own defaults; flags given still win
        parser.set_defaults(aims=list(zoo.AIMS), rounds=2, steps=3, configs=list(zoo.CONFIGS), offload_compute=True,
                            four_hosts="")
        args = parser.parse_args(argv)
        if args.hierarchical or args.settings or args.device_times is not None or args.controller != "gloo":
            parser.error("--models plans its own launches under the Gloo controller, compute off the cores at each "
                         "model's device step: drop --hierarchical / --settings / --device-times / --controller")
        if not args.offload_compute:
            parser.error("--models runs with compute off the cores")
        try:
            from . import models

            args.models = models.sequence(args.models) if args.models else list(models.names())
        except ValueError as e:
            parser.error(str(e))
        if not args.hosts or any(h < 2 for h in args.hosts):
            parser.error(f"--hosts must be >= 2 each, got {args.hosts}")
    elif args.device_times is not None and not args.offload_compute:
        parser.error("--device-times sets the waits of compute off the cores: add --offload-compute")
    try:
        args.configs = hier if args.hierarchical else list(select_configs(args.configs))
        for spec in [*(args.settings or []), args.four_hosts]:
            if spec:
                Setting.parse(2, spec)
        if args.horovod_cycle_ms < 0:
            raise ValueError(f"--horovod-cycle-ms must be >= 0 (0: Horovod's default), got {args.horovod_cycle_ms:g}")
        if not args.render:
            horovod_cycle_env(args.horovod_cycle_ms)
    except ValueError as e:
        parser.error(str(e))
    if not all(aim > 0 for aim in args.aims):
        parser.error(f"--aims must be > 0, got {args.aims}")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse(argv)
    from .report import write_section
    from .throughput_report import render, render_hierarchical, render_zoo

    if args.render:
        record = json.loads(Path(args.render).read_text())
    else:
        if os.geteuid() != 0:
            sys.exit("benchmarks.throughput creates network namespaces: run it as root")
        record = measure_zoo(args) if args.models is not None else measure(args)
        # a --no-doc trial's record apart: it never replaces the doc's
        saved = ROOT / "build" / f"{section_key(vars(args))}{'-nodoc' if args.no_doc else ''}.json"
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(record))
        print(f"samples kept in {saved}")
    key = section_key(record["args"])
    renderer = {"hierarchical": render_hierarchical, "model-zoo": render_zoo}.get(key, render)
    text = renderer(record, None if args.no_doc else ROOT / "docs" / "img" / f"{key}.png")
    if not args.no_doc:
        write_section(key, text)
    print(text)


if __name__ == "__main__":
    main()
