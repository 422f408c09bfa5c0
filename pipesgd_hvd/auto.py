"""``width="auto"`` / ``compression="auto"``: pick the configuration from measurements.

The rule, from the timing model (``pipesgd_hvd.timing``):

* measure, on the real cluster, the compute time of a step (forward + backward + update, the
  slowest rank's median) and the time of a synchronous float32 all-reduce of the whole gradient;
  time one encode + decode of each candidate codec on this rank's own gradient;
* fit the link from the all-reduce (ring formula; one size cannot split latency from bandwidth, so
  the latency is taken as 0 and the bandwidth carries all of it: a slight overestimate of what
  compression saves on latency-bound links, none on bandwidth-bound ones);
* if communication is under ``sync_fraction`` of compute, synchronous training costs at most that
  fraction: width 1, no compression (no staleness, no loss);
* otherwise width 2 with the least lossy codec whose predicted all-reduce fits under compute
  (``none`` < ``fp16`` < ``int8`` < ``int4``); if none fits, the one with the shortest predicted
  iteration.

Every rank must decide from the same numbers: the adapter gathers all ranks' measurements first
(their maxima are what the slowest rank sees), so :func:`decide` is a pure function of identical
inputs and the choice is identical everywhere.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple

from .timing import CODECS, LinkParams, compressed_allreduce_time, pipelined_iteration_time, \
    sync_iteration_time

#: Candidates, least lossy first. fp16 keeps 11 significant bits (bf16 and truncate16 keep 8);
#: the quantizers carry error feedback.
CANDIDATES: Tuple[str, ...] = ("none", "fp16", "int8", "int4")


@dataclass(frozen=True)
class Measurements:
    ranks: int
    gradient_bytes: int                 # float32 bytes reduced per step
    compute_s: float                    # one step without communication (slowest rank)
    allreduce_s: float                  # synchronous float32 all-reduce of the whole gradient
    codec_s: Mapping[str, float]        # one encode + decode of the whole gradient, per codec name


@dataclass(frozen=True)
class Decision:
    width: int
    compression: str
    reason: str
    predicted_s: Mapping[str, float]    # predicted iteration time per candidate (width 2; "sync" = width 1)

    def describe(self) -> str:
        times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.predicted_s.items())
        return f"width={self.width} compression={self.compression}: {self.reason} (predicted per step: {times})"


def link_from_allreduce(ranks: int, nbytes: int, seconds: float) -> LinkParams:
    """Bandwidth that makes the ring formula give ``seconds`` for ``nbytes`` (latency taken as 0)."""
    share = 2 * (ranks - 1) / ranks
    return LinkParams(alpha=0.0, bandwidth=max(share * nbytes / max(seconds, 1e-9), 1.0))


def decide(m: Measurements, *, sync_fraction: float = 0.05,
           candidates: Sequence[str] = CANDIDATES) -> Decision:
    if m.ranks < 2:
        return Decision(1, "none", "a single rank has nothing to communicate", {})
    link = link_from_allreduce(m.ranks, m.gradient_bytes, m.allreduce_s)
    comm: Dict[str, float] = {}
    for name in candidates:
        params = dataclasses.replace(CODECS[name], cost_per_byte=m.codec_s.get(name, 0.0) / max(m.gradient_bytes, 1))
        comm[name] = compressed_allreduce_time(m.ranks, m.gradient_bytes, link, params)
    predicted = {"sync": sync_iteration_time(m.compute_s, comm["none"])}
    predicted.update({name: pipelined_iteration_time(m.compute_s, t) for name, t in comm.items()})
    if comm["none"] <= sync_fraction * m.compute_s:
        return Decision(1, "none", f"communication ({comm['none'] * 1e3:.1f} ms) is under {sync_fraction:.0%} of "
                        f"compute ({m.compute_s * 1e3:.1f} ms): synchronous costs little", predicted)
    for name in candidates:
        if comm[name] <= m.compute_s:
            return Decision(2, name, f"the least lossy codec whose all-reduce ({comm[name] * 1e3:.1f} ms) hides "
                            f"under compute ({m.compute_s * 1e3:.1f} ms)", predicted)
    best = min(candidates, key=lambda n: predicted[n])
    return Decision(2, best, f"no codec hides communication under compute ({m.compute_s * 1e3:.1f} ms): "
                    f"the shortest predicted step", predicted)


def decide_fixed(m: Measurements, *, width: Optional[int] = None, compression: Optional[str] = None,
                 sync_fraction: float = 0.05, candidates: Sequence[str] = CANDIDATES) -> Decision:
    """:func:`decide` when the user fixed one of the two (``None`` = chosen here).

    * width fixed: the codec :func:`decide` picks (``none`` when it would stay synchronous);
    * codec fixed (by name; one the model does not know counts as uncompressed, a conservative
      guess): width 1 when that codec's all-reduce is under ``sync_fraction`` of compute, else 2.
    """
    if width is None and compression is None:
        return decide(m, sync_fraction=sync_fraction, candidates=candidates)
    if compression is None:
        assert width is not None
        d = decide(m, sync_fraction=sync_fraction, candidates=candidates)
        return Decision(width, d.compression, f"width fixed at {width}; codec: {d.reason}", d.predicted_s)
    if width is not None:
        return Decision(width, compression, "width and compression both fixed", {})
    if m.ranks < 2:
        return Decision(1, compression, "a single rank has nothing to communicate", {})
    link = link_from_allreduce(m.ranks, m.gradient_bytes, m.allreduce_s)
    params = dataclasses.replace(CODECS.get(compression, CODECS["none"]),
                                 cost_per_byte=m.codec_s.get(compression, 0.0) / max(m.gradient_bytes, 1))
    comm = compressed_allreduce_time(m.ranks, m.gradient_bytes, link, params)
    predicted = {"sync": sync_iteration_time(m.compute_s, comm),
                 compression: pipelined_iteration_time(m.compute_s, comm)}
    what = f"compression fixed; its all-reduce ({comm * 1e3:.1f} ms) is"
    if comm <= sync_fraction * m.compute_s:
        return Decision(1, compression, f"{what} under {sync_fraction:.0%} of compute ({m.compute_s * 1e3:.1f} ms): "
                        "synchronous costs little", predicted)
    return Decision(2, compression, f"{what} over {sync_fraction:.0%} of compute ({m.compute_s * 1e3:.1f} ms): "
                    "pipelining hides it", predicted)
