"""Analysis of one throughput launch: medians, bounds, the timing model's predictions, targets.

Input: the JSON a launch of ``benchmarks/throughput_worker.py`` prints. Every number here is
derived from it; nothing is assumed about the machine.

The model (``pipesgd_hvd.auto.model``) gets only measurements of parts, never of the training steps
it predicts:

* the link (alpha, bandwidth, gamma) from ``fit_link`` on float32 all-reduces of three sizes
  timed alone and one float32 add of the gradient (gamma);
* each codec's cost c from our compressed all-reduce timed alone (bucket by bucket of the fusion
  plan, as the engine runs it), less the wire time the fitted link gives it, per byte of the
  model's ``(N-1)/N M c`` term: all our all-reduce spends beyond a ring on the compressed bytes
  (the codec work, and Horovod's alltoall and allgather being slower per byte than its
  all-reduce). One size: a two-size fit (``fit_codec``) drops the fixed
  cost per call, which is not small here, and the model has no term for it;
* the compute time (forward + backward + update) and its backward share, timed alone;
* the interference f per codec (``pipelined_iteration_time``): with one core per rank, the CPU
  time X an all-reduce costs the rank (timed alone, in the threads that run it: a byte codec's
  leaves Horovod's background loop out, ``Launch.reduction_cpu``) beyond what those threads burn
  idle over as long (in training that is already inside the compute time) is taken from
  compute when the two run side by side, so ``l_comm f/(1+f) = X``, X scaled to wall time by the
  share of a core the rank got for compute alone (other jobs took the rest); f = 0 when compute
  runs off the cores (``--offload-compute``: it waits and holds no core);
* the overlap h of a width-1 step (``sync_iteration_time``), from its buckets: a bucket starts
  once its gradients are in, so the backward pass after the first bucket is ready can hide
  communication and the last bucket's cannot be hidden: ``h = min(1 - s_last, bwd (1 - s_first)
  / l_AR)``, s the bucket's share of the gradient (backward time taken as proportional to bytes).
  Horovod starts each layer as it is ready (``(L-1)/L`` both ways); pipesgd's buckets are those
  ``pipesgd_hvd.pipeline.fusion.plan_buckets`` gives the benchmark's model (one bucket: h = 0).
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from pipesgd_hvd.auto.model import (CODECS as MODEL_CODECS, CodecParams, LinkParams, compressed_allreduce_time,
                                fit_link, pipelined_iteration_time, ring_allreduce_time,
                                sync_iteration_time)

from pipesgd_hvd.pipeline.fusion import DEFAULT_FUSION_THRESHOLD

from .throughput_worker import AUTO, CODECS, TRAINING, fusion_buckets

LABELS = {"horovod": "Horovod DistributedOptimizer (sync)", "w1": "pipesgd width 1",
          "w1-layer": "pipesgd width 1, one bucket per layer", "w2": "pipesgd width 2",
          **{f"w2-{c}": f"pipesgd width 2 + {c}{' (EF)' if c in ('int8', 'int4') else ''}" for c in CODECS},
          AUTO: "pipesgd auto"}
#: The fixed configurations the auto mode chooses from (pipesgd_hvd.auto.rule.CANDIDATES, width 1 or 2).
AUTO_CHOICES = ("w1", "w2", "w2-fp16", "w2-int8", "w2-int4")


def codec_of(key: str) -> str:
    """The codec a configuration sends: 'none' for float32 (Horovod, width 1, width 2)."""
    return key[3:] if key.startswith("w2-") else "none"


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
        """The training configurations this launch ran (TRAINING keys; all unless ``--configs``)."""
        return tuple(self.raw.get("configs", TRAINING))

    @property
    def codecs(self) -> Tuple[str, ...]:
        """The codecs of its width-2 rows: their compressed all-reduces were timed alone too."""
        return tuple(codec_of(k) for k in self.configs if k.startswith("w2-"))

    def samples(self, key: str) -> List[float]:
        """Per sample, the slowest rank's value (every rank runs the same samples in order)."""
        per_rank = [r["samples"][key] for r in self.raw["per_rank"] if key in r["samples"]]
        return [max(v) for v in zip(*per_rank)]

    def median(self, key: str) -> float:
        return statistics.median(self.samples(key))

    def mean_median(self, key: str) -> float:
        """Mean over ranks of each rank's median (CPU times: each rank bills its own)."""
        return statistics.mean(statistics.median(r["samples"][key]) for r in self.raw["per_rank"])

    def cpu_per_step(self, key: str) -> Tuple[float, float]:
        """(main thread, other threads) CPU seconds per step of a training segment."""
        return self.mean_median(f"cpu-main/{key}"), self.mean_median(f"cpu-other/{key}")

    def machine_cores(self, key: str) -> float:
        """Cores the whole machine kept busy during a segment (2.0: both, CPU-bound)."""
        per_step = statistics.median(self.raw["per_rank"][0]["samples"][f"cpu-machine/{key}"])
        return per_step / self.median(key)

    def loop(self, key: str) -> float:
        """The engine-free pipelined loop with this configuration's codec (width-2 rows)."""
        return self.median(f"loop-{codec_of(key)}")

    def core_share(self) -> float:
        """CPU seconds per second a rank got while computing alone (1.0: a whole core)."""
        return min(1.0, sum(self.cpu_per_step("compute")) / self.compute)

    @property
    def offloaded(self) -> bool:
        """Whether compute ran off the cores (the worker's ``--offload-compute``: waits as long as
        the real forward and backward passes, as an accelerator's step looks from the host)."""
        return bool(self.raw.get("offloaded"))

    def compute_delay(self, cpu: float) -> float:
        """Wall time compute loses to ``cpu`` seconds of the rank's other threads running beside
        it. With one core per rank, all of it, at the share of a core the rank got for compute alone
        (other jobs took the rest). Compute off the cores waits on its device and holds no core:
        it loses none (the host work left in a step, the update, is in the compute time)."""
        return 0.0 if self.offloaded else cpu / self.core_share()

    def comm_cpu(self, codec: str) -> float:
        """CPU seconds (all threads) one all-reduce of ``codec`` costs a rank, timed alone."""
        return self.mean_median(f"cpu/comm-{codec}")

    def horovod_cpu(self, key: str) -> Optional[float]:
        """CPU seconds Horovod's own threads took during ``key`` (per step of a training segment),
        told apart by their thread clocks (benchmarks/thread_cpu.py); None in a record from before
        the worker told them apart."""
        name = f"cpu-hvd/{key}"
        if not all(name in r["samples"] for r in self.raw["per_rank"]):
            return None
        return self.mean_median(name)

    def horovod_apart(self, codec: str) -> bool:
        """Whether ``reduction_cpu`` leaves Horovod's threads out of ``codec``'s all-reduce: a
        byte codec's runs on the pipeline's own channel, beside Horovod's background loop (which
        wakes every cycle, op or not), in a record that tells Horovod's threads apart. The float32
        one timed alone is Horovod's own all-reduce: its threads do the work."""
        return codec != "none" and self.horovod_cpu(f"comm-{codec}") is not None

    def reduction_cpu(self, codec: str) -> float:
        """CPU seconds one all-reduce of ``codec`` costs a rank, timed alone, in the threads that run
        it: for a byte codec every thread but Horovod's (the codec, the pipeline channel's
        transport, the copies and the sum), else all threads."""
        hvd = self.horovod_cpu(f"comm-{codec}") if self.horovod_apart(codec) else None
        return self.comm_cpu(codec) - (hvd or 0.0)


    @property
    def compute(self) -> float:
        return self.median("compute")

    def comm(self, codec: str) -> float:
        """The all-reduce alone: float32 (Horovod's op) or our compressed one."""
        return self.median(f"comm-{codec}")

    def bound(self, key: str) -> float:
        """max(compute, communication): what any schedule of this step can reach at best."""
        return max(self.compute, self.comm(codec_of(key)))

    def horovod_hidden(self) -> float:
        """Share of the float32 all-reduce Horovod's sync step hid behind its backward pass."""
        return (self.compute + self.comm("none") - self.median("horovod")) / self.comm("none")

    @property
    def auto(self) -> Optional[Dict[str, Any]]:
        """What the auto optimizer measured and decided before the rounds (None if it did not run)."""
        return self.raw.get("auto")

    def auto_choice(self) -> str:
        """The fixed configuration (a TRAINING key) the auto mode chose."""
        assert self.auto is not None
        d = self.auto["decision"]
        if d["width"] == 1:
            return "w1"
        return "w2" if d["compression"] == "none" else f"w2-{d['compression']}"

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
    step: Dict[str, float]          # predicted step per training configuration


