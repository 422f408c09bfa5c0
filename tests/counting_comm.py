"""A communicator that counts the bytes this rank sends to ranks on other hosts, per collective,
as a direct exchange sends them (the pipeline channel's way): an alltoall's row j to rank j, an
allgather's row to every peer, a ring all-reduce's 2 (N-1)/N of the tensor, spread evenly."""
from typing import Any, Callable, List


class CountingComm:
    """``comm`` seen through a byte counter: ``cross_bytes`` holds what went to ranks whose host
    (``host_of(peer)``, peer a rank of ``comm``) differs from this rank's; ``local_bytes`` the rest."""

    def __init__(self, comm: Any, host_of: Callable[[int], int]) -> None:
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

    def allreduce_async_(self, x: Any, name: str, *args: Any) -> Any:
        self._count(lambda peer: 2 * x.nbytes / self.size)
        return self._comm.allreduce_async_(x, name, *args)

    def alltoall_async(self, x: Any, name: str) -> Any:
        self._count(lambda peer: x[peer].nbytes)
        return self._comm.alltoall_async(x, name)

    def allgather_async(self, x: Any, name: str) -> Any:
        self._count(lambda peer: x.nbytes)
        return self._comm.allgather_async(x, name)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        return self._comm.allgather_object(obj, name)
