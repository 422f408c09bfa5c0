"""The emulated-cluster study's launches, from the JSON their worker prints: medians, bounds, the
timing model's predictions and the targets. How the model is fed from measured parts, never from
the steps it predicts: docs/benchmarks.md, "The emulated cluster" (*Model*) and "Hierarchical
compression on the emulated cluster"."""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from pipesgd_hvd.auto.model import CODECS as MODEL_CODECS
from pipesgd_hvd.auto.model import (CodecParams, LinkParams, compressed_allreduce_time, flat_on_nodes_time,
                                    hierarchical_allreduce_time, sync_iteration_time)
from pipesgd_hvd.pipeline.fusion import DEFAULT_FUSION_THRESHOLD

from .step_time import calls_per_update as calls
from .timing_model import fit_link, pipelined_iteration_time
from .throughput_worker import AUTO, CODECS, CROSS_BYTES, HIERARCHICAL, fusion_buckets, reduction_of

LABELS = {"horovod": "Horovod DistributedOptimizer (sync)", "w1": "pipesgd width 1",
          "w1-layer": "pipesgd width 1, one bucket per layer", "w2": "pipesgd width 2",
          **{f"w2-{c}": f"pipesgd width 2 + {c}{' (EF)' if c in ('int8', 'int4') else ''}" for c in CODECS},
          **{f"w2-split-{c}": f"pipesgd width 2 + split_batch + {c} (EF)" for c in ("int8", "int4")},
          AUTO: "pipesgd auto"}
#: The fixed configurations the auto mode chooses from (pipesgd_hvd.auto.rule.CANDIDATES, width 1 or 2).
AUTO_CHOICES = ("w1", "w2", "w2-fp16", "w2-int8", "w2-int4")


def codec_of(key: str) -> str:
    """The codec a configuration sends: 'none' for float32 (Horovod, width 1, width 2)."""
    return key.rsplit("-", 1)[1] if key.startswith("w2-") else "none"