def background_cpu(launch: Launch, seconds: float, *, horovod: bool = True) -> float:
    """CPU seconds a rank's threads burn over ``seconds`` with nothing to do: Horovod's background
    loop wakes every cycle, op or not (benchmarks/cycle_time.py). Their rate in an idle segment
    timed beside the collectives; a record without one takes their rate during compute alone.
    ``horovod=False``: the threads other than Horovod's, where the record tells them apart."""
    if all("cpu/idle" in r["samples"] for r in launch.raw["per_rank"]):
        busy = launch.mean_median("cpu/idle")
        if not horovod:
            busy -= launch.horovod_cpu("idle") or 0.0
        rate = busy / launch.median("idle")
    else:
        rate = launch.cpu_per_step("compute")[1] / launch.compute
    return rate * seconds


def extra_cpu(launch: Launch, codec: str) -> float:
    """CPU seconds one all-reduce of ``codec`` adds to a rank: its threads' CPU while it ran
    alone (``Launch.reduction_cpu``: Horovod's left out where told apart), less what the same
    threads burn idle over as long. During training that background is already inside the compute
    time: billing it again with the all-reduce overestimated the compressed rows by up to ~20% on a
    slow machine."""
    return max(0.0, launch.reduction_cpu(codec) - background_cpu(launch, launch.comm(codec),
                                                                   horovod=not launch.horovod_apart(codec)))


