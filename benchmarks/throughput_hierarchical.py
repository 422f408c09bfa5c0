"""The hierarchical kind of the emulated-cluster study (``python -m benchmarks.throughput
--hierarchical``, issue 33): 2 hosts x 2 ranks, links shaped between the hosts only, compute off
the cores. Its table, the timing model beside each row and the targets, from a record.

Per row: the median step (the slowest rank's), its reduction timed alone, the bytes both hosts'
links sent per step (the kernel's counter: headers and Horovod's own traffic included), the bytes
the reduction alone sent to the other host (counted per collective), and the model's prediction
(``pipesgd_hvd/auto/model.py``: ``flat_on_nodes_time`` or ``hierarchical_allreduce_time`` bucket
after bucket) from the link between hosts (alltoalls of two sizes on the cross-node groups), the
links inside one (an alltoall on the node group), gamma (a float32 add) and each codec's encode +
decode, all measured in the same launch: a width-2 step at max(compute, reduction), Horovod's at
compute + its all-reduce.
"""
from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from pipesgd_hvd.auto.model import CODECS as MODEL_CODECS
from pipesgd_hvd.auto.model import LinkParams, compressed_allreduce_time, flat_on_nodes_time, hierarchical_allreduce_time

from .report import table
from .throughput_analysis import Launch, Target
from .throughput_report import ms, target_rows
from .throughput_worker import CROSS_BYTES, HIERARCHICAL, reduction_of


def slowest(la: Launch, key: str) -> float:
    """The slowest rank's median of ``key``."""
    return max(statistics.median(r["samples"][key]) for r in la.raw["per_rank"] if key in r["samples"])


def pooled(la: Launch, key: str) -> float:
    """The median of every rank's samples: a link's own speed, which one rank's stall (another job
    took its core mid-exchange) should not set."""
    return statistics.median(v for r in la.raw["per_rank"] for v in r["samples"].get(key, []))


