"""What `make bench` launches: each launch's link rate from a calibration, and the configurations.

The link rate sets a launch's comm/compute (Horovod's float32 all-reduce alone over compute alone),
so the driver measures both on the cluster at two rates, fits ``comm(R) = fixed + wire /
(efficiency R)`` (``wire = 2 (N-1)/N x gradient bytes x 8``) and solves ``comm(R) = aim x compute``
for R (why two rates: docs/benchmarks.md, *Calibration*).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Tuple

from .step_time import select
from .throughput_analysis import AUTO_CHOICES
from .throughput_worker import AUTO, TRAINING

#: comm/compute of the 2-host launches (issue 15): 0.25x, 1x, 2.5x and 5x.
AIMS = (0.25, 1.0, 2.5, 5.0)
#: How far a launch's measured comm/compute may be from its aim (relative).
TOLERANCE = 0.2
#: The calibration's first link rate: fast, so that its all-reduce is mostly the fixed cost.
FIRST_RATE = "2500mbit"
#: The fastest rate a plan gives: an aim that needs more is out of reach (``fixed`` alone too long).
MAX_RATE = 20e9

_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


def rate_bps(rate: str) -> float:
    """Bits per second of a tc rate ("620mbit", "2.5gbit"). tc's "bps" means bytes/s: refused."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", rate.lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"not a tc rate in bit/s: {rate!r}; write e.g. 620mbit or 2.5gbit")
    return float(m.group(1)) * _UNITS[m.group(2)]


def tc_rate(bps: float) -> str:
    """``bps`` as a tc rate in mbit, 3 significant digits (at most 0.5% off): "623mbit", "3460mbit"."""
    if not bps > 0:
        raise ValueError(f"a rate must be > 0 bit/s, got {bps}")
    digits = 2 - math.floor(math.log10(bps / 1e6))
    return f"{round(bps / 1e6, digits):g}mbit"


def wire_bits(n: int, grad_bytes: float) -> float:
    """Bits one rank sends in a ring all-reduce of ``grad_bytes`` over ``n`` ranks: 2 (N-1)/N M x 8."""
    return 2 * (n - 1) / n * grad_bytes * 8


@dataclass(frozen=True)
class CommFit:
    """``comm(R) = fixed + wire / (efficiency R)`` seconds for the float32 all-reduce at rate R bit/s."""

    fixed: float
    wire: float
    efficiency: float

    def comm(self, bps: float) -> float:
        return self.fixed + self.wire / (self.efficiency * bps)


def fit_comm(n: int, grad_bytes: float, points: Iterable[Tuple[float, float]]) -> CommFit:
    """Least squares of ``seconds = fixed + slope / R`` over (R bit/s, seconds) points at two or
    more rates; ``fixed`` is kept >= 0 (the line through the origin when it would go negative)."""
    pts = [(1.0 / r, t) for r, t in points]
    if len({x for x, _ in pts}) < 2:
        raise ValueError("fit_comm needs all-reduces timed at two different rates at least")
    k = len(pts)
    mx, mt = sum(x for x, _ in pts) / k, sum(t for _, t in pts) / k
    slope = sum((x - mx) * (t - mt) for x, t in pts) / sum((x - mx) ** 2 for x, _ in pts)
    fixed = mt - slope * mx
    if fixed < 0:
        fixed, slope = 0.0, sum(x * t for x, t in pts) / sum(x * x for x, _ in pts)
    if not slope > 0:
        raise ValueError(f"the all-reduce did not slow down at the lower rate ({points}): is the link shaped?")
    bits = wire_bits(n, grad_bytes)
    return CommFit(fixed, bits, bits / slope)


def second_rate(n: int, grad_bytes: float, first_bps: float, first_comm: float, compute: float, aim: float) -> str:
    """The calibration's second rate: where ``aim`` (the largest) would land at full link use
    (efficiency 1, the fixed cost being what the first all-reduce took beyond its wire time), so
    that every aim up to it is interpolated, not extrapolated; at most a quarter of the first rate
    (two rates far apart in 1/R separate fixed from wire)."""
    wire = wire_bits(n, grad_bytes)
    guess = CommFit(max(0.0, first_comm - wire / first_bps), wire, 1.0)
    return tc_rate(min(rate_bps(plan_rate(guess, aim, compute)[0]), first_bps / 4))


def plan_rate(fit: CommFit, aim: float, compute: float) -> Tuple[str, float]:
    """The tc rate that puts comm/compute at ``aim``, and the comm/compute the fit predicts at that
    (rounded) rate: far from ``aim`` only when the aim is out of reach (``fixed`` >= aim x compute:
    the rate is then ``MAX_RATE``)."""
    if not (aim > 0 and compute > 0):
        raise ValueError(f"need aim > 0 and compute > 0, got aim={aim}, compute={compute}")
    room = aim * compute - fit.fixed
    bps = MAX_RATE if room <= 0 else min(MAX_RATE, fit.wire / (fit.efficiency * room))
    rate = tc_rate(bps)
    return rate, fit.comm(rate_bps(rate)) / compute


def off_aim(measured: float, aim: float) -> Optional[str]:
    """None when ``measured`` comm/compute is within ``TOLERANCE`` of ``aim``, else by how much it
    missed: "misses its aim 5 by 24% (below)"."""
    miss = measured / aim - 1
    if abs(miss) <= TOLERANCE:
        return None
    return f"misses its aim {aim:g} by {abs(miss):.0%} ({'above' if miss > 0 else 'below'})"


def select_configs(names: Optional[Sequence[str]]) -> Tuple[str, ...]:
    """The configurations to run, in the worker's order: all of them for None; else ``names`` (``TRAINING``
    keys or ``auto``) and Horovod's and, with ``auto``, those it chooses from (it is judged against them)."""
    valid = (*TRAINING, AUTO)
    if names is None:
        return valid
    names = [n for part in names for n in part.split(",") if n]
    return tuple(select(names, valid, AUTO_CHOICES if AUTO in names else ()))