def interference(launch: Launch, codec: str, comm: float) -> float:
    """f such that ``pipelined_iteration_time`` adds the all-reduce's extra CPU time (as wall
    time at this rank's core share) to compute: ``comm f/(1+f) = X``."""
    delay = launch.compute_delay(extra_cpu(launch, codec))
    share = min(0.95, delay / max(comm, 1e-9))
    return share / (1.0 - share)


def width1_buckets(layers: int, grad_bytes: int) -> Dict[str, List[float]]:
    """Each width-1 configuration's buckets as shares of the gradient, in launch order, for the
    benchmark's model (``layers`` x Linear(dim, dim), float32): Horovod one per layer; pipesgd's
    from its own fusion plan, default threshold (``w1``) and one layer's bytes (``w1-layer``)."""
    per_layer = grad_bytes // 4 // layers                      # dim^2 + dim floats
    dim = int((-1 + (1 + 4 * per_layer) ** 0.5) / 2)

    def shares(threshold: int) -> List[float]:
        numels = fusion_buckets(layers, dim, threshold)
        return [numel / sum(numels) for numel in numels]

    # w1-layer: the fusion_threshold_mb the worker gives it, converted as the options do
    layer_mb = (dim * dim + dim) * 4 / 2**20
    return {"horovod": [1 / layers] * layers, "w1": shares(DEFAULT_FUSION_THRESHOLD),
            "w1-layer": shares(int(layer_mb * 2**20))}


def bucket_overlap(shares: List[float], backward: float, comm: float) -> float:
    """h of a width-1 step whose buckets hold ``shares`` of the gradient (module docstring)."""
    return max(0.0, min(1.0 - shares[-1], backward * (1.0 - shares[0]) / comm))