@dataclass
class Launch:
    """One launch's results, reduced to the slowest rank per sample."""

    hosts: int
    rate: str
    batch: int
    raw: Dict[str, Any]
    waited: float = 0.0         # seconds the driver waited for other jobs before the launch
    busy_at_start: float = 0.0  # cores other jobs kept busy just before it

    @property
    def ranks(self) -> int:
        return int(self.raw["ranks"])

    @property
    def grad_bytes(self) -> int:
        return int(self.raw["grad_bytes"])

    @property
    def configs(self) -> Tuple[str, ...]:
        return tuple(self.raw["configs"])

    @property
    def codecs(self) -> Tuple[str, ...]:
        """The codecs of its width-2 rows (their all-reduces were timed alone too)."""
        return tuple(dict.fromkeys(codec_of(k) for k in self.configs if codec_of(k) != "none"))

    @property
    def offloaded(self) -> bool:
        return bool(self.raw.get("offloaded"))  # compute off the cores

    def samples(self, key: str) -> List[float]:
        """Per sample, the slowest rank's value (every rank runs the same samples in order)."""
        return [max(v) for v in zip(*(r["samples"][key] for r in self.raw["per_rank"]))]

    def median(self, key: str) -> float:
        return statistics.median(self.samples(key))

    def slowest(self, key: str) -> float:
        """The slowest rank's median (the hierarchical kind's)."""
        return max(statistics.median(r["samples"][key]) for r in self.raw["per_rank"] if key in r["samples"])

    def pooled(self, key: str) -> float:
        """The median of every rank's samples: a link's own speed, which one rank's stall (another
        job took its core mid-exchange) should not set."""
        return statistics.median(v for r in self.raw["per_rank"] for v in r["samples"].get(key, []))

    def total(self, key: str) -> float:
        """The sum of the ranks' medians (a host's counter, read on one of its ranks, counts once)."""
        return sum(statistics.median(r["samples"][key]) for r in self.raw["per_rank"] if key in r["samples"])

    def mean_median(self, key: str) -> float:
        """Mean over ranks of each rank's median (CPU times: each rank bills its own)."""
        return statistics.mean(statistics.median(r["samples"][key]) for r in self.raw["per_rank"])

    def cpu_per_step(self, key: str) -> Tuple[float, float, float]:
        """(compute thread, other threads, Horovod's threads among them) CPU seconds per step."""
        return tuple(self.mean_median(f"{kind}/{key}") for kind in ("cpu-main", "cpu-other", "cpu-hvd"))

    def machine_cores(self, key: str) -> float:
        """Cores the whole machine kept busy during a segment (2.0: both, CPU-bound)."""
        return statistics.median(self.raw["per_rank"][0]["samples"][f"cpu-machine/{key}"]) / self.median(key)

    @property
    def compute(self) -> float:
        return self.median("compute")

    def comm(self, codec: str) -> float:
        """The all-reduce alone: float32 (Horovod's op) or our compressed one."""
        return self.median(f"comm-{codec}")

    def bound(self, key: str) -> float:
        """What any schedule of this update can reach at best: max(compute, its all-reduce); for
        split_batch (one all-reduce per update), max(compute, fresh forward + all-reduce): the
        update's sum can start no earlier than the fresh half's backward pass (its buckets go as
        their gradients arrive) and must be done before the next update's fresh half starts."""
        if calls(key) == 2:
            return max(self.compute, self.fresh_forward + self.comm(codec_of(key)))
        return max(self.compute, self.comm(codec_of(key)))

    @property
    def fresh_forward(self) -> float:
        """split_batch's fresh half's forward pass (half of a whole batch's: ``fresh_fraction`` 1/2)."""
        return self.median("forward") / 2

    def loop(self, key: str) -> Optional[float]:
        """The engine-free width-2 loop with this configuration's codec (plain width-2 rows)."""
        return self.median(f"loop-{codec_of(key)}") if key.startswith("w2") and calls(key) == 1 else None

    def core_share(self) -> float:
        """CPU seconds per second a rank got while computing alone (1.0: a whole core)."""
        main, other, _ = self.cpu_per_step("compute")
        return min(1.0, (main + other) / self.compute)

    def reduction_cpu(self, codec: str) -> float:
        """CPU seconds one all-reduce of ``codec`` costs a rank, timed alone, in the threads that run
        it: a byte codec's runs on the pipeline's own channel, so Horovod's threads (its loop wakes
        every cycle, op or not) are left out; the float32 one is Horovod's op: all threads."""
        total = self.mean_median(f"cpu/comm-{codec}")
        return total if codec == "none" else total - self.mean_median(f"cpu-hvd/comm-{codec}")

    def idle_cpu(self, seconds: float, codec: str) -> float:
        """CPU seconds the threads ``reduction_cpu`` bills burn idle over ``seconds`` (an idle segment)."""
        busy = self.mean_median("cpu/idle") - (0.0 if codec == "none" else self.mean_median("cpu-hvd/idle"))
        return busy / self.median("idle") * seconds

    def extra_cpu(self, codec: str) -> float:
        """CPU one all-reduce adds beyond the idle background (which the compute time already holds)."""
        return max(0.0, self.reduction_cpu(codec) - self.idle_cpu(self.comm(codec), codec))

    def horovod_hidden(self) -> float:
        """Share of the float32 all-reduce Horovod's sync step hid behind its backward pass."""
        return (self.compute + self.comm("none") - self.median("horovod")) / self.comm("none")

    @property
    def auto(self) -> Optional[Dict[str, Any]]:
        return self.raw.get("auto")  # what the auto optimizer measured and chose (None: not run)

    def auto_choice(self) -> str:
        """The fixed configuration (a TRAINING key) the auto mode chose."""
        d = self.auto["decision"] if self.auto else {}
        if d.get("width") == 1:
            return "w1"
        return "w2" if d.get("compression") == "none" else f"w2-{d.get('compression')}"

    def foreign_share(self) -> float:
        """Share of the machine's busy CPU time during the launch that was not our ranks'."""
        ours = sum(r["our_cpu_s"] for r in self.raw["per_rank"])
        busy = self.raw["per_rank"][0]["machine_busy_s"]
        return max(0.0, 1.0 - ours / busy) if busy > 0 else 0.0


