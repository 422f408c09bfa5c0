"""The Pipe-SGD timing model's terms the auto rule uses (shared/PAPER.md): the link, the codecs,
a compressed all-reduce and a synchronous step.

Alpha-beta form. N workers, M gradient bytes (float32), B link bandwidth (bytes/s), alpha latency
per message (s), gamma reduction cost (s/byte), c codec cost (s/byte, encode + decode per phase),
r compression ratio (wire bytes / float32 bytes), l_comp compute time per iteration::

    compressed all-reduce  l_AR' = 2(N-1) alpha + 2(N-1)/N r M/B + (N-1)/N M (gamma + c)
    all-reduce sync        l_comp + (1-h) l_AR      h: share of l_AR hidden in the backward pass

The rest of the paper's model (the ring, parameter server, pipelined and total times, the
least-squares fits to measurements, a plot and a CLI) is analysis tooling: ``benchmarks/timing_model.py``.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class LinkParams:
    """The network and reduction: ``alpha`` s per message, ``bandwidth`` bytes/s, ``gamma`` s per
    byte reduced (one fp32 add of that byte)."""

    alpha: float
    bandwidth: float
    gamma: float = 0.0

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.gamma < 0 or not self.bandwidth > 0:
            raise ValueError(f"need alpha >= 0, gamma >= 0 and bandwidth > 0, got {self}")


@dataclass(frozen=True)
class CodecParams:
    """A codec as the model sees it: ``ratio`` = wire bytes / float32 bytes, ``cost_per_byte`` =
    s per float32 byte for one encode + one decode (``benchmarks/timing_model.py`` fits it)."""

    name: str
    ratio: float
    cost_per_byte: float = 0.0


def _block_ratio(bits: int, block: int = 512) -> float:
    """Wire/float32 ratio of ``bits``-bit codes plus one float32 scale per ``block`` values."""
    return (bits * block / 8 + 4) / (4 * block)


#: The project's codecs (pipesgd_hvd.compression.Compression) with zero codec cost; use
#: ``dataclasses.replace(CODECS["int8"], cost_per_byte=...)`` for a measured cost.
CODECS: Mapping[str, CodecParams] = types.MappingProxyType({
    "none": CodecParams("none", 1.0),
    "fp16": CodecParams("fp16", 0.5),
    "bf16": CodecParams("bf16", 0.5),
    "truncate16": CodecParams("truncate16", 0.5),
    "int8": CodecParams("int8", _block_ratio(8)),   # 516 / 2048 = 0.2520
    "int4": CodecParams("int4", _block_ratio(4)),   # 260 / 2048 = 0.1270
})


def _check(n: int, nbytes: float) -> None:
    if n < 1 or nbytes < 0:
        raise ValueError(f"need n >= 1 workers and nbytes >= 0, got n={n}, nbytes={nbytes}")


def compressed_allreduce_time(n: int, nbytes: float, link: LinkParams, codec: CodecParams) -> float:
    """Our compressed all-reduce (alltoall of encoded chunks, fp32 sum, allgather):
    ``2(N-1) alpha + 2(N-1)/N r M/B + (N-1)/N M (gamma + c)``. Same messages and byte count as a
    ring on ``r M`` bytes; the codec's cost rides with the reduction. ``none`` gives the ring all-reduce."""
    _check(n, nbytes)
    share = (n - 1) / n
    return (2 * (n - 1) * link.alpha + 2 * share * codec.ratio * nbytes / link.bandwidth
            + share * nbytes * (link.gamma + codec.cost_per_byte))


def sync_iteration_time(compute: float, comm: float, overlap: float = 0.0) -> float:
    """Synchronous all-reduce training, one iteration: ``l_comp + (1-h) l_AR``. ``overlap`` h in
    [0, 1] is the share of the all-reduce hidden behind the backward pass (Horovod starts each
    tensor's reduction when its gradient is ready); h = 0 is the paper's ``l_comp + l_AR``."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    return compute + (1.0 - overlap) * comm
