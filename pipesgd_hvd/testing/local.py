"""An in-process world: N ranks as threads sharing memory, for tests of the engine and of training code.

Collectives are matched by the order in which each rank issues them (as MPI does), so a test
also catches an engine that issues them in a different order on different ranks. Object
allgathers (consistency checks) have their own order, as a separate MPI communicator would.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..comm import wire
from ..comm.base import TIMEOUT_CAUSES, PeerLostError, ReduceOp, postscale_factor
from .board import MemoryBoard
from ..ops.base import MutableTensorOps, Tensor


class LocalWorld:
    """Shared state of N in-process ranks. ``communicator(r)`` gives rank r's view."""

    def __init__(self, size: int, ops: MutableTensorOps, timeout: float = 60.0) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.ops = ops
        self.timeout = timeout
        self._lock = threading.Condition()
        # Keyed by (channel, sequence number): "tensor" collectives and "object" checks.
        self._pending: Dict[Tuple[str, int], Dict[int, Tuple[str, str, Any]]] = {}
        self._results: Dict[Tuple[str, int], Dict[int, Any]] = {}
        self._issued: Dict[str, List[int]] = {"tensor": [0] * size, "object": [0] * size}
        self.events: List[Tuple[int, str, str]] = []  # (rank, "start"/"wait"/"done", name)
        self.board_entries: Dict[Any, Any] = {}
        self.board_lock = threading.Lock()
        self.boards = True  # False: the ranks have no status board (as with mpi4py or Horovod's ops)

    def communicator(self, rank: int) -> "LocalCommunicator":
        return LocalCommunicator(self, rank)

    def record(self, rank: int, what: str, name: str) -> None:
        with self._lock:
            self.events.append((rank, what, name))

    def _submit(self, rank: int, kind: str, name: str, payload: Any,
                combine: Callable[[List[Any]], List[Any]]) -> "_LocalHandle":
        channel = "object" if kind == "allgather_object" else "tensor"
        with self._lock:
            seq = (channel, self._issued[channel][rank])
            self._issued[channel][rank] += 1
            entries = self._pending.setdefault(seq, {})
            for other, (okind, oname, _) in entries.items():
                if (okind, oname) != (kind, name):
                    raise RuntimeError(
                        f"{channel} collective #{seq[1]} mismatch: rank {rank} issued {kind} '{name}', "
                        f"rank {other} issued {okind} '{oname}'")
            entries[rank] = (kind, name, payload)
            if len(entries) == self.size:
                inputs = [entries[r][2] for r in range(self.size)]
                self._results[seq] = dict(enumerate(combine(inputs)))
                del self._pending[seq]
                self._lock.notify_all()
            self.events.append((rank, "start", name))
        return _LocalHandle(self, seq, rank, name)

    def _wait(self, seq: Tuple[str, int], rank: int, name: str) -> Any:
        with self._lock:
            self.events.append((rank, "wait", name))
            ok = self._lock.wait_for(lambda: seq in self._results, timeout=self.timeout)
            if not ok:
                raise PeerLostError(f"local collective '{name}' did not complete within {self.timeout:g} s: "
                                    f"{TIMEOUT_CAUSES}")
            result = self._results[seq].pop(rank)
            if not self._results[seq]:
                del self._results[seq]
            self.events.append((rank, "done", name))
            return result


class _LocalHandle:
    def __init__(self, world: LocalWorld, seq: Tuple[str, int], rank: int, name: str) -> None:
        self._world, self._seq, self._rank, self._name = world, seq, rank, name
        self._value: Any = None
        self._finished = False

    def done(self) -> bool:
        with self._world._lock:
            return self._finished or self._seq in self._world._results

    def wait(self) -> Any:
        if not self._finished:
            self._value = self._world._wait(self._seq, self._rank, self._name)
            self._finished = True
        return self._value


class LocalCommunicator:
    def __init__(self, world: LocalWorld, rank: int) -> None:
        self._world = world
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._world.size

    def allreduce_async_(self, x: Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> _LocalHandle:
        ops = self._world.ops
        after = postscale_factor(op, postscale, self._world.size)

        def combine(inputs: List[Tensor]) -> List[Tensor]:
            scaled = [t * prescale if prescale != 1.0 else t for t in inputs]
            total = scaled[0]
            for t in scaled[1:]:
                total = total + t  # in rank order, so results are reproducible
            if after != 1.0:
                total = total * after
            if not hasattr(ops, "empty"):  # immutable tensors (TensorFlow's): every rank gets the result
                return [total] * len(inputs)
            return [ops.assign(t, total) for t in inputs]  # in place on every rank's tensor

        return self._world._submit(self._rank, "allreduce", name, x, combine)

    def alltoall_async(self, x: Tensor, name: str) -> _LocalHandle:
        ops, size = self._world.ops, self._world.size

        def combine(inputs: List[Tensor]) -> List[Tensor]:
            return [ops.concat([inputs[src][dst:dst + 1] for src in range(size)], 0) for dst in range(size)]

        return self._world._submit(self._rank, "alltoall", name, x, combine)

    def allgather_async(self, x: Tensor, name: str) -> _LocalHandle:
        ops, size = self._world.ops, self._world.size

        def combine(inputs: List[Tensor]) -> List[Tensor]:
            gathered = ops.concat(inputs, 0)
            return [gathered] * size

        return self._world._submit(self._rank, "allgather", name, x, combine)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        size = self._world.size
        return self._world._submit(self._rank, "allgather_object", name, wire.encode(obj),
                                   lambda inputs: [[wire.decode(b) for b in inputs] for _ in range(size)]).wait()

    def status_board(self, namespace: str) -> Optional[MemoryBoard]:
        world = self._world
        if world.size == 1 or not world.boards:
            return None
        return MemoryBoard(world.board_entries, world.board_lock, self._rank, world.size, namespace)