@dataclass
class Model:
    link: LinkParams
    codecs: Dict[str, CodecParams]
    interference: Dict[str, float]
    overlap: Dict[str, float]       # h per width-1 configuration (Horovod, w1, w1-layer)
    comm: Dict[str, float]          # predicted all-reduce per codec
    step: Dict[str, float]          # predicted update per training configuration


def interference(launch: Launch, codec: str, comm: float) -> float:
    """f such that ``pipelined_iteration_time`` adds the all-reduce's extra CPU (as wall time at
    this rank's core share; none off the cores) to compute: ``comm f/(1+f) = X``."""
    delay = 0.0 if launch.offloaded else launch.extra_cpu(codec) / launch.core_share()
    share = min(0.95, delay / max(comm, 1e-9))
    return share / (1.0 - share)


def width1_buckets(layers: int, grad_bytes: int) -> Dict[str, List[float]]:
    """Each width-1 configuration's buckets as shares of the gradient, in launch order, for
    ``layers`` x Linear(dim, dim): Horovod one per layer; pipesgd's from its own fusion plan,
    default threshold (``w1``) and one layer's bytes (``w1-layer``, as the worker sets it)."""
    dim = int((-1 + (1 + 4 * (grad_bytes // 4 // layers)) ** 0.5) / 2)   # dim^2 + dim floats a layer

    def shares(threshold: int) -> List[float]:
        numels = fusion_buckets(layers, dim, threshold)
        return [numel / sum(numels) for numel in numels]

    return {"horovod": [1 / layers] * layers, "w1": shares(DEFAULT_FUSION_THRESHOLD),
            "w1-layer": shares(int((dim * dim + dim) * 4 / 2**20 * 2**20))}


def bucket_overlap(shares: List[float], backward: float, comm: float) -> float:
    """h of a width-1 step whose buckets hold ``shares`` of the gradient (docs/benchmarks.md, *Model*)."""
    return max(0.0, min(1.0 - shares[-1], backward * (1.0 - shares[0]) / comm))


def fit_model(launch: Launch) -> Model:
    n, m = launch.ranks, launch.grad_bytes
    link = fit_link([(n, m, launch.comm("none")), (n, (m // 16) * 4, launch.median("comm-none-quarter")),
                     (n, 1024, launch.median("ar-small")), (n, m, launch.median("add"), "reduce")])
    codecs: Dict[str, CodecParams] = {"none": MODEL_CODECS["none"]}
    for c in launch.codecs:
        free = MODEL_CODECS[c]  # cost 0: what the wire alone takes
        rest = max(0.0, launch.comm(c) - compressed_allreduce_time(n, m, link, free))
        codecs[c] = dataclasses.replace(free, cost_per_byte=rest / ((n - 1) / n * m))
    comm = {c: compressed_allreduce_time(n, m, link, p) for c, p in codecs.items()}
    # a model-zoo launch records its width-1 buckets (Horovod's at its cycle over the layers' slices)
    shares_of = launch.raw.get("width1_shares") or width1_buckets(int(launch.raw["layers"]), m)
    overlap = {key: bucket_overlap(shares, launch.median("backward"), comm["none"]) for key, shares in shares_of.items()}
    f = {c: interference(launch, c, comm[c]) for c in codecs}
    step = {key: sync_iteration_time(launch.compute, comm["none"], h) for key, h in overlap.items()}
    for key in (k for k in launch.configs if k.startswith("w2")):
        c = codec_of(key)
        if calls(key) == 2:  # split_batch: the all-reduce starts in the fresh half's backward pass
            ahead = launch.fresh_forward
            step[key] = ahead + pipelined_iteration_time(launch.compute - ahead, comm[c], f[c])
        else:
            step[key] = pipelined_iteration_time(launch.compute, comm[c], f[c])
    # every prediction is made; only the rows the launch ran are kept (and compared)
    return Model(link, codecs, f, overlap, comm, {k: t for k, t in step.items() if k in launch.configs})


@dataclass(frozen=True)
class Target:
    name: str
    met: bool
    measured: str


def speedup(launch: Launch, key: str) -> float:
    return launch.median("horovod") / launch.median(key)


def targets(launches: Sequence[Launch], models: Sequence[Model]) -> List[Target]:
    """Issue 15's targets, each computed from the launches: at comm ~5x compute, int8+EF >= 3.5x
    and int4+EF >= 4.5x over Horovod; every pipelined configuration within 10% of its bound; each
    codec's CPU per all-reduce under 20% of compute; width 1 within 3% of Horovod; the timing
    model within 15% of every configuration; auto within 10% of the fastest it could choose."""
    out: List[Target] = []
    # the 2-host launch whose measured comm/compute is closest to 5 (log scale)
    five = min((la for la in launches if la.hosts == 2), key=lambda la: abs(math.log(la.comm("none") / la.compute / 5)),
               default=None)
    if five is not None:
        for key, need in ((k, n) for k, n in (("w2-int8", 3.5), ("w2-int4", 4.5)) if k in five.configs):
            s = speedup(five, key)
            out.append(Target(f"comm ~5x compute ({five.rate}, measured {five.comm('none') / five.compute:.1f}x): "
                              f"{LABELS[key]} >= {need}x over Horovod", s >= need, f"{s:.2f}x"))
    for la, model in zip(launches, models):
        where = f"{la.hosts} hosts, {la.rate}"
        for key in (k for k in la.configs if k.startswith("w2")):
            out.append(Target(f"{where}: {LABELS[key]} within 10% of its bound",
                              la.bound(key) >= la.median(key) / 1.1, f"bound / step = "
                              f"{la.bound(key) / la.median(key):.0%}"))
        for c in la.codecs:
            x = la.reduction_cpu(c)
            out.append(Target(f"{where}: {c} all-reduce's CPU on a rank < 20% of compute", x < 0.2 * la.compute,
                              f"{x * 1e3:.0f} ms = {x / la.compute:.0%}"))
        if "w1" in la.configs:
            r = la.median("w1") / la.median("horovod")
            out.append(Target(f"{where}: width 1 within 3% of Horovod", r <= 1.03, f"width 1 / Horovod = {r:.3f}"))
        ratios = {key: la.median(key) / model.step[key] for key in model.step}
        worst = max(ratios, key=lambda k: abs(ratios[k] - 1))
        out.append(Target(f"{where}: every configuration within 15% of the model",
                          all(abs(q - 1) <= 0.15 for q in ratios.values()),
                          f"{sum(abs(q - 1) <= 0.15 for q in ratios.values())} of {len(ratios)}; furthest: "
                          f"{worst}, step / model = {ratios[worst]:.2f}"))
        if la.auto is not None and all(k in la.configs for k in AUTO_CHOICES):
            best = min(AUTO_CHOICES, key=la.median)
            ratio = la.median(AUTO) / la.median(best)
            out.append(Target(f"{where}: auto within 10% of the fastest configuration it could choose", ratio <= 1.1,
                              f"chose {la.auto_choice()}; auto / fastest ({best}) = {ratio:.2f}"))
    return out


def hierarchical_model(la: Launch) -> Dict[str, float]:
    """The hierarchical kind's predicted reduction per row (module docstring)."""
    local, cross, grad = la.raw["local_size"], la.raw["cross_size"], la.grad_bytes
    (small, large), on_link = CROSS_BYTES, local * (cross - 1)  # a host's link carries all its ranks' exchanges
    t_small, t_large = la.pooled(f"cross-a2a/{small}"), la.pooled(f"cross-a2a/{large}")
    bandwidth, gamma = on_link * (large - small) / max(t_large - t_small, 1e-9), la.pooled("add") / grad
    between = LinkParams(max(t_small - on_link * small / bandwidth, 0.0) / max(cross - 1, 1), bandwidth, gamma)
    inside = LinkParams(0.0, (local - 1) * 4 * -(-grad // 4 // local) / la.pooled("local-a2a"), gamma)
    out = {"horovod": compressed_allreduce_time(la.ranks, grad, between, MODEL_CODECS["none"])}
    for key in HIERARCHICAL:
        codec = key.rsplit("-", 1)[1]
        params = dataclasses.replace(MODEL_CODECS[codec], cost_per_byte=la.pooled(f"codec/{codec}") / grad)
        timing = hierarchical_allreduce_time if "-hier-" in key else flat_on_nodes_time
        # bucket after bucket, as the engine's comm thread runs them
        out[key] = sum(timing(local, cross, 4 * numel, inside, between, params) for numel in la.raw["buckets"])
    return out


def hierarchical_rows(la: Launch) -> List[Dict[str, Any]]:
    """Per row: step, reduction alone, the model's, both hosts' links' bytes per step, what the
    reduction alone sent to the other host (all ranks), speed-up."""
    compute, model, out = la.slowest("compute"), hierarchical_model(la), []
    for key in ("horovod", *HIERARCHICAL):
        alone = "comm-none" if key == "horovod" else f"comm-{reduction_of(key)}"
        out.append({"config": key, "step": la.slowest(key), "compute": compute, "alone": la.slowest(alone),
                    "model_comm": model[key], "model_step": (compute + model[key] if key == "horovod"
                                                             else max(compute, model[key])),
                    "host_bytes": la.total(f"host-bytes/{key}"),
                    "counted": None if key == "horovod" else la.total(f"payload/{alone}"),
                    "speedup": la.slowest("horovod") / la.slowest(key)})
    return out


def hierarchical_targets(where: str, aim: Optional[float], rows: List[Dict[str, Any]], local: int) -> List[Target]:
    """Issue 33's: hierarchical int8's (and int4's) bytes between hosts, counted per collective, at
    most 1/local of flat's; at comm ~5x compute hierarchical int8 >= 1.5x faster than flat int8; it
    within 10% of max(compute, its reduction alone); the model within 15% of the hierarchical rows."""
    at, out = {r["config"]: r for r in rows}, []
    for codec in ("int8", "int4"):
        flat, hier = at[f"w2-flat-{codec}"], at[f"w2-hier-{codec}"]
        counted = hier["counted"] / flat["counted"]
        out.append(Target(f"{where}: hierarchical {codec}'s bytes between hosts <= 1/{local} of flat's",
                          counted <= 1 / local, f"{counted:.3f} counted per collective, "
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


#: The model-zoo kind's targets (issue 42): at comm ~5x compute, these models' int8+EF rows at least
#: ``ZOO_SPEEDUP`` x over Horovod and within 10% of their bound; the timing model within 15% of every row.
ZOO_TARGET_MODELS = ("resnet50", "bert-base")
ZOO_SPEEDUP = 3.5


def zoo_targets(settings: Sequence[Dict[str, Any]], launches: Sequence[Launch], models: Sequence[Model]) -> List[Target]:
    """Issue 42's targets, per launch (a model on some hosts at one aim): comm/compute within 20% of
    its aim; at the aim 5, int8+EF >= 3.5x over Horovod and within 10% of max(compute, its all-reduce)
    for ResNet-50 and BERT-base; every row within 15% of the timing model."""
    from .throughput_plan import off_aim

    out: List[Target] = []
    for setting, la, model in zip(settings, launches, models):
        name, aim = la.raw.get("model"), setting["target"]
        where = f"{name}, {la.hosts} hosts, {la.rate}"
        ratio = la.comm("none") / la.compute
        out.append(Target(f"{where}: comm/compute within 20% of its aim {aim:g}", off_aim(ratio, aim) is None,
                          f"{ratio:.2f}"))
        if aim == 5.0 and name in ZOO_TARGET_MODELS and "w2-int8" in la.configs:
            s = speedup(la, "w2-int8")
            out.append(Target(f"{where}: {LABELS['w2-int8']} >= {ZOO_SPEEDUP}x over Horovod", s >= ZOO_SPEEDUP,
                              f"{s:.2f}x"))
            step, bound = la.median("w2-int8"), la.bound("w2-int8")
            out.append(Target(f"{where}: {LABELS['w2-int8']} within 10% of max(compute, its all-reduce)",
                              step <= 1.1 * bound, f"step / bound = {step / bound:.2f}"))
        ratios = {key: la.median(key) / model.step[key] for key in model.step}
        worst = max(ratios, key=lambda k: abs(ratios[k] - 1))
        out.append(Target(f"{where}: every configuration within 15% of the model",
                          all(abs(q - 1) <= 0.15 for q in ratios.values()),
                          f"{sum(abs(q - 1) <= 0.15 for q in ratios.values())} of {len(ratios)}; furthest: "
                          f"{worst}, step / model = {ratios[worst]:.2f}"))
    return out
