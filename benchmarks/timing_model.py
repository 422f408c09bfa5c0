"""The Pipe-SGD timing model (Li et al., NeurIPS 2018) as an analysis tool: predictions, least-squares fits
to measurements, a plot and a CLI. The terms the auto rule uses live in ``pipesgd_hvd.auto.model``.

N workers, M gradient bytes (float32), B link bandwidth (bytes/s), alpha latency per message (s),
gamma reduction cost (s/byte), c codec cost (s/byte), r wire/float32 ratio, T iterations, l_comp
compute per iteration (forward, backward and the optimizer update)::

    ring all-reduce   l_AR  = 2(N-1) alpha + 2(N-1)/N M/B   + (N-1)/N M gamma
    compressed        l_AR' = 2(N-1) alpha + 2(N-1)/N r M/B + (N-1)/N M (gamma + c)
    PS synchronous    T (l_comp + 2 alpha + 2 N M/B)
    all-reduce sync   T (l_comp + (1-h) l_AR)          h: share of l_AR hidden in the backward pass
    pipelined, K >= 2 T max(l_comp, l_AR') + (K-1) l_AR'   (the pipeline fill; K = 1 is sync)

The paper writes the compressed bandwidth term as M/(r B) with r a compression *factor*; here r is
the wire/float32 *ratio* (0.252 for int8), hence r M / B. Example (what speed-up to expect)::

    python -m benchmarks.timing_model --workers 4 --model-mb 100 --bandwidth-gbit 10 --compute-ms 150
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from dataclasses import dataclass, replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from pipesgd_hvd.auto.model import (CODECS, CodecParams, LinkParams, compressed_allreduce_time,
                                    sync_iteration_time)

def ring_allreduce_time(n: int, nbytes: float, link: LinkParams) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` workers: ``2(N-1) alpha + 2(N-1)/N M/B + (N-1)/N M
    gamma`` (reduce-scatter then all-gather; the compressed all-reduce at ratio 1, no codec cost)."""
    return compressed_allreduce_time(n, nbytes, link, CODECS["none"])


def ps_iteration_time(n: int, nbytes: float, link: LinkParams, compute: float) -> float:
    """Synchronous parameter server, one iteration: ``l_comp + 2 alpha + 2 N M/B`` (the server's
    link carries N gradients in and N models out, and is the bottleneck)."""
    if n < 1 or nbytes < 0:
        raise ValueError(f"need n >= 1 workers and nbytes >= 0, got n={n}, nbytes={nbytes}")
    return compute + 2 * link.alpha + 2 * n * nbytes / link.bandwidth


def pipelined_iteration_time(compute: float, comm: float, interference: float = 0.0) -> float:
    """Pipelined training (width K >= 2), one steady-state iteration: ``max(l_comp, l_comm)``.

    The paper assumes compute and communication do not slow each other. ``interference`` f >= 0
    drops that: compute runs ``1 + f`` times slower while the all-reduce runs beside it (we measured
    f = 0.12-0.35 with one core per rank). Both start together, so compute is done after
    ``l_comm/(1+f)`` of its work plus the rest at full speed:
    ``max(l_comm, l_comp + l_comm f/(1+f))``, which is ``max(l_comp, l_comm)`` at f = 0."""
    if interference < 0:
        raise ValueError(f"interference must be >= 0, got {interference}")
    return max(comm, compute + comm * interference / (1.0 + interference))


def total_time(iterations: int, compute: float, comm: float, *, width: int = 1,
               overlap: float = 0.0, interference: float = 0.0) -> float:
    """Wall time of ``iterations`` steps. Width 1: ``T (l_comp + (1-h) l_comm)``. Width K >= 2:
    ``T pipelined_iteration_time + (K-1) l_comm``, the last K-1 reductions draining the pipeline
    (``flush()``). ``comm`` is whichever all-reduce time applies (plain or compressed)."""
    if not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an int >= 1, got {width!r}")
    if width == 1:
        return iterations * sync_iteration_time(compute, comm, overlap)
    return iterations * pipelined_iteration_time(compute, comm, interference) + (width - 1) * comm


def speedup(compute: float, sync_comm: float, comm: Optional[float] = None, *, width: int = 2,
            iterations: Optional[int] = None, overlap: float = 0.0, interference: float = 0.0) -> float:
    """Speed-up of width-``width`` training with all-reduce time ``comm`` (default ``sync_comm``,
    i.e. uncompressed) over synchronous uncompressed training (all-reduce ``sync_comm``, overlap
    h). ``iterations=None`` compares steady-state iterations (T -> infinity, no fill)."""
    comm = sync_comm if comm is None else comm
    if iterations is None:
        base = sync_iteration_time(compute, sync_comm, overlap)
        if width == 1:
            return base / sync_iteration_time(compute, comm, overlap)
        return base / pipelined_iteration_time(compute, comm, interference)
    return (total_time(iterations, compute, sync_comm, overlap=overlap)
            / total_time(iterations, compute, comm, width=width, overlap=overlap, interference=interference))


