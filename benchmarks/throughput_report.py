"""The emulated-cluster study's tables and plot, from a record of ``benchmarks/throughput.py``
(docs/benchmarks.md says how to read them): the throughput sections and the hierarchical one."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .report import table
from .throughput_analysis import (LABELS, Launch, Model, Target, codec_of, fit_model, hierarchical_rows,
                                  hierarchical_targets, speedup, targets)
from .throughput_plan import off_aim
from .throughput_worker import AUTO, TRAINING


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def header(record: Dict[str, Any], key: str, launches: Sequence[Launch], setup: str) -> str:
    """The section's first line: when, where, how long, the model, ``setup``, the record."""
    args = record["args"]
    cycle = f"HOROVOD_CYCLE_TIME={args['horovod_cycle_ms']:g}" if args.get("horovod_cycle_ms") else "Horovod's default cycle"
    return (f"{record['machine']}; {record['elapsed_s'] / 60:.1f} min for {len(launches)} launches. {args['layers']} x "
            f"Linear({args['dim']}, {args['dim']}), {launches[0].grad_bytes / 1e6:.1f} MB of float32 gradient; {setup}; "
            f"{cycle}; {args['rounds']} rounds of {args['steps']} timed steps per configuration. Samples: "
            f"`build/{key}.json` (`python -m benchmarks.throughput --render build/{key}.json`).")


def launch_row(setting: Dict[str, Any], la: Launch, model: Model) -> List[str]:
    ratio = la.comm("none") / la.compute
    aim = "" if setting["target"] is None else f"{setting['target']:g} ({off_aim(ratio, setting['target']) or 'met'})"
    link = model.link  # alpha, bandwidth and gamma as fitted
    return [f"{la.hosts} hosts, {la.rate}, batch {la.batch}", aim, f"{ratio:.2f}",
            f"{ms(la.compute)} ({ms(la.median('forward'))} / {ms(la.median('backward'))} / {ms(la.median('update'))})",
            ms(la.comm("none")), f"{link.alpha * 1e6:.0f} / {link.bandwidth * 8 / 1e9:.2f} / {link.gamma * 1e9:.3f}",
            f"{la.horovod_hidden():.0%}", f"{la.core_share():.0%}", f"{la.foreign_share():.0%}",
            "-" if la.auto is None else la.auto_choice()]


def config_rows(la: Launch, model: Model) -> List[List[str]]:
    rows = []
    for key in ("compute", *la.configs, *([AUTO] if la.auto is not None else [])):
        main, other, hvd = la.cpu_per_step(key)
        cpu = f"{ms(main)} / {ms(other)} ({ms(hvd)}) / {la.machine_cores(key):.2f}"
        if key == "compute":
            rows.append(["compute alone", ms(la.compute), "", "", "", "", "", "", cpu])
            continue
        as_key = la.auto_choice() if key == AUTO else key  # auto: bound and model of its choice
        t, loop = la.median(key), la.loop(key)
        rows.append([LABELS[key], ms(t), f"{speedup(la, key):.2f}x", ms(la.bound(as_key)), f"{la.bound(as_key) / t:.0%}",
                     "" if loop is None else f"{ms(loop)} ({t / loop:.2f})", ms(model.step[as_key]),
                     f"{t / model.step[as_key]:.2f}", cpu])
    return rows


def codec_rows(la: Launch, model: Model) -> List[List[str]]:
    wire = {codec_of(k): r for k, r in la.raw["wire_ratio"].items() if k.startswith("w2")}  # per call
    return [[c, ms(la.comm(c)), ms(la.mean_median(f"cpu/comm-{c}")), ms(la.mean_median(f"cpu-hvd/comm-{c}")),
             ms(la.extra_cpu(c)), ms(model.comm[c]), f"{model.codecs[c].cost_per_byte * 1e9:.2f}",
             f"{model.interference[c]:.2f}", f"{wire[c]:.3f}" if c in wire else ""] for c in ("none", *la.codecs)]


def targets_table(found: Sequence[Target]) -> List[str]:
    return ["### Targets", "", f"{sum(t.met for t in found)} of {len(found)} targets met.", "",
            table(["target", "result", "measured"], [[t.name, "met" if t.met else "**missed**", t.measured] for t in found])]


