"""A communicator that counts the bytes this rank sends, apart by whether they leave its host.

Wrap any transport to see where a reduction's bytes go (``compression/hierarchical.py`` moves them
off the slow links between hosts): ``counted = CountingComm(channel, host_of=lambda peer: ...)``,
run the reduction on ``counted``, read ``cross_bytes`` and ``local_bytes``. Bytes are counted as
a direct exchange sends them, the pipeline channel's way: an alltoall's row j to rank j, an
allgather's input to every peer, a ring all-reduce's ``2 (N-1)/N`` of the tensor, spread evenly
over the peers. Headers, acknowledgements and a transport's own traffic are not counted.
"""
from __future__ import annotations

from typing import Any, Callable, List

from ..comm.base import Communicator, Handle, ReduceOp


class CountingComm:
    """``comm`` seen through a byte counter. ``host_of(peer)`` names the host of each of ``comm``'s
    ranks; ``cross_bytes`` holds what went to ranks on other hosts than this rank's, ``local_bytes``
    the rest (numpy arrays and torch tensors: their ``nbytes``)."""

    def __init__(self, comm: Communicator, host_of: Callable[[int], Any]) -> None:
        self._comm, self._host_of = comm, host_of
        self.cross_bytes = self.local_bytes = 0

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def size(self) -> int:
        return self._comm.size

    def _count(self, per_peer: Callable[[int], float]) -> None:
        mine = self._host_of(self.rank)
        for peer in range(self.size):
            if peer == self.rank:
                continue
            nbytes = int(per_peer(peer))
            if self._host_of(peer) == mine:
                self.local_bytes += nbytes
            else:
                self.cross_bytes += nbytes

    def allreduce_async_(self, x: Any, name: str, op: ReduceOp = ReduceOp.SUM, prescale: float = 1.0,
                         postscale: float = 1.0) -> Handle:
        self._count(lambda peer: 2 * x.nbytes / self.size)
        return self._comm.allreduce_async_(x, name, op, prescale, postscale)

    def alltoall_async(self, x: Any, name: str) -> Handle:
        self._count(lambda peer: x[peer].nbytes)
        return self._comm.alltoall_async(x, name)

    def allgather_async(self, x: Any, name: str) -> Handle:
        self._count(lambda peer: x.nbytes)
        return self._comm.allgather_async(x, name)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        return self._comm.allgather_object(obj, name)
