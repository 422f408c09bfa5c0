"""``width="auto"`` / ``compression="auto"``: pick the configuration from measurements.

The rule, from the timing model (``pipesgd_hvd.auto.model``), on numbers measured on the real cluster:

* the compute time of a step (forward + backward + update, the slowest rank's median);
* for each candidate codec, the reduction the pipeline would run with it (for ``none`` a float32
  all-reduce of the whole gradient; for a byte codec our compressed all-reduce: encode,
  alltoall, sum, allgather, decode), timed synchronously, and the CPU time it cost the rank.
  Timing the real collective matters: on Horovod's Gloo controller the alltoall and allgather
  that carry the byte codecs move about half the bits per second of its float32 all-reduce
  (docs/transports.md), so a model that predicts compressed times from the float32 link
  under-estimates them. Candidates that were not timed are predicted by the model instead
  (the link fitted to the float32 all-reduce, the codec's encode + decode cost, if measured);
* a pipelined step is predicted at ``max(compute + reduction CPU, reduction)``: the reduction
  hides behind compute, but the CPU it needs (the codec, the transport) is taken from compute,
  which owns the rank's cores. With ``staleness_correction="split_batch"`` a step is an update of
  two calls, and its reduction is counted as hidden behind the look-ahead part's compute only (a
  share 1 - f; the buckets that leave during the fresh part's backward pass hide a little more):
  ``max((1 - f) compute + reduction CPU, reduction) + f compute``;
* where each host holds several ranks and there are several hosts, a byte codec is a candidate
  twice: reduced hierarchically (``"int8/hier"``: float32 inside the host, compressed between
  hosts, ``compression/hierarchical.py``) and flat (``"int8"``); the hierarchical one counts as
  the less lossy (each host's sum is quantized, not each rank's gradient), and it is untimed
  predictions take the links inside a host as free beside the one between hosts;
* if the float32 all-reduce is under ``sync_fraction`` of compute, synchronous training costs at
  most that fraction: width 1, no compression (no staleness, no loss);
* otherwise width 2 with the least lossy codec (``none`` < ``fp16`` < ``int8`` < ``int4``) whose
  predicted step is within ``tolerance`` of the fastest candidate's: communication hides under
  compute if any codec can hide it, and a lossier codec is taken only when it is clearly faster;
* where pipelining is not allowed (Adam's kin without the accurate mode: a whole gradient one
  step stale costs them far more than any codec, docs/accuracy.md), width 1 with the least lossy
  codec whose synchronous step is within ``tolerance`` of the fastest one's.

Since no pipelined step is faster than compute, a candidate within ``tolerance`` of compute
alone cannot be beaten by more than that by a lossier one: the measuring loop stops there
(:func:`settled`) and times no lossier codec.

Every rank must decide from the same numbers: the adapter gathers all ranks' measurements first
(their maxima are what the slowest rank sees), so :func:`decide` is a pure function of identical
inputs and the choice is identical everywhere.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple

from .model import (CODECS, LinkParams, compressed_allreduce_time, flat_on_nodes_time, hierarchical_allreduce_time,
                    sync_iteration_time)

#: Candidates, least lossy first. fp16 keeps 11 significant bits (bf16 and truncate16 keep 8);
#: the quantizers carry error feedback.
CANDIDATES: Tuple[str, ...] = ("none", "fp16", "int8", "int4")
#: A lossier codec must beat the least lossy good one by more than this share of a step.
TOLERANCE = 0.10
#: The suffix of a candidate reduced hierarchically: "int8/hier".
HIER = "/hier"


def hierarchical_label(name: str) -> str:
    return name + HIER


def split_label(label: str) -> Tuple[str, bool]:
    """A candidate's label -> (codec name, reduced hierarchically)."""
    return (label[:-len(HIER)], True) if label.endswith(HIER) else (label, False)


def with_hierarchical(candidates: Sequence[str]) -> Tuple[str, ...]:
    """``candidates`` with each byte codec also reduced hierarchically, that variant first (the
    less lossy: fewer values are quantized)."""
    return tuple(label for c in candidates for label in ((c,) if c == "none" else (hierarchical_label(c), c)))


@dataclass(frozen=True)
class Measurements:
    ranks: int
    gradient_bytes: int                 # float32 bytes reduced per step
    compute_s: float                    # one step without communication (slowest rank)
    allreduce_s: float                  # synchronous float32 all-reduce of the whole gradient
    codec_s: Mapping[str, float] = field(default_factory=dict)          # one encode + decode of the gradient
    reduction_s: Mapping[str, float] = field(default_factory=dict)      # timed reductions, per codec
    reduction_cpu_s: Mapping[str, float] = field(default_factory=dict)  # the CPU each cost the rank
    local_size: int = 1                 # ranks per host (the same on every host)
    fresh_fraction: float = 0.0         # the share of a step's compute its reduction cannot hide behind