def render(record: Dict[str, Any], image: Optional[Path]) -> str:
    """The section (and the plot, unless ``image`` is None) from a record."""
    args = record["args"]
    offloaded = bool(args.get("offload_compute"))
    key = "throughput-offloaded" if offloaded else "throughput"
    settings, launches = record["settings"], [Launch(**la) for la in record["launches"]]
    models = [fit_model(la) for la in launches]
    aims = [Target(f"{la.hosts} hosts, {la.rate}: comm/compute within 20% of its aim {s['target']:g}",
                   off_aim(la.comm("none") / la.compute, s["target"]) is None, f"{la.comm('none') / la.compute:.2f}")
            for s, la in zip(settings, launches) if s["target"] is not None]
    found = aims + targets(launches, models)
    if image is not None:
        plot(launches, models, image)
    title = "Throughput with compute off the cores" if offloaded else "Throughput on the emulated cluster"
    lines = [f"## {title} (`benchmarks/throughput.py{' --offload-compute' if offloaded else ''}`, `make bench`)", "",
             header(record, key, launches, f"load average before {record['load_before'][0]:.2f}, after "
                                           f"{record['load_after'][0]:.2f}; {args['controller']} controller")]
    cal = record.get("calibration")
    if cal:
        fixed, efficiency = cal["fit"]["fixed"], cal["fit"]["efficiency"]
        lines += ["", f"Calibration: float32 all-reduce = {ms(fixed)} ms + wire at {efficiency:.0%} of the link rate; "
                  "aims: " + ", ".join(f"{aim:g}x -> {rate}" for aim, rate, _ in cal["plans"])
                  + (f"; compute off the cores waited forward {ms(cal['device_s'][0])} ms, backward "
                     f"{ms(cal['device_s'][1])} ms per update" if cal.get("device_s") else "") + ".", "",
                  table(["calibration launch", "compute alone ms", "float32 all-reduce alone ms"],
                        [[rate, ms(c), ms(t)] for rate, c, t in cal["points"]])]
    lines += ["", table(["launch", "aim (met: within 20%)", "comm/compute", "compute ms (fwd / bwd / update)",
                         "float32 all-reduce ms", "link fit: alpha us / Gbit/s / gamma ns/B", "Horovod hid",
                         "core share computing alone", "other jobs' CPU share", "auto chose"],
                        [launch_row(s, la, m) for s, la, m in zip(settings, launches, models)])]
    for la, model in zip(launches, models):
        lines += ["", f"### {la.hosts} hosts, {la.rate} links, batch {la.batch}", "",
                  table(["configuration", "step ms", "speed-up vs Horovod", "bound ms", "bound / step",
                         "engine-free loop ms (step / loop)", "model ms", "step / model",
                         "CPU per step ms: compute thread / other threads (Horovod's) / machine cores busy"],
                        config_rows(la, model)), "",
                  table(["codec", "all-reduce alone ms", "its CPU ms (all threads)", "of which Horovod's ms",
                         "beyond idle ms", "model all-reduce ms", "cost beyond the wire ns/B", "interference f",
                         "wire bytes vs fp32"], codec_rows(la, model))]
    lines += ["", f"![speed-up over Horovod](img/{key}.png)", "", *targets_table(found)]
    return "\n".join(lines) + "\n"


def plot(launches: Sequence[Launch], models: Sequence[Model], path: Path) -> None:
    """Speed-up over Horovod against the measured comm/compute of the 2-host launches, one line per
    configuration; dashed: the model's prediction."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    two = sorted(((la, m) for la, m in zip(launches, models) if la.hosts == 2), key=lambda p: p[0].comm("none") / p[0].compute)
    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    keys = [k for k in (*TRAINING, AUTO) if k != "horovod" and any(k in la.configs or (k == AUTO and la.auto)
                                                                    for la, _ in two)]
    for i, key in enumerate(keys):
        shown = [(la, m) for la, m in two if key in la.configs or (key == AUTO and la.auto is not None)]
        xs = [la.comm("none") / la.compute for la, _ in shown]
        ax.plot(xs, [speedup(la, key) for la, _ in shown], marker="o", color=f"C{i % 10}", label=LABELS[key])
        predicted = [m.step["horovod"] / m.step[la.auto_choice() if key == AUTO else key] for la, m in shown]
        ax.plot(xs, predicted, linestyle="--", linewidth=0.8, color=f"C{i % 10}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ticks = [la.comm("none") / la.compute for la, _ in two]  # the launches' own, not powers of ten
    ax.set_xticks(ticks, [f"{t:.2g}" for t in ticks])
    ax.minorticks_off()
    ax.set(xlabel="comm/compute (float32 all-reduce alone / compute alone)",
           ylabel="speed-up over Horovod (sync)", title="measured (dashed: timing model)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def render_hierarchical(record: Dict[str, Any], image: Optional[Path] = None) -> str:
    """The hierarchical kind's section from a record (no plot: ``image`` is not drawn)."""
    args, body, found = record["args"], [], []
    launches = [Launch(**la) for la in record["launches"]]
    for setting, la in zip(record["settings"], launches):
        aim, measured = setting["target"], la.slowest("comm-none") / la.slowest("compute")
        where = f"{la.rate} ({'' if aim is None else f'aim {aim:g}x, '}measured {measured:.2f}x)"
        rows = hierarchical_rows(la)
        found += hierarchical_targets(where, aim, rows, la.raw["local_size"])
        body += [[where, r["config"], ms(r["step"]), ms(r["model_step"]), ms(r["alone"]), ms(r["model_comm"]),
                  f"{r['host_bytes'] / 1e6:.2f}", "" if r["counted"] is None else f"{r['counted'] / 1e6:.2f}",
                  f"{r['speedup']:.2f}x"] for r in rows]
    return "\n".join([
        "## Hierarchical compression on the emulated cluster (`benchmarks/throughput.py --hierarchical`, "
        "`make bench`)", "",
        header(record, "hierarchical", launches, f"2 hosts x 2 ranks (horovodrun --gloo); compute off the cores, "
                                                 f"forward / backward {' / '.join(map(ms, args['device_times']))} ms"), "",
        table(["link (Horovod comm / compute)", "configuration", "step ms", "model step ms", "reduction alone ms",
               "model reduction ms", "cross-host MB / step (links)", "cross-host MB / reduction (counted)",
               "vs Horovod"], body), "", *targets_table(found)]) + "\n"