def fit_model(launch: Launch) -> Model:
    n, m = launch.ranks, launch.grad_bytes
    quarter_bytes = (m // 4 // 4) * 4
    link = fit_link([(n, m, launch.median("comm-none")), (n, quarter_bytes, launch.median("comm-none-quarter")),
                     (n, 1024, launch.median("ar-small")), (n, m, launch.median("add"), "reduce")])
    share = (n - 1) / n
    codecs: Dict[str, CodecParams] = {"none": MODEL_CODECS["none"]}
    for c in launch.codecs:
        free = MODEL_CODECS[c]  # cost 0: what the wire alone takes
        rest = max(0.0, launch.comm(c) - compressed_allreduce_time(n, m, link, free))
        codecs[c] = dataclasses.replace(free, cost_per_byte=rest / (share * m))
    layers = int(launch.raw["layers"])
    comm = {c: compressed_allreduce_time(n, m, link, p) for c, p in codecs.items()}
    comm["none"] = ring_allreduce_time(n, m, link)
    backward = launch.median("backward")
    overlap = {key: bucket_overlap(shares, backward, comm["none"])
               for key, shares in width1_buckets(layers, m).items()}
    f = {c: interference(launch, c, comm[c]) for c in ("none", *launch.codecs)}
    compute = launch.compute
    step = {**{key: sync_iteration_time(compute, comm["none"], h) for key, h in overlap.items()},
            "w2": pipelined_iteration_time(compute, comm["none"], f["none"]),
            **{f"w2-{c}": pipelined_iteration_time(compute, comm[c], f[c]) for c in launch.codecs}}
    # every prediction is made; only the rows the launch ran are kept (and compared)
    return Model(link, codecs, f, overlap, comm, {k: t for k, t in step.items() if k in launch.configs})


@dataclass(frozen=True)
class Target:
    name: str
    met: bool
    measured: str
    cause: str = ""


def over_bound(bound: float, step: float) -> bool:
    """Whether a width-2 step took more than 10% over its bound, max(compute, its all-reduce)
    (the target's margin)."""
    return bound < step / 1.1


def speedup(launch: Launch, key: str) -> float:
    return launch.median("horovod") / launch.median(key)


def closest(launches: List[Launch], ratio: float) -> Optional[Launch]:
    """The 2-host launch whose measured comm/compute is closest to ``ratio`` (log scale)."""
    import math

    two = [la for la in launches if la.hosts == 2]
    if not two:
        return None
    return min(two, key=lambda la: abs(math.log(la.comm("none") / la.compute / ratio)))


def phase_rates(launch: Launch) -> Dict[str, float]:
    """Bits per second each rank sent: Horovod's float32 all-reduce (2 (N-1)/N of the gradient),
    the pipeline channel's alltoall and allgather of int8-sized chunks ((N-1) chunks each: the
    compressed all-reduce's phases), and a plain TCP exchange
    of one chunk each way between ranks 0 and 1 (the link's own full-duplex rate)."""
    n, row = launch.ranks, launch.raw["row_bytes"]
    rates = {"float32 all-reduce": 2 * (n - 1) / n * launch.grad_bytes / launch.comm("none"),
             "alltoall": (n - 1) * row / launch.median("a2a-int8"),
             "allgather": (n - 1) * row / launch.median("ag-int8")}
    if any("tcp-exchange" in r["samples"] for r in launch.raw["per_rank"]):
        rates["plain TCP"] = row / launch.median("tcp-exchange")
    return {k: v * 8 for k, v in rates.items()}


def horovods_share(launch: Launch, key: str) -> str:
    """", N of it Horovod's" for a training segment whose record tells Horovod's threads apart: its
    background loop slows while the link is busy, so a codec that leaves the link idle longer
    gives it more cycles (and the core less)."""
    hvd = launch.horovod_cpu(key)
    return "" if hvd is None else f", {hvd * 1e3:.0f} ms of it Horovod's"


def cause(launch: Launch, key: str) -> str:
    """The measured reason a pipelined step is slower than wanted: the rank's one core when
    compute plus the all-reduce's CPU exceeds the all-reduce, else the all-reduce itself; with
    compute off the cores and the all-reduce within compute, the schedule itself."""
    codec = codec_of(key)
    main, other = launch.cpu_per_step(key)
    x = extra_cpu(launch, codec)
    loop = (f"the engine-free loop took {launch.loop(key) * 1e3:.0f} ms (engine / loop = "
            f"{launch.median(key) / launch.loop(key):.2f})")
    cpu_bound = launch.compute + launch.compute_delay(x)
    if launch.offloaded and launch.comm(codec) <= launch.compute:
        return (f"the schedule, with compute off the cores (it held no core): {loop}; the {codec} all-reduce alone "
                f"{launch.comm(codec) * 1e3:.0f} ms, compute alone {launch.compute * 1e3:.0f} ms; in training the "
                f"rank's threads used {(main + other) * 1e3:.0f} ms CPU per step{horovods_share(launch, key)}, the "
                f"machine {launch.machine_cores(key):.1f} cores")
    if cpu_bound > launch.comm(codec):
        return (f"CPU: {loop}; the all-reduce alone costs the rank {x * 1e3:.0f} ms CPU of its own (codec + "
                f"transport), which compute loses on the rank's one core: compute + that = {cpu_bound * 1e3:.0f} ms "
                f"vs bound {launch.bound(key) * 1e3:.0f} ms; in training the threads beside compute used "
                f"{other * 1e3:.0f} ms CPU per step{horovods_share(launch, key)} (compute thread "
                f"{main * 1e3:.0f} ms), the machine "
                f"{launch.machine_cores(key):.1f} cores")
    rates = phase_rates(launch)
    text = (f"the all-reduce: {loop}, the {codec} all-reduce alone {launch.comm(codec) * 1e3:.0f} ms, of which "
            f"{x * 1e3:.0f} ms CPU of its own on the rank (codec + transport). Its alltoall and allgather moved "
            f"{rates['alltoall'] / 1e6:.0f} and {rates['allgather'] / 1e6:.0f} Mbit/s per rank, Horovod's float32 "
            f"all-reduce {rates['float32 all-reduce'] / 1e6:.0f}")
    if "plain TCP" in rates:
        text += f", plain TCP both ways {rates['plain TCP'] / 1e6:.0f}"
    return text + f" (link {launch.rate})"


def model_cause(launch: Launch, model: Model, key: str) -> str:
    """What the model assumed for ``key``, next to what was measured."""
    step = launch.median(key) * 1e3
    if not key.startswith("w2"):
        hidden = (launch.compute + launch.comm("none") - launch.median(key)) / launch.comm("none")
        h = model.overlap[key]
        return (f"{LABELS[key]} {step:.0f} ms vs compute + (1 - h) all-reduce = {model.step[key] * 1e3:.0f} ms: the "
                f"model hides h = {h:.0%} of the all-reduce, the step hid {hidden:.0%}")
    codec = codec_of(key)
    beside = (" (off the cores: the all-reduce's CPU takes none of it)" if launch.offloaded else
              f" + its extra CPU {extra_cpu(launch, codec) * 1e3:.0f}")
    return (f"{LABELS[key]} {step:.0f} ms vs max(all-reduce {model.comm[codec] * 1e3:.0f}, compute "
            f"{launch.compute * 1e3:.0f}{beside}) = "
            f"{model.step[key] * 1e3:.0f} ms "
            f"(engine-free loop {launch.loop(key) * 1e3:.0f} ms)")


def targets(launches: List[Launch], models: Mapping[int, Model]) -> List[Target]:
    """Issue 15's targets, each computed from the launches: at comm ~5x compute, int8+EF >= 3.5x
    and int4+EF >= 4.5x over Horovod; every pipelined configuration within 10% of max(compute,
    its all-reduce alone); each codec's CPU per all-reduce under 20% of compute; width 1 within 3%
    of Horovod in every launch; the timing model within 15% of every configuration."""
    out: List[Target] = []
    five = closest(launches, 5.0)
    if five is not None:
        ratio = five.comm("none") / five.compute
        for key, need in ((k, n) for k, n in (("w2-int8", 3.5), ("w2-int4", 4.5)) if k in five.configs):
            s = speedup(five, key)
            out.append(Target(f"comm ≈ 5x compute ({five.rate}, measured {ratio:.1f}x): {LABELS[key]} >= {need}x "
                              "over Horovod", s >= need, f"{s:.2f}x", "" if s >= need else cause(five, key)))
    for i, la in enumerate(launches):
        where = f"{la.hosts} hosts, {la.rate}"
        for key in (k for k in la.configs if k.startswith("w2")):
            eff, missed = la.bound(key) / la.median(key), over_bound(la.bound(key), la.median(key))
            out.append(Target(f"{where}: {LABELS[key]} within 10% of max(compute, its all-reduce)", not missed,
                              f"bound / step = {eff:.0%}", cause(la, key) if missed else ""))
        for c in la.codecs:
            x, hvd = la.reduction_cpu(c), la.horovod_cpu(f"comm-{c}")
            met = x < 0.2 * la.compute
            beside = "" if not la.horovod_apart(c) else f" (Horovod's threads another {hvd * 1e3:.0f} ms over as long)"
            out.append(Target(f"{where}: {c} all-reduce's CPU on a rank < 20% of compute", met,
                              f"{x * 1e3:.0f} ms = {x / la.compute:.0%} of compute {la.compute * 1e3:.0f} ms{beside}",
                              "" if met else cpu_cause(la, c)))
        if "w1" in la.configs:
            r = la.median("w1") / la.median("horovod")
            out.append(Target(f"{where}: width 1 within 3% of Horovod", r <= 1.03, f"width 1 / Horovod = {r:.3f}",
                              "" if r <= 1.03 else width1_cause(la)))
        model = models[i]
        ratios = {key: la.median(key) / model.step[key] for key in la.configs}
        missed = [key for key, q in ratios.items() if abs(q - 1) > 0.15]
        worst = max(ratios, key=lambda k: abs(ratios[k] - 1))
        out.append(Target(f"{where}: every configuration within 15% of the model", not missed,
                          f"{len(ratios) - len(missed)} of {len(ratios)}; furthest: {LABELS[worst]}, step / model = "
                          f"{ratios[worst]:.2f}", "; ".join(model_cause(la, model, key) for key in missed)))
    return out


def cpu_cause(la: Launch, codec: str) -> str:
    """Where a compressed all-reduce's CPU goes: the codec's encode + decode of the gradient on
    one rank, timed alone (``codec-<c>``), what the same threads burn over as long with nothing
    to do, and the rest (transport, copies, sum)."""
    x, codec_s = la.reduction_cpu(codec), la.median(f"codec-{codec}")
    apart = la.horovod_apart(codec)
    idle = background_cpu(la, la.comm(codec), horovod=not apart)
    whose = ("the rank's threads other than Horovod's burn" if apart else
             "the rank's threads burn")
    text = (f"encode + decode of the gradient alone took {codec_s * 1e3:.0f} ms on one rank; over the all-reduce's "
            f"{la.comm(codec) * 1e3:.0f} ms {whose} {idle * 1e3:.0f} ms with nothing to do"
            + ("" if apart else " (Horovod's background loop: benchmarks/cycle_time.py)"))
    if idle >= x:
        return text + f", more than its {x * 1e3:.0f} ms: what it costs here is the threads' background"
    return text + (f"; the rest of its {x * 1e3:.0f} ms CPU ({max(0.0, x - codec_s - idle) * 1e3:.0f} ms) is its "
                   "transport, copies and sum")


def width1_cause(la: Launch) -> str:
    """Width 1 against Horovod: how much of the float32 all-reduce each hid behind the backward pass."""
    hid = (la.compute + la.comm("none") - la.median("w1")) / la.comm("none")
    layer = (f"; width 1 with one bucket per layer: {la.median('w1-layer') / la.median('horovod'):.3f} of Horovod"
             if "w1-layer" in la.configs else "")
    return (f"Horovod hid {la.horovod_hidden():.0%} of its all-reduce behind the backward pass, width 1 hid {hid:.0%}"
            + layer)


def auto_target(la: Launch) -> Target:
    """The auto mode, timed in the configuration it chose, against the fastest fixed configuration
    it could have chosen in the same launch: met when within 10% of it."""
    chosen = la.auto_choice()
    best = min(AUTO_CHOICES, key=la.median)
    ratio = la.median(AUTO) / la.median(best)
    met = ratio <= 1.1
    return Target(f"{la.hosts} hosts, {la.rate}: auto within 10% of the fastest configuration it could choose", met,
                  f"chose {LABELS[chosen]}; auto / fastest ({LABELS[best]}) = {ratio:.2f}",
                  "" if met else (f"its choice measured {la.median(chosen) * 1e3:.0f} ms as a fixed row, "
                                  f"{LABELS[best]} {la.median(best) * 1e3:.0f} ms; it decided on: "
                                  f"{la.auto['decision']['reason']}"))
