"""Throughput on the emulated cluster: Horovod's synchronous optimizer against pipesgd_hvd.

    python -m benchmarks.throughput            (as root; `make bench` runs it)

One 2-host launch per aim (comm/compute of 0.25x, 1x, 2.5x and 5x), ranks one per host on
network namespaces with ``tc tbf`` links (``benchmarks/cluster``); then one launch on 4 hosts and
a Gloo-vs-MPI controller check. Each aim's link rate comes from a calibration that runs first
(two short launches: compute alone and the float32 all-reduce alone at two rates, the second
about where the largest aim lands; ``benchmarks/throughput_plan.py`` fits them and solves for
the rate), so the aims hold on any CPU; each launch reports the comm/compute it measured and says when it missed its aim by more
than 20%. Inside a launch every configuration runs side by side, interleaved in rounds
(``benchmarks/throughput_worker.py``); the analysis, the timing model's predictions and the
targets are in ``benchmarks/throughput_analysis.py``. Writes the "throughput" section of
docs/benchmarks.md and docs/img/throughput.png; with ``--offload-compute`` (forward and backward
passes as waits of their measured times, ``benchmarks/offloaded_compute.py``) the
"throughput-offloaded" section and docs/img/throughput-offloaded.png.

Subsets and overrides (the section then holds only what ran; keep such runs out of docs/ with
``--no-doc``)::

    python -m benchmarks.throughput --aims 1 5 --configs w2 w2-int8     # Horovod always runs too
    python -m benchmarks.throughput --settings 620mbit:1024 155mbit:512 # fixed RATE:BATCH, no calibration
    python -m benchmarks.throughput --four-hosts '' --controller-check ''  # 2-host launches only
    python -m benchmarks.throughput --horovod-cycle-ms 0   # Horovod's default cycle (default: 20 ms)
    python -m benchmarks.throughput --offload-compute      # compute off the cores, as on an accelerator

Every rank runs with ``HOROVOD_CYCLE_TIME=20``, Horovod's synchronous optimizer included: the
README's advice for CPU machines whose ranks fill the cores, where Horovod's background loop,
awake every cycle, takes the core compute needs.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .throughput_analysis import (LABELS, Launch, Model, Target, auto_target, background_cpu, fit_model,
                                  over_bound, phase_rates, speedup, targets, width1_buckets)
from .throughput_plan import (AIMS, FIRST_RATE, CommFit, fit_comm, off_aim, plan_rate, rate_bps, second_rate,
                              select_configs)
from .throughput_worker import AUTO, CODECS, MARKER, TRAINING

ROOT = Path(__file__).resolve().parents[1]


def section_key(offloaded: bool) -> str:
    """The run's section of docs/benchmarks.md; its samples go to build/<key>.json, its plot to
    docs/img/<key>.png (a run with compute off the cores keeps its own, beside the real one's)."""
    return "throughput-offloaded" if offloaded else "throughput"


def record_path(key: str, no_doc: bool = False) -> Path:
    """Where a run's raw samples are kept (a --no-doc trial's apart: it never replaces the record
    behind the doc's section)."""
    return ROOT / "build" / (f"{key}-nodoc.json" if no_doc else f"{key}.json")


def image_path(key: str) -> Path:
    return ROOT / "docs" / "img" / f"{key}.png"


@dataclass(frozen=True)
class Setting:
    hosts: int
    rate: str      # tc rate: "250mbit", "1gbit", ...
    batch: int     # per rank: sets the compute time
    aim: str       # in words, for the report
    target: Optional[float] = None  # the comm/compute aimed at (None: a fixed --settings rate)

    @classmethod
    def parse(cls, hosts: int, spec: str, aim: str) -> "Setting":
        rate, _, batch = spec.partition(":")
        if not batch.isdigit():
            raise ValueError(f"not RATE:BATCH: {spec!r}; write e.g. 620mbit:1024")
        return cls(hosts, rate, int(batch), aim)


def wait_for_quiet(max_wait: float, idle_cores: float = 1.5, window: float = 2.0) -> Tuple[float, float]:
    """Waits (at most ``max_wait`` s) until other jobs leave ``idle_cores`` of the machine idle over
    ``window`` s, so that a launch does not start in the middle of someone's test run; returns
    (seconds waited, busy cores in the last window). The cores are shared: this only lowers the odds."""
    from .throughput_worker import machine_busy

    start = time.monotonic()
    while True:
        busy0, total0 = machine_busy()
        time.sleep(window)
        busy1, total1 = machine_busy()
        cores = os.cpu_count() or 1
        busy = (busy1 - busy0) / max(total1 - total0, 1e-9) * cores
        waited = time.monotonic() - start
        if cores - busy >= idle_cores or waited >= max_wait:
            return waited, busy


class Progress:
    """One line per launch as it starts (elapsed, ETA of the whole run from the launches done so
    far) and the worker's lines as its rounds end (a launch takes minutes; its stdout comes back
    only at the end): rank 0 appends them to a file, a thread here echoes them to stderr."""

    def __init__(self, launches: int) -> None:
        self.total, self.done, self.start = launches, 0, time.perf_counter()
        self.durations: List[float] = []

    def begin(self, what: str) -> None:
        elapsed = time.perf_counter() - self.start
        eta = (f"ETA ~{sum(self.durations) / len(self.durations) * (self.total - self.done) / 60:.1f} min"
               if self.durations else "ETA after the first launch")
        print(f"[launch {self.done + 1}/{self.total}, {elapsed / 60:.1f} min in, {eta}] {what}", file=sys.stderr,
              flush=True)

    def end(self, seconds: float) -> None:
        self.done += 1
        self.durations.append(seconds)

    @staticmethod
    @contextlib.contextmanager
    def echo(path: Path, prefix: str) -> Iterator[None]:
        """Echoes the lines appended to ``path`` while the block runs."""
        stop = threading.Event()

        def tail() -> None:
            seen = 0
            while True:
                stopping = stop.wait(2.0)
                text = path.read_text() if path.exists() else ""
                for line in text[seen:].splitlines():
                    print(f"{prefix}{line}", file=sys.stderr, flush=True)
                seen = len(text)
                if stopping:
                    return

        thread = threading.Thread(target=tail, name="bench-progress", daemon=True)
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


def cycle_line(cycle_ms: float) -> str:
    """How the launches set Horovod's cycle, in words (a record from before the option ran at
    Horovod's default)."""
    if cycle_ms <= 0:
        return "Horovod's default cycle (`HOROVOD_CYCLE_TIME` unset)"
    return (f"`HOROVOD_CYCLE_TIME={cycle_ms:g}` for every rank, Horovod's synchronous optimizer included, as the "
            "README advises on CPU machines whose ranks fill the cores: Horovod's background loop wakes every "
            "cycle, op or not, on the core compute needs (section \"cycle time\"); `--horovod-cycle-ms 0` runs "
            "Horovod's default")


def offload_flags(args: argparse.Namespace, batch: int) -> List[str]:
    """The worker's flags for compute off the cores: its waits fixed once the calibration has
    measured them (``args.device_times``, for ``args.batch``), so that every aimed launch waits the
    same; a launch of another batch (the 4-host one) times its own."""
    if not getattr(args, "offload_compute", False):
        return []
    times = getattr(args, "device_times", None)
    fixed = times is not None and batch == args.batch
    return ["--offload-compute", *(["--device-times", ",".join(f"{t:.6f}" for t in times)] if fixed else [])]


def run_launch(setting: Setting, args: argparse.Namespace, controller: str = "", quick: bool = False,
               progress: Optional[Progress] = None, configs: Optional[Sequence[str]] = None) -> Launch:
    """One launch of the worker on a fresh cluster; ``configs`` (default ``args.configs``) are the
    configurations it runs beside compute alone."""
    from .cluster import gloo, launch
    from .cluster.netns import Cluster, leftover_namespaces

    what = f"{setting.hosts} hosts, {setting.rate}, batch {setting.batch}{', ' + controller if controller else ''}"
    if progress is not None:
        progress.begin(what)
    with tempfile.TemporaryDirectory(prefix="pipesgd-bench-") as tmp:
        lines = Path(tmp) / "progress"
        cmd = [sys.executable, "-m", "benchmarks.throughput_worker", "--rounds", str(args.rounds), "--steps",
               str(args.steps), "--comm-reps", str(args.comm_reps), "--batch", str(setting.batch), "--dim",
               str(args.dim), "--layers", str(args.layers), "--progress", str(lines),
               "--configs", ",".join(args.configs if configs is None else configs)] + (["--quick"] if quick else []) \
            + offload_flags(args, setting.batch)
        env = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT),
               **horovod_cycle_env(args.horovod_cycle_ms)}
        waited, busy = wait_for_quiet(args.max_quiet_wait)
        start = time.perf_counter()
        with Cluster(setting.hosts, rate=setting.rate) as cluster, Progress.echo(lines, "    "):
            runner = gloo if (controller or args.controller) == "gloo" else launch
            proc = runner.run(cluster, cmd, env=env, timeout=args.launch_timeout)
    if progress is not None:
        progress.end(time.perf_counter() - start + waited)
    left = leftover_namespaces(cluster.prefix)
    if left:
        raise RuntimeError(f"tear-down left namespaces behind: {left}")
    print(f"  {what}: {time.perf_counter() - start:.0f} s "
          f"(after waiting {waited:.0f} s for other jobs; {busy:.1f} cores busy at the start)", file=sys.stderr, flush=True)
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return Launch(setting.hosts, setting.rate, setting.batch, json.loads(line[len(MARKER):]), waited, busy)
    raise RuntimeError(f"no result (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


# --------------------------------------------------------------------------------- the report
def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def cpu_cell(la: Launch, key: str) -> str:
    """A training segment's CPU per step: compute thread / other threads (Horovod's among them,
    where the record tells them apart) / the machine's busy cores."""
    main, other = la.cpu_per_step(key)
    hvd = la.horovod_cpu(key)
    return f"{ms(main)} / {ms(other)}{'' if hvd is None else f' ({ms(hvd)})'} / {la.machine_cores(key):.2f}"


def launch_block(setting: Setting, la: Launch, model: Model) -> str:
    from .report import table

    rows = []
    for key in ("compute", *la.configs):
        t = la.median(key)
        cpu = cpu_cell(la, key)
        if key == "compute":
            rows.append(["compute alone (no communication)", ms(t), "", "", "", "", "", "", cpu])
            continue
        loop = f"{ms(la.loop(key))} ({t / la.loop(key):.2f})" if key.startswith("w2") else ""
        rows.append([LABELS[key], ms(t), f"{speedup(la, key):.2f}x", ms(la.bound(key)), f"{la.bound(key) / t:.0%}",
                     loop, ms(model.step[key]), f"{t / model.step[key]:.2f}", cpu])
    if la.auto is not None:
        key, t = la.auto_choice(), la.median(AUTO)
        rows.append([f"pipesgd auto (chose: {LABELS[key].replace('pipesgd ', '')})", ms(t), f"{speedup(la, AUTO):.2f}x",
                     ms(la.bound(key)), f"{la.bound(key) / t:.0%}", "", ms(model.step[key]), f"{t / model.step[key]:.2f}",
                     cpu_cell(la, AUTO)])
    head = ["configuration", "step ms", "speed-up vs Horovod", "bound ms", "bound / step",
            "engine-free loop ms (step / loop)", "model ms", "step / model",
            "CPU per step: compute thread ms / other threads ms (Horovod's) / machine cores busy"]
    codec_rows = []
    for c in ("none", *la.codecs):
        key = "w2" if c == "none" else f"w2-{c}"
        if key not in la.configs:
            continue
        hvd = la.horovod_cpu(f"comm-{c}")
        codec_rows.append([c, ms(la.comm(c)), ms(la.comm_cpu(c)), "-" if hvd is None else ms(hvd),
                           ms(background_cpu(la, la.comm(c))),
                           ms(la.median(f"codec-{c}")) if c != "none" else "-",
                           f"{model.codecs[c].cost_per_byte * 1e9:.2f}", ms(model.comm[c]),
                           f"{model.interference[c]:.2f}", f"{la.raw['wire_ratio'][key]:.3f}"])
    codec_head = ["codec", "all-reduce alone ms", "its CPU ms (all threads of a rank)", "of which Horovod's threads, ms",
                  "all threads' idle CPU over "
                  "as long, ms", "encode + decode of the gradient, "
                  "one rank, ms", "cost beyond the wire ns/B", "model all-reduce ms", "interference f",
                  "wire bytes vs fp32"]
    link = model.link
    main_c, other_c = la.cpu_per_step("compute")
    return "\n".join([
        f"**{setting.hosts} hosts, {setting.rate} links, batch {setting.batch}** ({setting.aim}): compute alone "
        f"{ms(la.compute)} ms (forward {ms(la.median('forward'))}, backward {ms(la.median('backward'))}, update "
        f"{ms(la.median('update'))}); float32 all-reduce alone {ms(la.comm('none'))} ms: **comm/compute "
        f"{la.comm('none') / la.compute:.2f}**{aim_note(setting, la)}. Other jobs took {la.foreign_share():.0%} of "
        "the machine's busy CPU "
        f"time during this launch ({la.busy_at_start:.1f} cores busy when it started, after waiting {la.waited:.0f} s "
        f"for a quieter moment); " + (
            f"computing alone (off the cores) a rank used {ms(main_c)} ms CPU per step on the compute thread, "
            f"{ms(other_c)} ms on the others." if la.offloaded else
            f"computing alone a rank got {la.core_share():.0%} of a core "
            f"({ms(main_c)} ms CPU on the compute thread, {ms(other_c)} ms on the others per step)."),
        "", table(head, rows), "", table(codec_head, codec_rows), "",
        f"Link fit (`fit_link` on float32 all-reduces of {la.grad_bytes / 1e6:.1f} MB, a quarter of it and 1 KB, "
        f"and a float32 add): alpha {link.alpha * 1e6:.0f} us, bandwidth {link.bandwidth * 8 / 1e9:.2f} Gbit/s, "
        f"gamma {link.gamma * 1e9:.3f} ns/B. Sent per rank: "
        + ", ".join(f"{k} {v / 1e6:.0f} Mbit/s" for k, v in phase_rates(la).items())
        + f" (link {setting.rate}; alltoall and allgather of int8-sized chunks on the pipeline channel, TCP: one "
        "chunk each way at once between ranks 0 and 1). "
        f"Horovod's sync step hid {la.horovod_hidden():.0%} of the float32 all-reduce behind the backward pass "
        f"(compute + all-reduce - step, over the all-reduce); the model's overlap h = "
        f"{model.overlap['horovod']:.0%} (pipesgd width 1, from its buckets: {model.overlap['w1']:.0%}).",
        *(["", auto_paragraph(la)] if la.auto is not None else []),
    ])


def aim_note(setting: Setting, la: Launch) -> str:
    """After the measured comm/compute: whether it is within 20% of the launch's aim."""
    if setting.target is None:
        return ""
    miss = off_aim(la.comm("none") / la.compute, setting.target)
    return f" (**{miss}**)" if miss else f" (aim {setting.target:g}: within 20%)"


def aim_targets(settings: Sequence[Setting], launches: Sequence[Launch]) -> List[Target]:
    """Every aimed launch's measured comm/compute within 20% of its aim (the calibration's target)."""
    out = []
    for s, la in zip(settings, launches):
        if s.target is not None:
            ratio = la.comm("none") / la.compute
            miss = off_aim(ratio, s.target)
            out.append(Target(f"{la.hosts} hosts, {la.rate}: comm/compute within 20% of its aim {s.target:g}",
                              miss is None, f"{ratio:.2f}", "" if miss is None else
                              f"comm/compute {ratio:.2f} {miss}; compute alone {ms(la.compute)} ms, float32 "
                              f"all-reduce alone {ms(la.comm('none'))} ms"))
    return out


def calibration_block(calibration: Optional[Dict[str, Any]]) -> str:
    if calibration is None:
        return "Link rates: fixed by `--settings` (no calibration)."
    fit = CommFit(**calibration["fit"])
    plans = ", ".join(f"{aim:g}x: {rate} (predicted {pred:.2f})" for aim, rate, pred in calibration["plans"])
    return (f"Link rates from a calibration run first (`benchmarks/throughput_plan.py`): two short launches at "
            f"{' and '.join(r for r, _, _ in calibration['points'])}, "
            f"{calibration_line(calibration['compute_s'], calibration['points'], fit)}; the rate for comm/compute "
            f"X solves fixed + wire / (share x rate) = X x compute, rounded to 3 digits. Aims: {plans}.")


def auto_paragraph(la: Launch) -> str:
    """What the auto optimizer measured (slowest rank) and why it chose what it chose."""
    a = la.auto
    assert a is not None
    m, d = a["measurements"], a["decision"]
    judged = auto_target(la)
    timed = ", ".join(f"{'float32' if c == 'none' else c} {ms(t)} ms (CPU {ms(m['reduction_cpu_s'].get(c, 0.0))})"
                      for c, t in m["reduction_s"].items())
    predicted = ", ".join(f"{k} {ms(v)}" for k, v in d["predicted_s"].items())
    return (f"*Auto mode* (`width=\"auto\", compression=\"auto\"`, decided at step {a['step']}, "
            f"{a['seconds']:.1f} s after its first step): compute {ms(m['compute_s'])} ms/step; reductions timed "
            f"(slowest rank): {timed}; predicted steps, ms: {predicted}. **Chose width {d['width']} + "
            f"{d['compression']}**: {d['reason']}. Timed as chosen, against the fastest fixed configuration it "
            f"could have chosen: {judged.measured} ({'within' if judged.met else 'not within'} 10%"
            + (f"; {judged.cause})" if judged.cause else ")") + ".")


def controller_block(spec: str, pair: Sequence[Launch]) -> str:
    """Horovod's Gloo controller (our launcher) against its MPI controller (mpirun through
    rsh_agent.sh), back to back, same link and batch."""
    from .report import table

    rows = []
    for name, la in zip(("Gloo (benchmarks/cluster/gloo.py)", "MPI (mpirun, benchmarks/cluster/launch.py)"), pair):
        main, other = la.cpu_per_step("compute")
        rows.append([name, ms(la.compute), f"{ms(main)} / {ms(other)}", ms(la.comm("none")), ms(la.median("horovod")),
                     ms(la.median("w2"))])
    return (f"**Which controller.** Two short launches back to back, 2 hosts, {spec.replace(':', ' links, batch ')}, "
            f"{len(pair[0].samples('compute'))} timed steps per configuration:\n\n"
            + table(["Horovod controller (launcher)", "compute alone ms", "its CPU per step: compute thread / others ms",
                     "float32 all-reduce alone ms", "Horovod sync step ms", "pipesgd width 2 step ms"], rows)
            + "\n\nShare of the all-reduce that width 2 hid behind compute ((compute + all-reduce - step) / "
            "all-reduce): " + ", ".join(f"{name} {hid:.0%}" for name, hid in zip(("Gloo", "MPI"), map(hidden_w2, pair)))
            + ". The launches above use the Gloo controller; `--controller mpi` runs them under mpirun.")


def hidden_w2(la: Launch) -> float:
    return (la.compute + la.comm("none") - la.median("w2")) / la.comm("none")


def share_of_tcp(launches: Sequence[Launch]) -> str:
    """Each Horovod collective's rate as a share of the plain TCP exchange's, over ``launches``."""
    shares: Dict[str, List[float]] = {}
    for la in launches:
        rates = phase_rates(la)
        if "plain TCP" not in rates:
            continue
        for k in ("float32 all-reduce", "alltoall", "allgather"):
            shares.setdefault(k, []).append(rates[k] / rates["plain TCP"])
    if not shares:
        return ""
    return ("Against a plain TCP exchange on the same link (both directions at once, as a 2-rank alltoall), "
            "Horovod's float32 all-reduce and the pipeline channel's phases: " + ", ".join(f"{k} reached {min(v):.0%}-{max(v):.0%}" for k, v in shares.items()) + ".")


def loop_misses(launches: Sequence[Launch]) -> str:
    """Of the width-2 rows that missed their bound by more than 10%, how many the engine-free loop
    missed too: where it did, the machine is the limit; where it did not, the engine."""
    missed = [(la, k) for la in launches for k in la.configs
              if k.startswith("w2") and over_bound(la.bound(k), la.median(k))]
    if not missed:
        return "Every width-2 row came within 10% of its bound."
    both = sum(over_bound(la.bound(k), la.loop(k)) for la, k in missed)
    return (f"Of the {len(missed)} width-2 rows more than 10% over their bound, the engine-free loop was too in "
            f"{both}.")


def findings(launches: Sequence[Launch]) -> str:
    """What the launches together show, in numbers from this run."""
    two = [la for la in launches if la.hosts == 2]
    plan = width1_buckets(int(two[0].raw["layers"]), two[0].grad_bytes)["w1"] if two else []
    ratios = [la.median(k) / la.loop(k) for la in launches for k in la.configs if k.startswith("w2")]
    width1 = "; ".join(f"{la.rate}: width 1 {la.median('w1') / la.median('horovod'):.2f}"
                       + (f", one bucket per layer {la.median('w1-layer') / la.median('horovod'):.2f}"
                          if "w1-layer" in la.configs else "") + f" (Horovod hid {la.horovod_hidden():.0%})"
                       for la in two if "w1" in la.configs)
    codecs = [c for c in CODECS if all(c in la.codecs for la in two)]
    cpu = ", ".join(f"{c} {ms(statistics.median(la.comm_cpu(c) for la in two))}" for c in ("none", *codecs))
    idle = [background_cpu(la, 1.0) for la in two]
    own = ", ".join(f"{c} {ms(statistics.median(la.reduction_cpu(c) for la in two))}" for c in codecs)
    busy = [la.machine_cores(k) for la in two for k in la.configs
            if k.startswith("w2-") and over_bound(la.bound(k), la.median(k))]
    rates = "; ".join(f"{la.rate}: " + ", ".join(f"{k} {v / 1e6:.0f}" for k, v in phase_rates(la).items()) for la in two)
    slow = max(two, key=lambda la: la.comm("none") / la.compute) if two else None
    offloaded = any(la.offloaded for la in launches)
    lines = [
        f"- **Engine overhead.** In the {len(ratios)} width-2 rows the engine's step was {min(ratios):.2f}-"
        f"{max(ratios):.2f}x (median {statistics.median(ratios):.2f}) that of the same schedule without the engine "
        "(compute, start this step's all-reduce, wait for the previous one; it reduces buffers filled once, so the "
        f"engine's copy of the gradient into its buckets is part of the difference). {loop_misses(launches)}"
        if ratios else "- No width-2 rows ran (`--configs`).",
        f"- **Width 1 against Horovod** (step / Horovod's step): {width1}. Horovod starts each layer's all-reduce "
        f"as its gradient is ready; pipesgd's default fusion plan puts the {two[0].grad_bytes / 1e6:.1f} MB gradient "
        f"in {len(plan)} buckets (MB: {', '.join(f'{x * two[0].grad_bytes / 1e6:.1f}' for x in plan)}, in launch "
        "order), each started once its gradients are in; the other width-1 row caps buckets at one layer."
        if width1 else "- **Width 1 against Horovod**: not run (`--configs`).",
        f"- **{'Compute off the cores' if offloaded else 'One core per rank'}.** An all-reduce alone cost a rank "
        f"this much CPU, all its threads (median over the "
        f"2-host launches, ms): {cpu}; the byte codecs' without Horovod's threads (its loop runs beside them, op or "
        f"not): {own}. With nothing to do the threads burned "
        f"{min(idle, default=0) * 1e3:.0f}-{max(idle, default=0) * 1e3:.0f} ms per second (Horovod's background "
        "loop). "
        + ("Compute waits on its stand-in device and holds no core, so that CPU takes nothing from it: a pipelined "
           "step can reach max(compute, its all-reduce)" if offloaded else
           "Compute owns the core, so that CPU is taken from it: a pipelined step cannot beat compute + that CPU, "
           "whatever the link (section \"throughput-offloaded\": the same launches with compute off the cores)")
        + (f"; the machine was {min(busy):.1f}-{max(busy):.1f} cores busy in the pipelined rows that missed their "
           "bound." if busy else "."),
        f"- **The compressed all-reduce's wire.** Sent per rank, Mbit/s: {rates}. "
        + share_of_tcp(two)
        + (f" At {slow.rate} the int8 all-reduce took {ms(slow.comm('int8'))} ms against {ms(slow.comm('none'))} ms "
           f"for float32: {slow.comm('none') / slow.comm('int8'):.1f}x faster for "
           f"{1 / slow.raw['wire_ratio']['w2-int8']:.1f}x fewer bytes." if slow and "int8" in slow.codecs else ""),
    ]
    for la in (x for x in launches if x.hosts > 2):
        ref = min(two, key=lambda t: abs(t.comm("none") / t.compute - la.comm("none") / la.compute)) if two else None
        per_sample = (f"; compute per sample took {la.compute / la.batch / (ref.compute / ref.batch):.1f}x its time on "
                      f"2 hosts ({ref.rate})") if ref else ""
        lines.append(
            f"- **{la.hosts} hosts on {os.cpu_count()} cores.** Computing alone a rank got {la.core_share():.0%} of a "
            f"core{per_sample}. Every rank's codec and transport CPU competes with the other ranks' compute, and "
            "steps stretch whenever one rank is descheduled; the ratios show the shape of the curves, not what "
            f"{la.hosts} real hosts would reach.")
    return "\n".join(lines)


def targets_block(found: Sequence[Target]) -> str:
    from .report import table

    rows = [[t.name, "met" if t.met else "**missed**", t.measured, t.cause] for t in found]
    met = sum(t.met for t in found)
    return f"{met} of {len(found)} targets met.\n\n" + table(["target", "result", "measured", "measured cause"], rows)


def profile_block(la: Launch) -> str:
    from .report import table

    prof = la.raw.get("int8_profile") or []
    if not prof:
        return ""
    total = sum(p[1] for p in prof)
    return (f"Where the int8 codec's CPU goes ({la.hosts} hosts, {la.rate}): `torch.profiler`, one compressed "
            f"all-reduce of the {la.grad_bytes / 1e6:.1f} MB gradient on rank 0, self CPU time of the top tensor ops "
            f"({total:.0f} ms together; waits on the wire are not tensor ops):\n\n"
            + table(["op", "self CPU ms", "calls"], [[name, f"{t:.1f}", count] for name, t, count in prof]))


def plot(settings: Sequence[Setting], launches: Sequence[Launch], models: Sequence[Model], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(10, 4.2))
    ax = fig.add_subplot()
    width = 0.8 / len(launches)
    keys = [k for k in TRAINING if any(k in la.configs for la in launches)] + [AUTO]
    for i, (s, la, model) in enumerate(zip(settings, launches, models)):
        shown = [k for k in keys if k in la.configs or (k == AUTO and la.auto is not None)]
        xs = [keys.index(k) + i * width for k in shown]
        label = f"{s.hosts} hosts, {s.rate} (comm/compute {la.comm('none') / la.compute:.2f})"
        ax.bar(xs, [speedup(la, k) for k in shown], width, label=label, color=f"C{i}")
        # the auto bar's model mark is that of the configuration it chose
        predicted = [model.step[la.auto_choice() if k == AUTO else k] for k in shown]
        ax.scatter(xs, [model.step["horovod"] / p for p in predicted], marker="_", s=120, color="black",
                   zorder=3, label="model" if i == 0 else None)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
    ax.set_xticklabels([LABELS[k].replace("pipesgd ", "").replace(" DistributedOptimizer (sync)", " (sync)")
                        for k in keys], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("speed-up over Horovod sync")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


CALIBRATION_LAUNCHES = 2


def calibrate(args: argparse.Namespace, progress: Optional[Progress], launch: Optional[Callable[..., Launch]] = None
              ) -> Dict[str, Any]:
    """Two short launches (``launch``, default :func:`run_launch`), 2 hosts, batch ``args.batch``:
    compute alone and the float32 all-reduce alone at ``FIRST_RATE``, then at ``second_rate``;
    then each aim's rate (``throughput_plan``)."""
    short = argparse.Namespace(**{**vars(args), "rounds": 2, "steps": max(3, args.steps), "comm_reps": 2})

    def at(rate: str) -> Launch:
        return (launch or run_launch)(Setting(2, rate, args.batch, "calibration"), short, quick=True,
                                      progress=progress, configs=())

    first = at(FIRST_RATE)
    launches = [first, at(second_rate(2, first.grad_bytes, rate_bps(first.rate), first.comm("none"), first.compute,
                                      max(args.aims)))]
    runs = [(la.rate, la.compute, la.comm("none")) for la in launches]
    compute = sum(c for _, c, _ in runs) / len(runs)
    fit = fit_comm(2, launches[0].grad_bytes, [(rate_bps(rate), t) for rate, _, t in runs])
    plans = [(aim, *plan_rate(fit, aim, compute)) for aim in args.aims]
    print(f"  calibration: {calibration_line(compute, runs, fit)}; rates: "
          + ", ".join(f"{aim:g}x -> {rate} (predicted {pred:.2f})" for aim, rate, pred in plans),
          file=sys.stderr, flush=True)
    out = {"compute_s": compute, "points": runs, "fit": dataclasses.asdict(fit), "plans": plans}
    if getattr(args, "offload_compute", False):
        # the waits every aimed launch stands in for compute with: the real passes as the two launches
        # timed them (a launch that timed its own computed 186 ms where the calibration had 243)
        out["device_s"] = [statistics.mean(la.median(f"device-{k}") for la in launches) for k in ("forward", "backward")]
    return out


def calibration_line(compute: float, points: Sequence[Tuple[str, float, float]], fit: CommFit) -> str:
    """What the calibration measured, in words: ``points`` are (rate, compute s, all-reduce s)."""
    return (f"compute alone {ms(compute)} ms (" + ", ".join(f"{ms(c)} at {rate}" for rate, c, _ in points)
            + "); float32 all-reduce alone " + ", ".join(f"{ms(t)} ms at {rate}" for rate, _, t in points)
            + f": {ms(fit.fixed)} ms + its {fit.wire / 1e6:.0f} Mbit at {fit.efficiency:.0%} of the link rate")


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    """Runs every launch; returns the raw record that :func:`render` turns into the section."""
    from .report import machine_line

    calibrating = not args.settings
    progress = Progress((CALIBRATION_LAUNCHES + len(args.aims) if calibrating else len(args.settings))
                        + bool(args.four_hosts) + (2 if args.controller_check else 0))
    load_before = os.getloadavg()
    start = time.perf_counter()
    calibration = calibrate(args, progress) if calibrating else None
    if calibration is not None and "device_s" in calibration:
        args.device_times = calibration["device_s"]
    if calibration is not None:
        settings = [Setting(2, rate, args.batch, f"aimed at comm ~{aim:g}x compute", aim)
                    for aim, rate, _ in calibration["plans"]]
    else:
        settings = [Setting.parse(2, spec, "rate set by --settings") for spec in args.settings]
    if args.four_hosts:
        settings.append(Setting.parse(4, args.four_hosts, "4 ranks on 2 cores: oversubscribed"))
    launches = []
    for s in settings:
        launches.append(run_launch(s, args, progress=progress))
        la = launches[-1]
        if s.target is not None:
            ratio = la.comm("none") / la.compute
            print(f"  comm/compute {ratio:.2f}: {off_aim(ratio, s.target) or f'within 20% of its aim {s.target:g}'}",
                  file=sys.stderr, flush=True)
    pair: List[Launch] = []
    if args.controller_check:
        check = Setting.parse(2, args.controller_check, "controller check")
        pair = [run_launch(check, args, controller, quick=True, progress=progress, configs=("horovod", "w2"))
                for controller in ("gloo", "mpi")]
    return {"machine": machine_line(), "args": vars(args), "elapsed_s": time.perf_counter() - start,
            "calibration": calibration,
            "load_before": load_before, "load_after": os.getloadavg(),
            "settings": [dataclasses.asdict(s) for s in settings],
            "launches": [dataclasses.asdict(la) for la in launches], "pair": [dataclasses.asdict(la) for la in pair]}


def offload_block(launches: Sequence[Launch], calibration: Optional[Dict[str, Any]], batch: int) -> str:
    """How a run with compute off the cores stood in for compute, and for how long (``batch``:
    the calibration's, whose times the launches of that batch waited)."""
    own = [la for la in launches if la.batch != batch]
    if calibration is not None and "device_s" in calibration:
        forward, backward = calibration["device_s"]
        timed = ("the calibration's two launches timed the real forward and backward passes (each the slowest "
                 f"rank's median of 5 steps after one; their mean: forward {ms(forward)} ms, backward "
                 f"{ms(backward)} ms), and every step of every launch of batch {batch} waited as long instead"
                 + "".join(f"; the {la.hosts}-host launch (batch {la.batch}) timed its own: forward "
                           f"{ms(la.median('device-forward'))} ms, backward {ms(la.median('device-backward'))} ms"
                           for la in own))
    else:
        timed = ("each launch first timed the real forward and backward passes (the slowest rank's median of 5 "
                 "steps after one; ms: " + "; ".join(f"{la.rate}: forward {ms(la.median('device-forward'))}, backward "
                                                      f"{ms(la.median('device-backward'))}" for la in launches)
                 + "), then every step waited as long instead")
    return ("\n**Compute off the cores** (`--offload-compute`, `benchmarks/offloaded_compute.py`): "
            f"{timed}, holding neither a core nor the GIL, the "
            "backward pass in one slice per layer with that layer's gradients (fixed tensors, copied into `.grad`) "
            "after its slice, last layer first, so that Horovod's and pipesgd's hooks fire as in a real backward "
            "pass. The optimizer's update and everything after it run on the host as before. That is how an "
            "accelerator's step looks from the host thread: the pipeline's and Horovod's threads get the core that "
            "compute holds in the section above. It is an emulation on this CPU machine, not a GPU measurement.\n")


def render(record: Dict[str, Any], image: Optional[Path]) -> str:
    """The "throughput" section, or with compute off the cores "throughput-offloaded" (and the
    plot, unless ``image`` is None), from a raw record."""
    args = argparse.Namespace(**record["args"])
    offloaded = bool(getattr(args, "offload_compute", False))
    key = section_key(offloaded)
    settings = [Setting(**s) for s in record["settings"]]
    launches = [Launch(**la) for la in record["launches"]]
    pair = [Launch(**la) for la in record["pair"]]
    models = [fit_model(la) for la in launches]
    found = aim_targets(settings, launches) + targets(launches, dict(enumerate(models)))
    if image is not None:
        plot(settings, launches, models, image)
    blocks = "\n\n".join(launch_block(s, la, m) for s, la, m in zip(settings, launches, models))
    four_x = max((la for la in launches if la.hosts == 2), key=lambda la: la.comm("none") / la.compute)
    load_before, load_after = (", ".join(f"{v:.2f}" for v in record[k]) for k in ("load_before", "load_after"))
    title = ("Throughput with compute off the cores (`benchmarks/throughput.py --offload-compute`, `make bench`)"
             if offloaded else "Throughput on the emulated cluster (`benchmarks/throughput.py`, `make bench`)")
    return f"""## {title}

{record["machine"]}; {record["elapsed_s"] / 60:.1f} min for {len(launches) + len(pair)} launches. Load average
(1, 5, 15 min) before: {load_before}; after: {load_after}. The two cores were shared with other jobs (their share
is given per launch): absolute times carry that noise, the ratios less so, since every configuration ran side
by side in each launch. Every sample of the run is kept in `build/{key}.json`
(`python -m benchmarks.throughput --render build/{key}.json` rewrites this section from it).

Setup: ranks one per host: network namespaces behind a bridge, each host's egress shaped by
`tc tbf rate R burst 512kb` (a transfer's first 512 kB leave at once, so short transfers can beat R), Horovod's
{args.controller} controller (`benchmarks/cluster/`), {cycle_line(getattr(args, "horovod_cycle_ms", 0.0))}. Model: {args.layers} x Linear({args.dim}, {args.dim}),
{launches[0].grad_bytes / 1e6:.1f} MB of float32 gradient, one torch thread per rank, SGD; the link rate sets
comm/compute.
{offload_block(launches, record.get("calibration"), args.batch) if offloaded else ""}{calibration_block(record.get("calibration"))}
Every configuration ran {args.rounds} rounds of {args.steps} timed steps (after one untimed step that
refills the pipeline; flushed after), interleaved with the others; step times are medians of the slowest rank.

- *Bound* = max(compute, that codec's all-reduce), both timed alone in the same launch. A byte codec's
  all-reduce is timed as the engine runs it: the gradient's fusion buckets one after another, each one's two
  phases before the next one's.
- *Engine-free loop*: the same width-2 schedule without pipesgd (compute step t, start its all-reduce, wait
  for step t-1's, on a comm thread for byte codecs as the engine does): what this machine allows; step / loop
  is the engine's own overhead.
- *Model* = `pipesgd_hvd.auto.model` fed with measurements of parts only, never with the training steps it
  predicts: the link fitted by `fit_link`, each codec's cost from its all-reduce timed alone, compute and its
  backward share, and the CPU each all-reduce costs a rank as the interference f
  (`benchmarks/throughput_analysis.py` says how).
- *CPU per step*, read around each segment: the compute thread (`time.thread_time`) and all other threads of
  a rank (`getrusage` less the compute thread: Horovod's background thread and Gloo's, the pipeline's comm
  thread, which runs the codecs), and how many of the machine's cores were busy (`/proc/stat`; 2.0 =
  CPU-bound). Horovod's own threads (those born while `hvd.init()` and a first op ran) are read apart, on
  their thread clocks (`benchmarks/thread_cpu.py`): their loop wakes every cycle, op or not. A byte
  codec's all-reduce runs on the pipeline's own channel, so its CPU is that of the rank's other threads
  (the target's figure); Horovod's float32 all-reduce is billed all threads. What those threads burn with
  nothing to do, from an idle 0.25 s timed beside the collectives, is left out of the model's interference.
- *pipesgd auto*: `width="auto", compression="auto"` (PyTorch; `pipesgd_hvd/auto/rule.py`), run before the
  rounds until it decides (`auto_measure_steps=5`, no re-check), then timed like the others in the
  configuration it chose. Its model column is the chosen configuration's. Its target: within 10% of the
  fastest fixed configuration it could have chosen (width 1, width 2 with none, fp16, int8 or int4).

{blocks}

![speed-up over Horovod](img/{key}.png)

Bars: measured speed-up over Horovod's synchronous optimizer; black marks: the model's.

### What the numbers say

{findings(launches)}

### Targets

{targets_block(found)}

{profile_block(four_x)}

{controller_block(args.controller_check, pair) if pair else ""}
"""


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration per round")
    parser.add_argument("--comm-reps", type=int, default=1, help="collective timings per round")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--aims", nargs="+", type=float, default=list(AIMS), metavar="X",
                        help="comm/compute of the 2-host launches, one launch each; the rates come from a "
                             "calibration run first (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1024, help="per rank, in the 2-host launches")
    parser.add_argument("--settings", nargs="+", metavar="RATE:BATCH",
                        help="fixed 2-host launches instead of --aims (no calibration), e.g. 620mbit:1024")
    parser.add_argument("--configs", nargs="+", metavar="NAME",
                        help=f"run only these configurations (and Horovod's, and with auto those it chooses "
                             f"from): {', '.join((*TRAINING, AUTO))}")
    parser.add_argument("--four-hosts", default="620mbit:512", help="RATE:BATCH of the 4-host launch ('' skips it)")
    parser.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    parser.add_argument("--controller-check", default="620mbit:1024",
                        help="RATE:BATCH of two short launches, Gloo then MPI controller ('' skips them)")
    parser.add_argument("--horovod-cycle-ms", type=float, default=20.0,
                        help="HOROVOD_CYCLE_TIME of every rank (default 20, the README's advice for CPU machines "
                             "whose ranks fill the cores; 0: Horovod's default)")
    parser.add_argument("--offload-compute", action="store_true",
                        help="forward and backward passes as waits of their measured times, off the cores, as on an "
                             "accelerator (benchmarks/offloaded_compute.py); writes the \"throughput-offloaded\" section")
    parser.add_argument("--launch-timeout", type=float, default=600)
    parser.add_argument("--max-quiet-wait", type=float, default=45,
                        help="seconds to wait before each launch for other jobs to leave the cores idle")
    parser.add_argument("--no-doc", action="store_true",
                        help="print the section, leave docs/ and build/<section>.json alone (its samples go to "
                             "build/<section>-nodoc.json)")
    parser.add_argument("--render", metavar="JSON", help="no launches: write the section from a saved record")
    args = parser.parse_args(argv)
    try:
        args.configs = list(select_configs(args.configs))
        for spec in [*(args.settings or []), args.four_hosts, args.controller_check]:
            if spec:
                rate_bps(Setting.parse(2, spec, "").rate)
        if args.horovod_cycle_ms < 0:
            raise ValueError(f"--horovod-cycle-ms must be >= 0 (0: Horovod's default), got {args.horovod_cycle_ms:g}")
        if not args.render:
            horovod_cycle_env(args.horovod_cycle_ms)
    except ValueError as e:
        parser.error(str(e))
    if not all(aim > 0 for aim in args.aims):
        parser.error(f"--aims must be > 0, got {args.aims}")
    from .report import write_section

    if args.render:
        record = json.loads(Path(args.render).read_text())
    else:
        if os.geteuid() != 0:
            sys.exit("benchmarks.throughput creates network namespaces: run it as root")
        record = measure(args)
        # the raw samples, to re-read or re-render (--render)
        saved = record_path(section_key(args.offload_compute), args.no_doc)
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(record))
        print(f"samples kept in {saved}")
    key = section_key(bool(record["args"].get("offload_compute")))
    text = render(record, None if args.no_doc else image_path(key))
    if not args.no_doc:
        write_section(key, text)
    print(text)


if __name__ == "__main__":
    main()