def render_zoo(record: Dict[str, Any], image: Optional[Path] = None) -> str:
    """The model-zoo kind's section from a record (no plot: ``image`` is not drawn): per model, a
    table of its launches' rows; then the targets."""
    from . import models
    from .throughput_analysis import zoo_targets

    args, settings = record["args"], record["settings"]
    launches = [Launch(**la) for la in record["launches"]]
    fitted = [fit_model(la) for la in launches]
    plans = {p["model"]: p for p in record["plans"]}
    cycle = f"HOROVOD_CYCLE_TIME={args['horovod_cycle_ms']:g}" if args.get("horovod_cycle_ms") else "Horovod's default cycle"
    lines = ["## Model-zoo shapes on the emulated cluster (`benchmarks/throughput.py --models`, `make bench-models`)", "",
             f"{record['machine']}; {record['elapsed_s'] / 60:.1f} min for {len(launches)} launches; load average before "
             f"{record['load_before'][0]:.2f}, after {record['load_after'][0]:.2f}; gloo controller; {cycle}; compute off "
             f"the cores; {args['rounds']} rounds of {args['steps']} timed steps per configuration. Samples: "
             "`build/model-zoo.json` (`python -m benchmarks.throughput --render build/model-zoo.json`)."]
    for name in args["models"]:
        spec, plan = models.zoo(name), plans.get(name)
        rows = []
        for setting, la, model in zip(settings, launches, fitted):
            if la.raw.get("model") != name:
                continue
            ratio = la.comm("none") / la.compute
            launch = (f"{la.hosts} hosts, {la.rate}: {ratio:.2f}x (aim {setting['target']:g}); compute {ms(la.compute)} "
                      f"({ms(la.median('forward'))} / {ms(la.median('backward'))} / {ms(la.median('update'))})")
            for key in ("compute", *la.configs):
                if key == "compute":
                    continue
                t = la.median(key)
                rows.append([launch, LABELS[key], ms(t), f"{speedup(la, key):.2f}x", ms(la.bound(key)),
                             f"{t / la.bound(key):.2f}", ms(model.step[key]), f"{t / model.step[key]:.2f}",
                             ms(la.comm(codec_of(key)))])
                launch = ""
        update = f"; the host's update {ms(plan['update_s'])} ms (timed before the launches)" if plan else ""
        lines += ["", f"### {name}: {spec.parameters / 1e6:.1f}M parameters in {spec.tensors} tensors, "
                      f"{4 * spec.parameters / 1e6:.0f} MB of float32 gradient", "",
                  f"Device step {ms(spec.device_step.seconds)} ms for {spec.device_step.batch} ({spec.device_step.source}), "
                  f"waited as forward / backward 1 : 2{update}.", "",
                  table(["launch: link, comm/compute measured (aim); compute ms (fwd / bwd / update)", "configuration",
                         "step ms", "speed-up vs Horovod", "bound ms", "step / bound", "model ms", "step / model",
                         "its all-reduce alone ms"], rows)]
    lines += ["", *targets_table(zoo_targets(settings, launches, fitted))]
    return "\n".join(lines) + "\n"