def links(la: Launch) -> Tuple[LinkParams, LinkParams, Dict[str, float]]:
    """The link between hosts, the links inside one, and each codec's cost per gradient byte."""
    local, cross, grad = la.raw["local_size"], la.raw["cross_size"], la.grad_bytes
    small, large = CROSS_BYTES
    t_small, t_large = pooled(la, f"cross-a2a/{small}"), pooled(la, f"cross-a2a/{large}")
    on_link = local * (cross - 1)  # a host's link carries every local rank's exchange at once
    bandwidth = on_link * (large - small) / max(t_large - t_small, 1e-9)
    alpha = max(t_small - on_link * small / bandwidth, 0.0) / max(cross - 1, 1)
    gamma = pooled(la, "add") / grad
    local_bandwidth = (local - 1) * 4 * -(-grad // 4 // local) / pooled(la, "local-a2a")
    costs = {c: pooled(la, f"codec/{c}") / grad for c in ("int8", "int4")}
    return LinkParams(alpha, bandwidth, gamma), LinkParams(0.0, local_bandwidth, gamma), costs


def predicted_reduction(la: Launch, key: str) -> float:
    cross_link, local_link, costs = links(la)
    if key == "horovod":
        return compressed_allreduce_time(la.ranks, la.grad_bytes, cross_link, MODEL_CODECS["none"])
    codec = key.rsplit("-", 1)[1]
    params = dataclasses.replace(MODEL_CODECS[codec], cost_per_byte=costs[codec])
    timing = hierarchical_allreduce_time if "-hier-" in key else flat_on_nodes_time
    return sum(timing(la.raw["local_size"], la.raw["cross_size"], 4 * numel, local_link, cross_link, params)
               for numel in la.raw["buckets"])  # bucket after bucket, as the engine's comm thread runs them


def rows(la: Launch) -> List[Dict[str, Any]]:
    compute, horovod = slowest(la, "compute"), slowest(la, "horovod")
    out = []
    for key in ("horovod", *HIERARCHICAL):
        alone = "comm-none" if key == "horovod" else f"comm-{reduction_of(key)}"
        comm = predicted_reduction(la, key)
        out.append({"config": key, "step": slowest(la, key), "compute": compute, "alone": slowest(la, alone),
                    "model_comm": comm, "model_step": compute + comm if key == "horovod" else max(compute, comm),
                    "host_bytes": sum(statistics.median(r["samples"][f"host-bytes/{key}"]) for r in la.raw["per_rank"]
                                      if f"host-bytes/{key}" in r["samples"]),
                    "counted": None if key == "horovod" else sum(statistics.median(r["samples"][f"payload/{alone}"])
                                                                 for r in la.raw["per_rank"]),
                    "speedup": horovod / slowest(la, key)})
    return out


def targets(where: str, aim: Optional[float], found: List[Dict[str, Any]], local_size: int) -> List[Target]:
    """Issue 33's: hierarchical int8's bytes between hosts at most 1/local_size of flat int8's (and
    int4's); at comm ~5x compute hierarchical int8 at least 1.5x faster than flat int8; hierarchical
    int8 within 10% of max(compute, its reduction alone); the model within 15% of the hierarchical rows."""
    at = {r["config"]: r for r in found}
    out = []
    for codec in ("int8", "int4"):
        flat, hier = at[f"w2-flat-{codec}"], at[f"w2-hier-{codec}"]
        counted = hier["counted"] / flat["counted"]
        out.append(Target(f"{where}: hierarchical {codec}'s bytes between hosts <= 1/{local_size} of flat's",
                          counted <= 1 / local_size, f"{counted:.3f} counted per collective, "
                          f"{hier['host_bytes'] / flat['host_bytes']:.3f} on the links (kernel)"))
    h8, f8 = at["w2-hier-int8"], at["w2-flat-int8"]
    if aim == 5.0:
        gain = f8["step"] / h8["step"]
        out.append(Target(f"{where}: hierarchical int8 >= 1.5x faster than flat int8", gain >= 1.5, f"{gain:.2f}x"))
    bound = max(h8["compute"], h8["alone"])
    out.append(Target(f"{where}: hierarchical int8 within 10% of max(compute, its all-reduce alone)",
                      h8["step"] <= 1.1 * bound, f"step / bound = {h8['step'] / bound:.2f}"))
    for key in ("w2-hier-int8", "w2-hier-int4"):
        ratio = at[key]["step"] / at[key]["model_step"]
        out.append(Target(f"{where}: {key} within 15% of the model", abs(ratio - 1) <= 0.15,
                          f"step / model = {ratio:.2f}"))
    return out


def render(record: Dict[str, Any], image: Optional[Path] = None) -> str:
    """The section from a record (no plot: ``image`` is not drawn)."""
    args, body, found = record["args"], [], []
    launches = [Launch(**la) for la in record["launches"]]
    for setting, la in zip(record["settings"], launches):
        aim, measured = setting["target"], slowest(la, "comm-none") / slowest(la, "compute")
        where = f"{la.rate} ({'' if aim is None else f'aim {aim:g}x, '}measured {measured:.2f}x)"
        found_rows = rows(la)
        found += targets(where, aim, found_rows, la.raw["local_size"])
        body += [[where, r["config"], ms(r["step"]), ms(r["model_step"]), ms(r["alone"]), ms(r["model_comm"]),
                  f"{r['host_bytes'] / 1e6:.2f}", "" if r["counted"] is None else f"{r['counted'] / 1e6:.2f}",
                  f"{r['speedup']:.2f}x"] for r in found_rows]
    device = "/".join(ms(t) for t in args["device_times"])
    return "\n".join([
        "## Hierarchical compression on the emulated cluster (`benchmarks/throughput.py --hierarchical`, "
        "`make bench`)", "",
        f"{record['machine']}; {record['elapsed_s'] / 60:.1f} min for {len(launches)} launches. 2 hosts x 2 ranks "
        f"(horovodrun --gloo), links shaped between hosts only; {args['layers']} x Linear({args['dim']}, "
        f"{args['dim']}), {launches[0].grad_bytes / 1e6:.1f} MB of float32 gradient; compute off the cores: "
        f"forward / backward waits {device} ms; HOROVOD_CYCLE_TIME={args['horovod_cycle_ms']:g}; {args['rounds']} "
        f"rounds of {args['steps']} timed steps. Samples: `build/hierarchical.json`.", "",
        table(["link (Horovod comm / compute)", "configuration", "step ms", "model step ms", "reduction alone ms",
               "model reduction ms", "cross-host MB / step (links)", "cross-host MB / reduction (counted)",
               "vs Horovod"], body), "", "### Targets", "", f"{sum(t.met for t in found)} of {len(found)} targets met.",
        "", table(["target", "result", "measured"], target_rows(found))]) + "\n"