@dataclass(frozen=True)
class Prediction:
    """Predicted seconds per iteration: ``sync`` (uncompressed, the baseline), ``ps`` (a parameter
    server), ``iteration[(codec, width)]`` (the fill spread over ``iterations`` if set) and its
    ``speedup`` over ``sync``; ``comm[codec]``: one all-reduce."""

    sync: float
    ps: float
    comm: Dict[str, float]
    iteration: Dict[Tuple[str, int], float]
    speedup: Dict[Tuple[str, int], float]

    def table(self) -> str:
        lines = [f"{'codec':<11} {'allreduce ms':>12} {'width':>5} {'iter ms':>9} {'speed-up':>8}"]
        for (name, width), t in self.iteration.items():
            lines.append(f"{name:<11} {self.comm[name] * 1e3:12.2f} {width:5d} {t * 1e3:9.2f} "
                         f"{self.speedup[(name, width)]:7.2f}x")
        lines.append(f"{'ps (sync)':<11} {'':>12} {1:5d} {self.ps * 1e3:9.2f} {self.sync / self.ps:7.2f}x")
        return "\n".join(lines)


def predict(n: int, nbytes: float, link: LinkParams, compute: float, *, widths: Sequence[int] = (1, 2),
            codecs: Iterable[CodecParams] = tuple(CODECS.values()), iterations: Optional[int] = None,
            overlap: float = 0.0, interference: float = 0.0) -> Prediction:
    """Per-iteration time and speed-up over uncompressed sync for every codec x width."""
    if iterations is not None and iterations < 1:
        raise ValueError(f"iterations must be >= 1 (or None for steady state), got {iterations}")
    sync_comm = ring_allreduce_time(n, nbytes, link)
    sync = sync_iteration_time(compute, sync_comm, overlap)
    comm: Dict[str, float] = {}
    iteration: Dict[Tuple[str, int], float] = {}
    gain: Dict[Tuple[str, int], float] = {}
    for codec, width in itertools.product(list(codecs), widths):
        c = comm.setdefault(codec.name, compressed_allreduce_time(n, nbytes, link, codec))
        if iterations is None:
            iteration[(codec.name, width)] = (sync_iteration_time(compute, c, overlap) if width == 1
                                              else pipelined_iteration_time(compute, c, interference))
        else:
            iteration[(codec.name, width)] = total_time(iterations, compute, c, width=width, overlap=overlap,
                                                        interference=interference) / iterations
        gain[(codec.name, width)] = sync / iteration[(codec.name, width)]  # = speedup(), fill spread alike
    return Prediction(sync=sync,
                      ps=ps_iteration_time(n, nbytes, link, compute), comm=comm, iteration=iteration, speedup=gain)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact non-negative least squares for a handful of columns: the optimum is the unconstrained
    fit on its own support, so try every support and keep the best feasible fit (2^k solves)."""
    k = a.shape[1]
    best, best_res = np.zeros(k), float(b @ b)
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            x_sub = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if np.all(x_sub >= 0):
                x = np.zeros(k)
                x[list(cols)] = x_sub
                res = float(np.sum((a @ x - b) ** 2))
                if res < best_res:
                    best, best_res = x, res
    return best


def _fit(rows: List[List[float]], seconds: List[float], what: str, hint: str) -> np.ndarray:
    a, b = np.asarray(rows, dtype=float), np.asarray(seconds, dtype=float)
    if np.any(b <= 0):
        raise ValueError(f"{what}: measured seconds must be > 0")
    # Relative residuals: small messages (which carry alpha) count as much as large ones.
    a, b = a / b[:, None], np.ones_like(b)
    scale = np.linalg.norm(a, axis=0)
    if np.linalg.matrix_rank(a / np.where(scale > 0, scale, 1.0)) < a.shape[1]:
        raise ValueError(f"{what}: the samples cannot separate the parameters; {hint}")
    return _nnls(a / scale, b) / scale


def fit_link(samples: Iterable[Sequence], *, gamma: Optional[float] = None) -> LinkParams:
    """Least-squares ``LinkParams`` from measured ``(n, nbytes, seconds[, kind])`` samples.

    ``kind`` is ``"allreduce"`` (default, the ring formula), ``"allgather"`` (also alltoall:
    ``(N-1) alpha + (N-1)/N M/B``) or ``"reduce"`` (a local fp32 add of M bytes: ``M gamma``). All
    three are linear in (alpha, 1/B, gamma); the fit is non-negative, on relative error. All-reduce
    samples alone cannot split bandwidth from gamma (both scale with (N-1)/N M): add allgather or
    reduce samples, or fix ``gamma``. Example: ``fit_link([(4, 1e6, 2.1e-3), (4, 1e8, 0.13), ...])``.
    """
    rows: List[List[float]] = []
    seconds: List[float] = []
    for sample in samples:
        n, m, t = int(sample[0]), float(sample[1]), float(sample[2])
        kind = sample[3] if len(sample) > 3 else "allreduce"
        share = (n - 1) / n
        if kind == "allreduce":
            row = [2 * (n - 1), 2 * share * m, share * m]
        elif kind == "allgather":
            row = [n - 1, share * m, 0.0]
        elif kind == "reduce":
            row = [0.0, 0.0, m]
        else:
            raise ValueError(f"unknown sample kind {kind!r}; use 'allreduce', 'allgather' or 'reduce'")
        if gamma is not None:
            t -= row[2] * gamma
            row = row[:2]
        rows.append(row)
        seconds.append(t)
    if not rows:
        raise ValueError("fit_link needs samples")
    x = _fit(rows, seconds, "fit_link", "vary the byte counts, and add 'allgather' or 'reduce' samples "
             "(or pass gamma=) to tell bandwidth from gamma")
    inv_b = x[1]
    return LinkParams(alpha=float(x[0]), bandwidth=math.inf if inv_b <= 0 else float(1.0 / inv_b),
                      gamma=float(x[2]) if gamma is None else gamma)


def plot_speedup(path: str, n: int, nbytes: float, link: LinkParams, compute: float, *,
                 widths: Sequence[int] = (1, 2), codecs: Iterable[CodecParams] = tuple(CODECS.values()),
                 iterations: Optional[int] = None, overlap: float = 0.0, interference: float = 0.0) -> None:
    """Speed-up over uncompressed sync vs bandwidth (log x, 1/100x to 100x ``link.bandwidth``), one
    line per codec and width, saved as a PNG to ``path``."""
    from matplotlib.figure import Figure  # lazy, and no pyplot: no global backend state

    codecs = list(codecs)
    gbit = np.logspace(-2, 2, 81) * link.bandwidth * 8 / 1e9
    preds = [predict(n, nbytes, replace(link, bandwidth=g * 1e9 / 8), compute, widths=widths, codecs=codecs,
                     iterations=iterations, overlap=overlap, interference=interference) for g in gbit]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    styles = ("--", "-", ":", "-.")
    for (i, codec), (j, width) in itertools.product(enumerate(codecs), enumerate(widths)):
        ax.plot(gbit, [p.speedup[(codec.name, width)] for p in preds], label=f"{codec.name}, K={width}",
                color=f"C{i % 10}", linestyle=styles[j % len(styles)])
    ax.axvline(link.bandwidth * 8 / 1e9, color="grey", linewidth=0.8)
    ax.set(xscale="log", xlabel="link bandwidth (Gbit/s)", ylabel="speed-up over sync",
           title=f"N={n}, {nbytes / 1e6:g} MB gradients, compute {compute * 1e3:g} ms")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.timing_model", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--model-mb", type=float, required=True, help="gradient size, MB of float32")
    parser.add_argument("--bandwidth-gbit", type=float, required=True)
    parser.add_argument("--compute-ms", type=float, required=True, help="forward + backward + update")
    parser.add_argument("--width", type=int, nargs="+", default=[2], help="pipeline widths (1 is always shown)")
    parser.add_argument("--alpha-us", type=float, default=50.0, help="latency per message")
    parser.add_argument("--gamma-ns", type=float, default=0.1, help="reduction cost per byte")
    parser.add_argument("--codec-ns", type=float, default=0.0, help="codec cost per byte (not for 'none')")
    parser.add_argument("--overlap", type=float, default=0.0, help="share of sync all-reduce hidden, 0..1")
    parser.add_argument("--interference", type=float, default=0.0, help="compute slowdown beside comm")
    parser.add_argument("--iterations", type=int, default=None, help="spread the pipeline fill over T")
    parser.add_argument("--plot", metavar="PNG", help="draw speed-up vs bandwidth to this file")
    args = parser.parse_args(argv)

    codecs = [c if c.name == "none" else replace(c, cost_per_byte=args.codec_ns * 1e-9) for c in CODECS.values()]
    widths = sorted({1, *args.width})
    nbytes, compute = args.model_mb * 1e6, args.compute_ms * 1e-3
    common = dict(widths=widths, codecs=codecs, iterations=args.iterations, overlap=args.overlap,
                  interference=args.interference)
    try:
        link = LinkParams(args.alpha_us * 1e-6, args.bandwidth_gbit * 1e9 / 8, args.gamma_ns * 1e-9)
        pred = predict(args.workers, nbytes, link, compute, **common)
    except ValueError as err:
        parser.error(str(err))
    print(f"N={args.workers}, M={args.model_mb:g} MB, B={args.bandwidth_gbit:g} Gbit/s, alpha={args.alpha_us:g} us, "
          f"gamma={args.gamma_ns:g} ns/B, compute={args.compute_ms:g} ms; sync iteration {pred.sync * 1e3:.2f} ms")
    print(pred.table())
    if args.plot:
        plot_speedup(args.plot, args.workers, nbytes, link, compute, **common)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