@dataclass(frozen=True)
class Decision:
    width: int
    compression: str
    reason: str
    predicted_s: Mapping[str, float]    # predicted iteration time per candidate (width 2; "sync" = width 1)
    hierarchical: bool = False          # a byte codec reduced hierarchically (compression/hierarchical.py)

    def describe(self) -> str:
        times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.predicted_s.items())
        how = " hierarchical" if self.hierarchical else ""
        return f"width={self.width} compression={self.compression}{how}: {self.reason} (predicted per step: {times})"


def link_from_allreduce(ranks: int, nbytes: int, seconds: float) -> LinkParams:
    """Bandwidth that makes the ring formula give ``seconds`` for ``nbytes`` (latency taken as 0:
    one size cannot split latency from bandwidth; a slight overestimate of what compression saves
    on latency-bound links, none on bandwidth-bound ones)."""
    share = 2 * (ranks - 1) / ranks
    return LinkParams(alpha=0.0, bandwidth=max(share * nbytes / max(seconds, 1e-9), 1.0))


def reduction_time(m: Measurements, label: str) -> float:
    """The reduction of candidate ``label``: as timed, else predicted from the float32 all-reduce.
    On hosts of several ranks, the float32 ring's rate is taken as the link between hosts (a ring
    ordered host by host puts one of its hops on each host's link) and the links inside a host
    as free beside it."""
    if label in m.reduction_s:
        return m.reduction_s[label]
    name, hierarchical = split_label(label)
    if name == "none" and not hierarchical:
        return m.allreduce_s
    link = link_from_allreduce(m.ranks, m.gradient_bytes, m.allreduce_s)
    params = dataclasses.replace(CODECS.get(name, CODECS["none"]),
                                 cost_per_byte=m.codec_s.get(name, 0.0) / max(m.gradient_bytes, 1))
    if m.local_size > 1 or hierarchical:
        node = LinkParams(alpha=0.0, bandwidth=math.inf)
        hosts = max(m.ranks // m.local_size, 1)
        timing = hierarchical_allreduce_time if hierarchical else flat_on_nodes_time
        return timing(m.local_size, hosts, m.gradient_bytes, node, link, params)
    return compressed_allreduce_time(m.ranks, m.gradient_bytes, link, params)


def pipelined_step(m: Measurements, name: str) -> float:
    """Predicted width-2 step with codec ``name``: ``max(compute + its CPU, the reduction)``, or
    with a fresh part f of the compute the reduction cannot hide behind,
    ``max((1 - f) compute + its CPU, the reduction) + f compute``."""
    fresh = m.fresh_fraction * m.compute_s
    return max(m.compute_s - fresh + m.reduction_cpu_s.get(name, 0.0), reduction_time(m, name)) + fresh


def sync_step(m: Measurements, name: str) -> float:
    """Predicted width-1 step with codec ``name``: compute, then the reduction."""
    return sync_iteration_time(m.compute_s, reduction_time(m, name))


def settled(m: Measurements, name: str, *, tolerance: float = TOLERANCE, sync_fraction: float = 0.05,
            pipelining: bool = True) -> bool:
    """After timing ``name`` (candidates are timed least lossy first): does the choice no longer
    depend on the lossier ones? True when the float32 all-reduce keeps training synchronous, or
    when ``name``'s step is within ``tolerance`` of compute alone, the least any step can take."""
    if name == "none" and reduction_time(m, "none") <= sync_fraction * m.compute_s:
        return True
    step = pipelined_step(m, name) if pipelining else sync_step(m, name)
    return step <= (1 + tolerance) * m.compute_s


def decide(m: Measurements, *, sync_fraction: float = 0.05, tolerance: float = TOLERANCE,
           candidates: Sequence[str] = CANDIDATES) -> Decision:
    if m.ranks < 2:
        return Decision(1, "none", "a single rank has nothing to communicate", {})
    # Timed candidates only, when there are any: the measuring loop stopped where the rest
    # cannot matter (see settled); otherwise the model predicts every candidate.
    names = [c for c in candidates if c in m.reduction_s] or list(candidates)
    comm = {name: reduction_time(m, name) for name in names}
    none = reduction_time(m, "none")
    predicted: Dict[str, float] = {"sync": sync_iteration_time(m.compute_s, none)}
    predicted.update({name: pipelined_step(m, name) for name in names})
    if none <= sync_fraction * m.compute_s:
        return Decision(1, "none", f"communication ({none * 1e3:.1f} ms) is under {sync_fraction:.0%} of "
                        f"compute ({m.compute_s * 1e3:.1f} ms): synchronous costs little", predicted)
    fastest = min(names, key=lambda n: predicted[n])
    chosen = next(n for n in names if predicted[n] <= (1 + tolerance) * predicted[fastest])
    if comm[chosen] <= m.compute_s:
        why = f"the least lossy codec whose reduction ({comm[chosen] * 1e3:.1f} ms) hides under compute"
    else:
        why = f"no codec hides its reduction under compute; the least lossy within {tolerance:.0%} of the fastest"
    cpu = m.reduction_cpu_s.get(chosen)
    name, hierarchical = split_label(chosen)
    return Decision(2, name, f"{why} ({m.compute_s * 1e3:.1f} ms"
                    + (f", + {cpu * 1e3:.1f} ms of reduction CPU" if cpu else "") + ")", predicted, hierarchical)


def decide_synchronous(m: Measurements, *, tolerance: float = TOLERANCE,
                       candidates: Sequence[str] = CANDIDATES) -> Decision:
    """Width 1 (pipelining not allowed): the least lossy codec whose synchronous step is within
    ``tolerance`` of the fastest's."""
    names = [c for c in candidates if c in m.reduction_s] or list(candidates)
    predicted = {name: sync_step(m, name) for name in names}
    fastest = min(names, key=lambda n: predicted[n])
    chosen = next(n for n in names if predicted[n] <= (1 + tolerance) * predicted[fastest])
    name, hierarchical = split_label(chosen)
    return Decision(1, name, "pipelining not allowed (Adam's kin without staleness_correction='split_batch'): "
                    f"the least lossy codec within {tolerance:.0%} of the fastest synchronous step",
                    {f"sync {n}": t for n, t in predicted.items()}, hierarchical)


def decide_fixed(m: Measurements, *, width: Optional[int] = None, compression: Optional[str] = None,
                 sync_fraction: float = 0.05, tolerance: float = TOLERANCE,
                 candidates: Sequence[str] = CANDIDATES, pipelining: bool = True) -> Decision:
    """:func:`decide` when the user fixed one of the two (``None`` = chosen here).

    * width fixed: the codec :func:`decide` picks (``none`` when it would stay synchronous);
    * codec fixed (by name; one the model does not know counts as uncompressed, a conservative
      guess): width 1 when that codec's reduction is under ``sync_fraction`` of compute, else 2.
    * ``pipelining=False``: the width chosen here is 1 (:func:`decide_synchronous`).
    """
    if not pipelining and width is None:
        if m.ranks < 2:
            return Decision(1, compression or "none", "a single rank has nothing to communicate", {})
        if compression is None:
            return decide_synchronous(m, tolerance=tolerance, candidates=candidates)
        label = _fixed_codec_variant(m, compression, tolerance)
        return Decision(1, compression, "compression fixed; pipelining not allowed (Adam's kin without "
                        "staleness_correction='split_batch')", {"sync": sync_step(m, label)}, split_label(label)[1])
    if width is None and compression is None:
        return decide(m, sync_fraction=sync_fraction, tolerance=tolerance, candidates=candidates)
    if compression is None:
        assert width is not None
        d = decide(m, sync_fraction=sync_fraction, tolerance=tolerance, candidates=candidates)
        return Decision(width, d.compression, f"width fixed at {width}; codec: {d.reason}", d.predicted_s,
                        d.hierarchical)
    label = _fixed_codec_variant(m, compression, tolerance)
    hierarchical = split_label(label)[1]
    if width is not None:
        return Decision(width, compression, "width and compression both fixed", {}, hierarchical)
    if m.ranks < 2:
        return Decision(1, compression, "a single rank has nothing to communicate", {})
    comm = reduction_time(m, label)
    predicted = {"sync": sync_iteration_time(m.compute_s, comm), label: pipelined_step(m, label)}
    what = f"compression fixed; its reduction ({comm * 1e3:.1f} ms) is"
    if comm <= sync_fraction * m.compute_s:
        return Decision(1, compression, f"{what} under {sync_fraction:.0%} of compute ({m.compute_s * 1e3:.1f} ms): "
                        "synchronous costs little", predicted, hierarchical)
    return Decision(2, compression, f"{what} over {sync_fraction:.0%} of compute ({m.compute_s * 1e3:.1f} ms): "
                    "pipelining hides it", predicted, hierarchical)


def _fixed_codec_variant(m: Measurements, compression: str, tolerance: float) -> str:
    """A fixed codec timed both ways: hierarchically unless flat is faster by more than
    ``tolerance`` of a step; else the one form it was timed in (or flat)."""
    timed = [label for label in (hierarchical_label(compression), compression) if label in m.reduction_s]
    if len(timed) < 2:
        return timed[0] if timed else compression
    steps = {label: pipelined_step(m, label) for label in timed}
    return timed[0] if steps[timed[0]] <= (1 + tolerance) * steps[timed[1]] else timed[1]
