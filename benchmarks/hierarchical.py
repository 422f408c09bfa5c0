"""Hierarchical compression on the emulated cluster: 2 hosts x 2 ranks, links shaped between the
hosts only, compute off the cores.

    python -m benchmarks.hierarchical --doc        (as root; writes the "hierarchical" section)
    python -m benchmarks.hierarchical --smoke      (one aim, few steps: proves it runs; no docs)

One ``horovodrun --gloo`` launch per aim (``tools/cluster/horovodrun.py``): the link rate is
set so that Horovod's float32 all-reduce of the gradient takes about ``aim`` x the compute time
(a host's link carries ``2 (N-1)/N`` of the gradient in its ring); each launch reports the ratio it
measured. The two ranks of a host share its namespace, so what they send each other stays on the
host, unshaped, as over NVLink inside a node. Forward and backward passes are waits of fixed
device times (``benchmarks/offloaded_compute.py``), so 4 ranks on 2 cores stay honest. Inside a
launch (``benchmarks/hierarchical_worker.py``) every configuration runs side by side, interleaved:
Horovod's synchronous optimizer, and pipesgd width 2 with int8 / int4, flat and hierarchical.

Per row: the median step (slowest rank), each reduction timed alone, the bytes each host's link
sent per step (the kernel's counter), and the timing model's prediction beside it
(``pipesgd_hvd/auto/model.py``: ``flat_on_nodes_time``, ``hierarchical_allreduce_time``, from the
links, gamma and codec costs measured in the same launch; a width-2 step predicted at
max(compute, reduction), Horovod's at compute + all-reduce).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

from pipesgd_hvd.auto.model import (CODECS as MODEL_CODECS, LinkParams, compressed_allreduce_time, flat_on_nodes_time,
                                    hierarchical_allreduce_time)

from .hierarchical_worker import CONFIGS, MARKER

DEFAULT_AIMS = (1.0, 5.0)


def rate_for(aim: float, grad_bytes: int, ranks: int, compute_s: float) -> str:
    """The tc rate at which a ring all-reduce of ``grad_bytes`` over ``ranks`` (one hop of it on each
    host's link) takes ``aim`` x ``compute_s``."""
    bits = 2 * (ranks - 1) / ranks * grad_bytes * 8 / (aim * compute_s)
    return f"{max(1, round(bits / 1e6))}mbit"


def slowest(per_rank: Sequence[Dict[str, List[float]]], key: str) -> float:
    """The slowest rank's median of ``key``."""
    return max(statistics.median(r[key]) for r in per_rank if key in r)


def pooled(per_rank: Sequence[Dict[str, List[float]]], key: str) -> float:
    """The median of every rank's samples of ``key``: a link's own speed, which one rank's stall
    (another job took its core mid-exchange) should not set."""
    return statistics.median(v for r in per_rank for v in r.get(key, []))


@dataclasses.dataclass(frozen=True)
class Links:
    """What the model needs, measured in the launch."""

    cross: LinkParams
    local: LinkParams
    codec_s_per_byte: Dict[str, float]


def measured_links(result: Dict[str, Any]) -> Links:
    per_rank, local_size, cross_size = result["per_rank"], result["local_size"], result["cross_size"]
    small, large, grad = result["small_bytes"], result["large_bytes"], result["grad_bytes"]
    t_small, t_large = pooled(per_rank, f"cross-a2a/{small}"), pooled(per_rank, f"cross-a2a/{large}")
    on_link = local_size * (cross_size - 1)  # a host's link carries every local rank's exchange at once
    bandwidth = on_link * (large - small) / max(t_large - t_small, 1e-9)
    alpha = max(t_small - on_link * small / bandwidth, 0.0) / max(cross_size - 1, 1)
    gamma = pooled(per_rank, "add") / grad
    shard_bytes = 4 * -(-grad // 4 // local_size)
    local_bw = (local_size - 1) * shard_bytes / pooled(per_rank, "local-a2a")
    codec = {c: pooled(per_rank, f"codec/{c}") / grad for c in ("int8", "int4")}
    return Links(LinkParams(alpha, bandwidth, gamma), LinkParams(0.0, local_bw, gamma), codec)


def predicted_reduction(key: str, result: Dict[str, Any], links: Links) -> float:
    local_size, cross_size = result["local_size"], result["cross_size"]
    if key == "horovod":
        return compressed_allreduce_time(result["ranks"], result["grad_bytes"], links.cross, MODEL_CODECS["none"])
    form, codec = key.split("-")
    params = dataclasses.replace(MODEL_CODECS[codec], cost_per_byte=links.codec_s_per_byte[codec])
    timing = hierarchical_allreduce_time if form == "hier" else flat_on_nodes_time
    # the engine reduces bucket after bucket on its comm thread
    return sum(timing(local_size, cross_size, 4 * numel, links.local, links.cross, params) for numel in result["buckets"])


def rows_for(aim: float, rate: str, result: Dict[str, Any]) -> List[Dict[str, Any]]:
    per_rank, links = result["per_rank"], measured_links(result)
    compute = slowest(per_rank, "compute")
    horovod = slowest(per_rank, "horovod")
    rows = []
    for key in CONFIGS:
        step, alone = slowest(per_rank, key), slowest(per_rank, f"alone/{key}")
        comm = predicted_reduction(key, result, links)
        pred = compute + comm if key == "horovod" else max(compute, comm)
        host_bytes = [statistics.median(r[f"host-bytes/{key}"]) for r in per_rank if f"host-bytes/{key}" in r]
        payload = sum(statistics.median(r[f"payload/{key}"]) for r in per_rank) if key != "horovod" else None
        rows.append({"aim": aim, "rate": rate, "config": key, "step_s": step, "compute_s": compute, "alone_s": alone,
                     "predicted_reduction_s": comm, "predicted_step_s": pred,
                     "cross_host_bytes_per_step": sum(host_bytes), "counted_payload_bytes": payload,
                     "speedup_vs_horovod": horovod / step,
                     "measured_comm_over_compute": slowest(per_rank, "alone/horovod") / compute})
    return rows


def checks(rows: List[Dict[str, Any]], local_size: int) -> List[str]:
    """The issue's targets, each with what was measured."""
    out = []
    for aim in sorted({r["aim"] for r in rows}):
        at = {r["config"]: r for r in rows if r["aim"] == aim}
        for codec in ("int8", "int4"):
            flat, hier = at[f"flat-{codec}"], at[f"hier-{codec}"]
            share = hier["cross_host_bytes_per_step"] / flat["cross_host_bytes_per_step"]
            payload = hier["counted_payload_bytes"] / flat["counted_payload_bytes"]
            out.append(f"aim {aim:g}x, {codec}: hierarchical cross-host bytes per step {share:.3f} of flat on the "
                       f"links (kernel), {payload:.3f} of flat's reduction payload (counted per collective); target "
                       f"<= 1/{local_size}")
        h8, f8 = at["hier-int8"], at["flat-int8"]
        bound = max(h8["compute_s"], h8["alone_s"])
        out.append(f"aim {aim:g}x: flat int8 / hierarchical int8 step {f8['step_s'] / h8['step_s']:.2f}x "
                   f"(target >= 1.5x at 5x); hierarchical int8 {h8['step_s'] / bound:.3f} of max(compute, its "
                   f"all-reduce alone) (target <= 1.10)")
        for key in ("hier-int8", "hier-int4"):
            err = at[key]["predicted_step_s"] / at[key]["step_s"] - 1
            out.append(f"aim {aim:g}x, {key}: model {err:+.1%} (target within 15%)")
    return out


def markdown(rows: List[Dict[str, Any]], notes: List[str], machine: str) -> str:
    from .report import table

    header = ["aim (Horovod comm / compute, measured)", "link", "configuration", "step ms", "model step ms",
              "reduction alone ms", "model reduction ms", "cross-host MB / step (links)",
              "cross-host MB / reduction (counted)", "vs Horovod"]
    body = [[f"{r['aim']:g}x ({r['measured_comm_over_compute']:.2f}x)", r["rate"], r["config"],
             f"{r['step_s'] * 1e3:.0f}", f"{r['predicted_step_s'] * 1e3:.0f}", f"{r['alone_s'] * 1e3:.0f}",
             f"{r['predicted_reduction_s'] * 1e3:.0f}", f"{r['cross_host_bytes_per_step'] / 1e6:.2f}",
             "" if r["counted_payload_bytes"] is None else f"{r['counted_payload_bytes'] / 1e6:.2f}",
             f"{r['speedup_vs_horovod']:.2f}x"] for r in rows]
    return "\n".join([
        "## Hierarchical compression on the emulated cluster (`benchmarks/hierarchical.py`)", "",
        f"{machine}. 2 hosts x 2 ranks (horovodrun --gloo), links shaped between hosts only, compute off the "
        "cores (waits of fixed device times). Step: slowest rank's median; cross-host bytes: both hosts' links "
        "per step, the kernel's counter (headers and Horovod's own traffic included); counted: what the "
        "reduction alone sent to the other host, per collective; model: `pipesgd_hvd/auto/model.py` from links, gamma and codec costs "
        "measured in the same launch.", "", table(header, body), "", *[f"- {n}" for n in notes]])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hierarchical", description=__doc__.split("\n")[0])
    parser.add_argument("--aims", type=float, nargs="+", default=list(DEFAULT_AIMS),
                        help="Horovod's all-reduce / compute to aim each launch at")
    parser.add_argument("--rates", nargs="+", default=None, help="tc rates instead of the aims' (e.g. 800mbit 160mbit)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device-times", default="0.03,0.07", help="FORWARD,BACKWARD seconds of the device passes")
    parser.add_argument("--smoke", action="store_true", help="one aim (5x), one round of 3 steps: proves it runs")
    parser.add_argument("--doc", action="store_true", help="write the section of docs/benchmarks.md")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.aims, args.rounds, args.steps = [5.0], 1, 3
    from tools.cluster import horovodrun
    from tools.cluster.netns import Cluster, leftover_namespaces
    from .report import machine_line

    compute = sum(float(t) for t in args.device_times.split(","))
    grad_bytes = 4 * args.layers * (args.dim * args.dim + args.dim)
    rates = args.rates or [rate_for(a, grad_bytes, 4, compute) for a in args.aims]
    rows: List[Dict[str, Any]] = []
    raw: List[Dict[str, Any]] = []
    for aim, rate in zip(args.aims, rates):
        print(f"aim {aim:g}x: link {rate}", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "benchmarks.hierarchical_worker", "--rounds", str(args.rounds), "--steps",
               str(args.steps), "--dim", str(args.dim), "--layers", str(args.layers),
               "--device-times", args.device_times]
        with Cluster(2, rate=rate) as cluster:
            prefix = cluster.prefix
            # HOROVOD_CYCLE_TIME=20 as in benchmarks/throughput.py: Horovod's background loop, awake
            # every cycle, takes the cores the ranks share, and its coordination crosses the hosts
            out = horovodrun.run(cluster, cmd, ranks_per_host=2, env={"OMP_NUM_THREADS": "1", "HOROVOD_CYCLE_TIME": "20"},
                                 timeout=300 + 60 * args.rounds * args.steps)
        if leftover_namespaces(prefix):
            raise RuntimeError(f"namespaces left behind: {leftover_namespaces(prefix)}")
        line = next((ln for ln in out.stdout.splitlines() if MARKER in ln), None)
        if out.returncode != 0 or line is None:
            sys.stderr.write(out.stdout[-6000:])
            raise RuntimeError(f"the launch at {rate} failed (return code {out.returncode})")
        result = json.loads(line.split(MARKER, 1)[1])
        raw.append(result)
        rows += rows_for(aim, rate, result)
    notes = checks(rows, 2)
    text = markdown(rows, notes, machine_line())
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "launches": raw}, f, indent=1)
    if args.doc:
        from .report import write_section

        write_section("hierarchical", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
