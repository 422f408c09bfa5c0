"""In-process hosts: ``hosts`` x ``per_host`` ranks as threads, with the node and cross-node
groups of the hierarchical all-reduce (:class:`~pipesgd_hvd.comm.topology.Topology`), so that
the hierarchical path runs in one process as it runs across hosts."""
from __future__ import annotations

from ..comm.topology import NodeLayout, Topology
from ..ops.base import MutableTensorOps
from .local import LocalWorld


class LocalCluster:
    """``hosts`` x ``per_host`` in-process ranks (threads): a :class:`LocalWorld` over all of
    them and one per node and per local rank for the groups. Rank ``r`` is local rank
    ``r % per_host`` on host ``r // per_host``, as Horovod numbers ranks host by host."""

    def __init__(self, hosts: int, per_host: int, ops: MutableTensorOps, timeout: float = 60.0) -> None:
        self.hosts, self.per_host = hosts, per_host
        self.world = LocalWorld(hosts * per_host, ops, timeout)
        self._nodes = [LocalWorld(per_host, ops, timeout) for _ in range(hosts)]
        self._crosses = [LocalWorld(hosts, ops, timeout) for _ in range(per_host)]

    @property
    def size(self) -> int:
        return self.world.size

    def layout(self, rank: int) -> NodeLayout:
        return NodeLayout(rank % self.per_host, self.per_host, rank // self.per_host, self.hosts)

    def topology(self, rank: int) -> Topology:
        lay = self.layout(rank)
        return Topology(lay, self._nodes[lay.cross_rank].communicator(lay.local_rank),
                        self._crosses[lay.local_rank].communicator(lay.cross_rank))


__all__ = ["LocalCluster"]
