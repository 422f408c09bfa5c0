"""Throughput on the emulated cluster: Horovod's synchronous optimizer against pipesgd_hvd.

    python -m benchmarks.throughput            (as root; `make bench` runs it)

For each link rate and batch (chosen so that communication is about 0.25x, 1x and 4x the
compute of a step), one launch of 2 ranks, one per host (``benchmarks/cluster``), runs side by side,
interleaved in rounds: compute alone (no communication), the all-reduce alone (float32, and our
compressed all-reduce per codec), Horovod's own ``DistributedOptimizer`` (what users have today),
and pipesgd_hvd width 1, width 2, and width 2 with fp16 / bf16 / truncate16 / int8 (error
feedback). Then one launch on 4 hosts. The model is 4 Linear(1280, 1280) layers (26 MB of float32
gradient), one thread per rank. Per configuration: the median step time (slowest
rank), the speed-up over Horovod, the efficiency against the bound max(compute, communication)
(both measured in the same launch), and the timing model's prediction (pipesgd_hvd.timing) from
the measured compute, link and codec costs. Writes the "throughput" section of
docs/benchmarks.md and docs/img/throughput.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
MARKER = "THROUGHPUT_RESULT "
CODECS = ("fp16", "bf16", "truncate16", "int8")
TRAINING = ["horovod", "w1", "w2"] + [f"w2-{c}" for c in CODECS] + ["auto"]
LABELS = {"horovod": "Horovod DistributedOptimizer (sync)", "w1": "pipesgd width 1", "w2": "pipesgd width 2",
          **{f"w2-{c}": f"pipesgd width 2 + {c}{' (EF)' if c == 'int8' else ''}" for c in CODECS},
          "auto": 'pipesgd width="auto", compression="auto"'}


# ------------------------------------------------------------------------------------ worker
def _worker(args: argparse.Namespace) -> None:
    import horovod.torch as hvd
    import torch

    import pipesgd_hvd.torch as psgd
    from pipesgd_hvd.comm.horovod_torch import HorovodTorchCommunicator
    from pipesgd_hvd.compression import resolve_compression
    from pipesgd_hvd.compression.allreduce import compressed_allreduce
    from pipesgd_hvd.frameworks.torch_ops import TORCH_OPS

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.dim)

    def make_model() -> torch.nn.Module:
        torch.manual_seed(1)
        return torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim) for _ in range(args.layers)])

    def step(model: torch.nn.Module, opt: Any) -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    runs: Dict[str, Dict[str, Any]] = {}
    for key in ["compute"] + TRAINING:
        model = make_model()
        inner = torch.optim.SGD(model.parameters(), lr=1e-6)
        if key == "compute":
            opt = inner
        elif key == "horovod":
            opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
        elif key == "auto":
            # Decides after its first segment (measured at width 1), before the timed rounds.
            opt = psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), width="auto",
                                            compression="auto", auto_measure_steps=args.steps, auto_recheck_every=0)
        else:
            width, _, codec = key[1:].partition("-")
            opt = psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), width=int(width),
                                            compression=codec or "none")
        runs[key] = {"model": model, "opt": opt}

    grad_numel = sum(p.numel() for p in runs["compute"]["model"].parameters())
    flat = torch.randn(grad_numel)
    comm = HorovodTorchCommunicator()
    codecs = {c: resolve_compression(c) for c in CODECS}
    calls = [0]

    def allreduce_fp32() -> None:
        calls[0] += 1
        hvd.allreduce_(flat.clone(), name=f"bench.fp32.{calls[0]}", op=hvd.Average)

    def compressed(name: str) -> Callable[[], None]:
        def run() -> None:
            calls[0] += 1
            compressed_allreduce(TORCH_OPS, comm, codecs[name], flat, name=f"bench.{name}.{calls[0]}",
                                 key="bench", seed=calls[0])
        return run

    # The two phases of our compressed all-reduce for int8, alone: alltoall of the encoded bucket
    # and allgather of one encoded chunk (uint8), to compare with the link rate.
    int8_row = -(-grad_numel // hvd.size() // 512) * 516
    a2a_buf = torch.zeros(hvd.size(), int8_row, dtype=torch.uint8)
    ag_buf = torch.zeros(1, int8_row, dtype=torch.uint8)

    def phase(kind: str) -> Callable[[], None]:
        def run() -> None:
            calls[0] += 1
            if kind == "alltoall":
                hvd.alltoall(a2a_buf, name=f"bench.a2a.{calls[0]}")
            else:
                hvd.allgather(ag_buf, name=f"bench.ag.{calls[0]}")
        return run

    def codec_roundtrip(name: str) -> Callable[[], None]:
        """One encode + decode of the whole gradient on this rank (the codec's cost)."""
        codec = resolve_compression(name)
        rows = torch.zeros(1, codec.padded_cols(grad_numel))
        rows[0, :grad_numel] = flat

        def run() -> None:
            payload, ctx = codec.encode(TORCH_OPS, rows, key="local", seed=0)
            codec.decode(TORCH_OPS, payload, ctx)
        return run

    def compute_beside_allreduce() -> None:
        """Compute steps, each with a float32 all-reduce of the gradient's size started just before
        (Horovod's background thread runs it): how much communication (copies, the TCP stack,
        Horovod's thread) slows compute on the shared core. One collective per step, so both
        ranks issue the same ones."""
        model, opt = runs["compute"]["model"], runs["compute"]["opt"]
        for _ in range(args.steps):
            calls[0] += 1
            handle = hvd.allreduce_async_(flat.clone(), name=f"bench.beside.{calls[0]}", op=hvd.Average)
            samples["compute-beside-comm"].append(timed(lambda: step(model, opt)))
            hvd.synchronize(handle)

    keys = ["compute", "compute-beside-comm", *TRAINING, "comm-none", *[f"comm-{c}" for c in CODECS],
            *[f"codec-{c}" for c in CODECS], "int8-alltoall", "int8-allgather"]
    samples: Dict[str, List[float]] = {k: [] for k in keys}

    def timed(fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    # The auto configuration measures during its first steps: give it those before the rounds.
    for _ in range(args.steps + 2):
        step(runs["auto"]["model"], runs["auto"]["opt"])
    runs["auto"]["opt"].flush()

    for _ in range(args.rounds):
        for key in ["compute", *TRAINING]:
            model, opt = runs[key]["model"], runs[key]["opt"]
            step(model, opt)  # untimed: refills the pipeline after the last segment's flush
            for _ in range(args.steps):
                samples[key].append(timed(lambda: step(model, opt)))
            if hasattr(opt, "flush"):
                opt.flush()  # nothing of this configuration stays on the wire during the next one
            hvd.allreduce(torch.zeros(1), name=f"bench.barrier.{key}.{len(samples[key])}")
        # Both ranks must run the same collectives: the other rank's loop thread answers ours.
        compute_beside_allreduce()
        for _ in range(args.comm_reps):
            samples["comm-none"].append(timed(allreduce_fp32))
            for c in CODECS:
                samples[f"comm-{c}"].append(timed(compressed(c)))
                samples[f"codec-{c}"].append(timed(codec_roundtrip(c)))
            samples["int8-alltoall"].append(timed(phase("alltoall")))
            samples["int8-allgather"].append(timed(phase("allgather")))

    medians = {k: statistics.median(v) for k, v in samples.items() if v}
    everyone = hvd.allgather_object(medians, name="bench.medians")
    slowest = {k: max(m[k] for m in everyone) for k in medians}
    if hvd.rank() == 0:
        decision = runs["auto"]["opt"].auto_decision
        result = {"ranks": hvd.size(), "grad_bytes": grad_numel * 4, "median_s": slowest, "int8_row": int8_row,
                  "auto": {"width": decision.width, "compression": decision.compression,
                           "describe": decision.describe()} if decision is not None else None,
                  "wire_ratio": {k: runs[k]["opt"].stats.ratio for k in TRAINING if k != "horovod"}}
        sys.stdout.write(MARKER + json.dumps(result) + "\n")
        sys.stdout.flush()


# ------------------------------------------------------------------------------------ driver
@dataclasses.dataclass
class Setting:
    hosts: int
    rate: str
    batch: int
    label: str


def _launch(setting: Setting, args: argparse.Namespace) -> Dict[str, Any]:
    # Horovod's Gloo controller, not MPI: see benchmarks/cluster/gloo.py for the measurement
    # (Open MPI's TCP transport slowed 2x beside compute on this 2-core machine; Gloo did not).
    from benchmarks.cluster.gloo import run
    from benchmarks.cluster.netns import Cluster

    env = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "benchmarks.throughput", "--worker", "--rounds", str(args.rounds),
           "--steps", str(args.steps), "--comm-reps", str(args.comm_reps), "--batch", str(setting.batch),
           "--dim", str(args.dim), "--layers", str(args.layers)]
    start = time.perf_counter()
    with Cluster(setting.hosts, rate=setting.rate) as cluster:
        proc = run(cluster, cmd, env=env, timeout=900)
    print(f"  {setting.hosts} hosts at {setting.rate}: {time.perf_counter() - start:.0f} s", file=sys.stderr,
          flush=True)
    for line in proc.stdout.splitlines():
        if MARKER in line:
            return json.loads(line.split(MARKER, 1)[1])
    raise RuntimeError(f"no result (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def predictions(res: Dict[str, Any]) -> Dict[str, float]:
    """The timing model's step time per configuration, from this launch's measured compute time,
    float32 all-reduce (the link) and codec round trips."""
    from pipesgd_hvd.auto import link_from_allreduce
    from pipesgd_hvd.timing import CODECS as MODEL_CODECS
    from pipesgd_hvd.timing import compressed_allreduce_time, pipelined_iteration_time, sync_iteration_time

    m, n, nbytes = res["median_s"], res["ranks"], res["grad_bytes"]
    link = link_from_allreduce(n, nbytes, m["comm-none"])
    f = interference(m)
    out = {k: sync_iteration_time(m["compute"], m["comm-none"]) for k in ("horovod", "w1")}
    auto = res.get("auto")
    out["w2"] = pipelined_iteration_time(m["compute"], m["comm-none"], f)
    for c in CODECS:
        # The model's codec term is (N-1)/N M c for the whole round trip; fit c from ours.
        codec = dataclasses.replace(MODEL_CODECS[c], cost_per_byte=m[f"codec-{c}"] * n / ((n - 1) * nbytes))
        out[f"w2-{c}"] = pipelined_iteration_time(m["compute"], compressed_allreduce_time(n, nbytes, link, codec), f)
    out["auto"] = out.get(_auto_key(auto), float("nan")) if auto else float("nan")
    return out


def _auto_key(auto: Optional[Dict[str, Any]]) -> str:
    """The fixed configuration the auto mode chose, as a key of TRAINING."""
    if not auto:
        return ""
    if auto["width"] == 1:
        return "w1"
    return "w2" if auto["compression"] == "none" else f"w2-{auto['compression']}"


def interference(m: Dict[str, float]) -> float:
    """The timing model's f: compute runs 1+f times slower while an all-reduce runs beside it.
    A step with one all-reduce beside it overlaps it for min(all-reduce, step) seconds, of which
    f/(1+f) is the delay: f/(1+f) = (beside - alone) / min(all-reduce, beside)."""
    delay = max(0.0, m["compute-beside-comm"] - m["compute"])
    share = min(0.99, delay / max(min(m["comm-none"], m["compute-beside-comm"]), 1e-9))
    return share / (1.0 - share)


def bound(res: Dict[str, Any], key: str) -> float:
    m = res["median_s"]
    if key == "auto":
        key = _auto_key(res.get("auto")) or "w1"
        if key.startswith("w2-") and f"comm-{key[3:]}" not in m:  # a codec without its own row (int4)
            return float("nan")
    comm = m["comm-none"] if key in ("horovod", "w1", "w2") else m[f"comm-{key[3:]}"]
    if key in ("horovod", "w1"):
        return m["compute"] + comm  # synchronous: nothing to hide behind (Horovod hides part, see text)
    return max(m["compute"], comm)


def _table(setting: Setting, res: Dict[str, Any]) -> str:
    from benchmarks.report import table

    m = res["median_s"]
    pred = predictions(res)
    rows = []
    for key in TRAINING:
        t = m[key]
        rows.append([LABELS[key], f"{t * 1e3:.0f}", f"{m['horovod'] / t:.2f}x", f"{bound(res, key) * 1e3:.0f}",
                     f"{bound(res, key) / t:.0%}", f"{pred[key] * 1e3:.0f}", f"{t / pred[key]:.2f}",
                     f"{res['wire_ratio'].get(key, 1.0):.3f}"])
    head = (f"**{setting.hosts} hosts, {setting.rate} links, batch {setting.batch}** ({setting.label}): compute alone "
            f"{m['compute'] * 1e3:.0f} ms, float32 all-reduce alone {m['comm-none'] * 1e3:.0f} ms "
            f"(comm/compute {m['comm-none'] / m['compute']:.2f}); compressed all-reduce alone: "
            + ", ".join(f"{c} {m[f'comm-{c}'] * 1e3:.0f} ms" for c in CODECS)
            + "; encode + decode of the whole gradient on one rank: "
            + ", ".join(f"{c} {m[f'codec-{c}'] * 1e3:.0f} ms" for c in CODECS) + ".")
    hidden = (m["compute"] + m["comm-none"] - m["horovod"]) / m["comm-none"]
    n, row = res["ranks"], res["int8_row"]
    # Bytes each rank sends: alltoall (N-1) rows, allgather (N-1) rows (one row each to N-1 peers,
    # as a ring does); the float32 all-reduce 2 (N-1)/N of the gradient.
    rate = {"float32 all-reduce": 2 * (n - 1) / n * res["grad_bytes"] / m["comm-none"],
            "int8 alltoall": (n - 1) * row / m["int8-alltoall"], "int8 allgather": (n - 1) * row / m["int8-allgather"]}
    tail = (f"Horovod's synchronous optimizer hid {hidden:.0%} of the all-reduce behind the backward pass "
            f"(compute + all-reduce - its step, over the all-reduce). Compute with an all-reduce beside it: "
            f"{m['compute-beside-comm'] * 1e3:.0f} ms, so interference f = {interference(m):.2f} (used by the "
            f"model's pipelined rows). Bytes sent per rank per second: "
            + ", ".join(f"{k} {v * 8 / 1e6:.0f} Mbit/s" for k, v in rate.items()) + f" (link {setting.rate}).")
    auto = res.get("auto")
    if auto:
        timed_rows = [k for k in TRAINING if k != "auto"]
        fastest = min(timed_rows, key=lambda k: m[k])
        tail += (f" The auto mode chose width={auto['width']} compression={auto['compression']} "
                 f"({auto['describe']}); the fastest configuration measured in this launch: {LABELS[fastest]}.")
    return head + "\n\n" + table(["configuration", "step ms", "speed-up vs Horovod", "bound ms", "efficiency "
                                  "(bound / step)", "model ms", "step / model", "wire bytes vs fp32"], rows) + \
        "\n\n" + tail


def _plot(settings: Sequence[Setting], results: Sequence[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(settings)
    for i, (setting, res) in enumerate(zip(settings, results)):
        m = res["median_s"]
        xs = [j + i * width for j in range(len(TRAINING))]
        ax.bar(xs, [m["horovod"] / m[k] for k in TRAINING], width,
               label=f"{setting.hosts} hosts, {setting.rate} (comm/compute {m['comm-none'] / m['compute']:.2f})")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(TRAINING))])
    ax.set_xticklabels([LABELS[k].replace("pipesgd ", "").replace("Horovod DistributedOptimizer (sync)", "Horovod")
                        for k in TRAINING], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("speed-up over Horovod sync")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    parser.add_argument("--comm-reps", type=int, default=2, help="all-reduce timings per round")
    parser.add_argument("--batch", type=int, default=320, help="(worker) batch per rank")
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--layers", type=int, default=4)
    # RATE:BATCH per 2-host launch, chosen so that communication is ~0.25x, ~1x and ~4x compute
    # here (the table reports the ratio each launch measured).
    parser.add_argument("--settings", nargs="+", default=["10gbit:1280", "2gbit:480", "700mbit:320"])
    parser.add_argument("--four-hosts", default="2gbit:480", help="RATE:BATCH of the 4-host launch ('' skips it)")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    if os.geteuid() != 0:
        sys.exit("benchmarks.throughput creates network namespaces: run it as root")
    from benchmarks.cluster.netns import leftover_namespaces
    from benchmarks.report import machine_line, write_section

    names = {0: "aimed at comm ~0.25x compute", 1: "aimed at comm ~1x compute", 2: "aimed at comm ~4x compute"}
    settings = []
    for i, spec in enumerate(args.settings):
        rate, batch = spec.split(":")
        settings.append(Setting(2, rate, int(batch), names.get(i, "")))
    if args.four_hosts:
        rate, batch = args.four_hosts.split(":")
        settings.append(Setting(4, rate, int(batch), "4 ranks on 2 cores: oversubscribed"))
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    results = [_launch(s, args) for s in settings]
    elapsed = time.perf_counter() - start
    assert not leftover_namespaces(), "namespaces left behind"
    _plot(settings, results, ROOT / "docs" / "img" / "throughput.png")
    sections = "\n\n".join(_table(s, r) for s, r in zip(settings, results))
    text = f"""## Throughput on the emulated cluster (`benchmarks/throughput.py`, `make bench`)

{machine_line()}. One launch per row block, ranks one per host (network namespaces, `tc tbf`
links, Horovod's Gloo controller with our rendezvous server; see `benchmarks/cluster/`). Model: {args.layers} x
Linear({args.dim}, {args.dim}) (26 MB of float32 gradient), one thread per rank; the batch per
rank sets the compute time (given per launch). Configurations interleaved in {args.rounds} rounds of {args.steps} timed steps (after one
untimed step; pipelines flushed between segments); medians, slowest rank. Bound = max(compute,
communication) for pipelined rows (communication = that codec's all-reduce alone), compute +
all-reduce for synchronous ones. Model = `pipesgd_hvd.timing` from this launch's compute time,
float32 all-reduce and codec round trips (sync: `l_comp + l_AR`, pipelined: `max(l_comp, l_comm)`).
Load average before: {load_before:.2f}, after: {os.getloadavg()[0]:.2f} (other jobs may have
shared the 2 cores). Total {elapsed / 60:.1f} min.

{sections}

![speed-up over Horovod](img/throughput.png)
"""
    write_section("throughput", text)
    print(text)


if __name__ == "__main__":
    main()
