"""The Pipe-SGD timing model's terms the auto rule uses (Li et al., NeurIPS 2018, the README's
reference): the link, the codecs, a compressed all-reduce and a synchronous step.

Alpha-beta form. N workers, M gradient bytes (float32), B link bandwidth (bytes/s), alpha latency
per message (s), gamma reduction cost (s/byte), c codec cost (s/byte, encode + decode per phase),
r compression ratio (wire bytes / float32 bytes), l_comp compute time per iteration::

    compressed all-reduce  l_AR' = 2(N-1) alpha + 2(N-1)/N r M/B + (N-1)/N M (gamma + c)
    on C nodes of L ranks  flat_on_nodes_time, hierarchical_allreduce_time (the links inside a node
                           apart from the node's link to the others)
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
    s per float32 byte for one encode + one decode (measured: ``benchmarks/throughput_analysis.py``)."""

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


def flat_on_nodes_time(local_size: int, cross_size: int, nbytes: float, local: LinkParams, cross: LinkParams,
                       codec: CodecParams) -> float:
    """The flat compressed all-reduce over all N = L C ranks of C nodes of L ranks, each node on one
    link to the others (``cross.bandwidth``: a node's) and ``local`` links inside it::

        2(N-1) alpha_c + 2 max(L (N-L)/N r M / B_c, (L-1)/N r M / B_l) + (N-1)/N M (gamma + c)

    Per phase each rank sends ``(N-1)/N r M``, ``(N-L)/N`` of it to other nodes, and the node's L
    ranks share its link; its own share goes over the node's links at the same time. L = 1 is
    :func:`compressed_allreduce_time`."""
    _check_nodes(local_size, cross_size, nbytes)
    n = local_size * cross_size
    wire = codec.ratio * nbytes
    phase = max(local_size * (n - local_size) / n * wire / cross.bandwidth,
                (local_size - 1) / n * wire / local.bandwidth)
    return 2 * (n - 1) * cross.alpha + 2 * phase + (n - 1) / n * nbytes * (cross.gamma + codec.cost_per_byte)


def hierarchical_allreduce_time(local_size: int, cross_size: int, nbytes: float, local: LinkParams,
                                cross: LinkParams, codec: CodecParams, node_ratio: float = 1.0) -> float:
    """The hierarchical compressed all-reduce (``compression/hierarchical.py``) of M bytes on C
    nodes of L ranks: a reduce-scatter inside the node (``node_ratio`` w: 1 for float32, 0.5 for a
    16-bit cast), the compressed all-reduce of each rank's shard M/L across nodes, the L ranks of
    a node sharing its link (each gets ``B_c / L``), and an allgather of the encoded shards inside
    the node::

        node reduce-scatter  (L-1) alpha_l + (L-1)/L w M / B_l + (L-1)/L M gamma
        across nodes         2(C-1) alpha_c + 2(C-1)/C r M / B_c + (C-1)/C M/L (gamma + c)
        node allgather       (L-1) alpha_l + (L-1)/L r M / B_l

    The node's link carries ``2(C-1)/C r M`` where the flat reduction puts
    ``2 L (C-1)/C r M`` on it (:func:`flat_on_nodes_time`). L = 1 is
    :func:`compressed_allreduce_time` over C ranks."""
    _check_nodes(local_size, cross_size, nbytes)
    share = (local_size - 1) / local_size
    node = (2 * (local_size - 1) * local.alpha + share * (node_ratio + codec.ratio) * nbytes / local.bandwidth
            + share * nbytes * local.gamma)
    shared_link = LinkParams(cross.alpha, cross.bandwidth / local_size, cross.gamma)
    return node + compressed_allreduce_time(cross_size, nbytes / local_size, shared_link, codec)


def _check_nodes(local_size: int, cross_size: int, nbytes: float) -> None:
    if local_size < 1 or cross_size < 1 or nbytes < 0:
        raise ValueError(f"need local_size >= 1, cross_size >= 1 and nbytes >= 0, got {local_size}, {cross_size}, "
                         f"{nbytes}")


def sync_iteration_time(compute: float, comm: float, overlap: float = 0.0) -> float:
    """Synchronous all-reduce training, one iteration: ``l_comp + (1-h) l_AR``. ``overlap`` h in
    [0, 1] is the share of the all-reduce hidden behind the backward pass (Horovod starts each
    tensor's reduction when its gradient is ready); h = 0 is the paper's ``l_comp + l_AR``."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    return compute + (1.0 - overlap) * comm
