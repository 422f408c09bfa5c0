"""Throughput on the emulated cluster: Horovod's synchronous optimizer against pipesgd_hvd.

    python -m benchmarks.throughput            (as root; `make bench` runs it)

For each link rate (chosen so that communication is about 0.25x, 1x and 4x the compute of a
step), one launch of 2 ranks, one per host (``benchmarks/cluster``), runs side by side,
interleaved in rounds: compute alone (no communication), the all-reduce alone (float32, and our
compressed all-reduce per codec), Horovod's own ``DistributedOptimizer`` (what users have today),
and pipesgd_hvd width 1, width 2, and width 2 with fp16 / bf16 / truncate16 / int8 (error
feedback). Then one launch on 4 hosts. The model is 4 Linear(1280, 1280) layers (26 MB of float32
gradient); batch 320 on one thread per rank. Per configuration: the median step time (slowest
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
TRAINING = ["horovod", "w1", "w2"] + [f"w2-{c}" for c in CODECS]
LABELS = {"horovod": "Horovod DistributedOptimizer (sync)", "w1": "pipesgd width 1", "w2": "pipesgd width 2",
          **{f"w2-{c}": f"pipesgd width 2 + {c}{' (EF)' if c == 'int8' else ''}" for c in CODECS}}


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

    def codec_roundtrip(name: str) -> Callable[[], None]:
        """One encode + decode of the whole gradient on this rank (the codec's cost)."""
        codec = resolve_compression(name)
        rows = torch.zeros(1, codec.padded_cols(grad_numel))
        rows[0, :grad_numel] = flat

        def run() -> None:
            payload, ctx = codec.encode(TORCH_OPS, rows, key="local", seed=0)
            codec.decode(TORCH_OPS, payload, ctx)
        return run

    keys = ["compute", *TRAINING, "comm-none", *[f"comm-{c}" for c in CODECS], *[f"codec-{c}" for c in CODECS]]
    samples: Dict[str, List[float]] = {k: [] for k in keys}

    def timed(fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for _ in range(args.rounds):
        for key in ["compute", *TRAINING]:
            model, opt = runs[key]["model"], runs[key]["opt"]
            step(model, opt)  # untimed: refills the pipeline after the last segment's flush
            for _ in range(args.steps):
                samples[key].append(timed(lambda: step(model, opt)))
            if hasattr(opt, "flush"):
                opt.flush()  # nothing of this configuration stays on the wire during the next one
            hvd.allreduce(torch.zeros(1), name=f"bench.barrier.{key}.{len(samples[key])}")
        for _ in range(args.comm_reps):
            samples["comm-none"].append(timed(allreduce_fp32))
            for c in CODECS:
                samples[f"comm-{c}"].append(timed(compressed(c)))
                samples[f"codec-{c}"].append(timed(codec_roundtrip(c)))

    medians = {k: statistics.median(v) for k, v in samples.items() if v}
    everyone = hvd.allgather_object(medians, name="bench.medians")
    slowest = {k: max(m[k] for m in everyone) for k in medians}
    if hvd.rank() == 0:
        result = {"ranks": hvd.size(), "grad_bytes": grad_numel * 4, "median_s": slowest,
                  "wire_ratio": {k: runs[k]["opt"].stats.ratio for k in TRAINING if k != "horovod"}}
        sys.stdout.write(MARKER + json.dumps(result) + "\n")
        sys.stdout.flush()


# ------------------------------------------------------------------------------------ driver
@dataclasses.dataclass
class Setting:
    hosts: int
    rate: str
    label: str


def _launch(setting: Setting, args: argparse.Namespace) -> Dict[str, Any]:
    from benchmarks.cluster.launch import run
    from benchmarks.cluster.netns import Cluster

    env = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(ROOT),
           # Horovod asks MPI for MPI_THREAD_MULTIPLE by default; Open MPI's TCP transport is then
           # slower (measured here: a 26 MB all-reduce at 1 Gbit took 380 ms instead of 285 ms).
           # Only Horovod's background thread calls MPI in this benchmark, so it is safe.
           "HOROVOD_MPI_THREADS_DISABLE": "1"}
    cmd = [sys.executable, "-m", "benchmarks.throughput", "--worker", "--rounds", str(args.rounds),
           "--steps", str(args.steps), "--comm-reps", str(args.comm_reps), "--batch", str(args.batch),
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
    out = {k: sync_iteration_time(m["compute"], m["comm-none"]) for k in ("horovod", "w1")}
    out["w2"] = pipelined_iteration_time(m["compute"], m["comm-none"])
    for c in CODECS:
        # The model's codec term is (N-1)/N M c for the whole round trip; fit c from ours.
        codec = dataclasses.replace(MODEL_CODECS[c], cost_per_byte=m[f"codec-{c}"] * n / ((n - 1) * nbytes))
        out[f"w2-{c}"] = pipelined_iteration_time(m["compute"], compressed_allreduce_time(n, nbytes, link, codec))
    return out


def bound(res: Dict[str, Any], key: str) -> float:
    m = res["median_s"]
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
    head = (f"**{setting.hosts} hosts, {setting.rate} links** ({setting.label}): compute alone "
            f"{m['compute'] * 1e3:.0f} ms, float32 all-reduce alone {m['comm-none'] * 1e3:.0f} ms "
            f"(comm/compute {m['comm-none'] / m['compute']:.2f}); compressed all-reduce alone: "
            + ", ".join(f"{c} {m[f'comm-{c}'] * 1e3:.0f} ms" for c in CODECS)
            + "; encode + decode of the whole gradient on one rank: "
            + ", ".join(f"{c} {m[f'codec-{c}'] * 1e3:.0f} ms" for c in CODECS) + ".")
    hidden = (m["compute"] + m["comm-none"] - m["horovod"]) / m["comm-none"]
    tail = (f"Horovod's synchronous optimizer hid {hidden:.0%} of the all-reduce behind the backward pass "
            f"(compute + all-reduce - its step, over the all-reduce).")
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
    parser.add_argument("--batch", type=int, default=320)
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rates", nargs="+", default=["10gbit", "2gbit", "500mbit"])
    parser.add_argument("--four-host-rate", default="2gbit", help="'' skips the 4-host launch")
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    if os.geteuid() != 0:
        sys.exit("benchmarks.throughput creates network namespaces: run it as root")
    from benchmarks.cluster.netns import leftover_namespaces
    from benchmarks.report import machine_line, write_section

    names = {0: "comm ~0.25x compute", 1: "comm ~1x compute", 2: "comm ~4x compute"}
    settings = [Setting(2, rate, names.get(i, "")) for i, rate in enumerate(args.rates)]
    if args.four_host_rate:
        settings.append(Setting(4, args.four_host_rate, "4 ranks on 2 cores: oversubscribed"))
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    results = [_launch(s, args) for s in settings]
    elapsed = time.perf_counter() - start
    assert not leftover_namespaces(), "namespaces left behind"
    _plot(settings, results, ROOT / "docs" / "img" / "throughput.png")
    sections = "\n\n".join(_table(s, r) for s, r in zip(settings, results))
    text = f"""## Throughput on the emulated cluster (`benchmarks/throughput.py`, `make bench`)

{machine_line()}. One launch per row block, ranks one per host (network namespaces, `tc tbf`
links, `mpirun` with Horovod's MPI controller; see `benchmarks/cluster/`). Model: {args.layers} x
Linear({args.dim}, {args.dim}) (26 MB of float32 gradient), batch {args.batch}, one thread per
rank. Configurations interleaved in {args.rounds} rounds of {args.steps} timed steps (after one
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
