"""The pipeline's own transport: torch.distributed process groups on a private store.

Why not Horovod's ops: Horovod names an unnamed op ``<op>.noname.<handle>`` from a per-process
counter that every async op advances. The engine runs a byte codec's compressed all-reduce on its
comm thread, whose alltoall/allgather calls land at timing-dependent moments, so the counter
differs across ranks when the user calls an unnamed ``hvd.allreduce(metric)`` between steps and
the job hangs. This channel never calls Horovod after it is built, so the user's unnamed ops keep
their names. It was also the fastest transport measured for the compressed phases (2 emulated
hosts, 155 Mbit to 1 Gbit; docs/transports.md, "Which transport"): 84-111% of a
plain TCP exchange alone and 71-113% beside a busy compute thread, where Horovod's alltoall and
allgather reached 51-64% and 15-59%, and mpi4py 70-106% and 50-100%. Gloo's TCP pairs are driven by
its own C++ threads, woken by the kernel, so waiting needs neither the GIL nor a polling thread;
receives are posted before sends (:meth:`PipelineChannel._exchange` says why).

What it is: a ``ProcessGroupGloo`` (CPU tensors) and a second one for the consistency checks,
built directly on a ``TCPStore`` that rank 0 serves, never through ``init_process_group``: the
user's default process group, if any, is not touched. Device (CUDA) tensors, as the tensor-op
table names them (``ops``), go through a device group (``ProcessGroupNCCL``; injectable) made from
the same store at the first device collective, by the thread that issues it: its creation is at
the same point of the issue order on every rank. Its works wait and fail as Gloo's do
(:mod:`.device_group`). Collectives are matched by issue order within each group, as in MPI:
names only label errors.

Building it is collective (:meth:`PipelineChannel.from_horovod`): every rank calls it at the
same point of the program, from the training thread (one ``hvd.broadcast_object`` carries the
store's address). For Horovod elastic, :meth:`close` the old channel at a reset and build a new
one in the new world, from the training thread at the point where every rank (new workers too)
rebuilds its engine: a new store on the new rank 0.

One thread issues the tensor collectives of a channel: the groups match transfers by issue
order. :mod:`.ordered` gives the process one channel, shared by every optimizer, whose
collectives all go through one issue thread in the order they were submitted.
"""
from __future__ import annotations

import datetime
import pickle
from typing import Any, Callable, List, Optional, Sequence, Type

import torch
import torch.distributed as dist

from ..ops.torch import TORCH_OPS, TorchOps
from .addresses import channel_address
from .base import TIMEOUT_CAUSES, DoneHandle, PeerLostError, ReduceOp, default_timeout, postscale_factor
from .device_group import DeviceGroup, GroupFactory, nccl_group

# PIPESGD_TIMEOUT=0 means "no limit"; Gloo and the store need a number: ten years.
_FOREVER = datetime.timedelta(days=3650)


def _limit(timeout: Optional[float]) -> datetime.timedelta:
    return _FOREVER if timeout is None else datetime.timedelta(seconds=timeout)


class _WorkHandle:
    """torch.distributed ``Work`` objects behind the project's Handle: ``wait()`` blocks in C++
    with the GIL released (no polling that would take the compute thread's core), bounded by
    the group's own timeout, and reports a broken or timed-out connection as PeerLostError.
    ``keep`` holds the tensors the transfers read and write until they are done."""

    def __init__(self, works: Sequence[Any], finish: Callable[[], Any], what: str, keep: Any = None,
                 error: Type[PeerLostError] = PeerLostError, timeout: Optional[float] = None) -> None:
        self._works, self._finish, self._what, self._keep = list(works), finish, what, keep
        self._error, self._timeout = error, timeout
        self._result: Any = None
        self._finished = False

    def done(self) -> bool:
        return self._finished or all(w.is_completed() for w in self._works)

    def wait(self) -> Any:
        if not self._finished:
            failure = self._wait_works()
            if failure is not None:
                if "Timed out" in failure and self._timeout is not None:  # the same words as every transport's timeout
                    raise self._error(f"{self._what} on the pipeline channel did not complete within {self._timeout:g} s "
                                      f"(PIPESGD_TIMEOUT): {TIMEOUT_CAUSES}")
                raise self._error(f"{self._what} failed on the pipeline channel ({failure}): {TIMEOUT_CAUSES}")
            self._result = self._finish()
            self._finished = True
            self._works, self._keep = [], None
        return self._result

    def _wait_works(self) -> Optional[str]:
        """Waits for every transfer; on the first failure returns the first line of Gloo's message
        and drops the transfers, having kept no reference to them or to Gloo's exception. Why:
        a transfer holds its group's connections open, and the caller keeps the raised error (a
        Horovod elastic reset does); while they stay open, a live peer's receive from this rank
        waits until PIPESGD_TIMEOUT instead of failing at once when this rank closes the channel
        (tests/test_pipeline_channel_local.py: the peer waited until this process ended, 30 s;
        with the transfers dropped, 0.7 s). A device group's works block and raise the same way
        (.device_group.DeviceWork: NCCL's own wait() does neither)."""
        failure: Optional[str] = None
        try:
            for work in self._works:
                work.wait()
        except RuntimeError as exc:  # Gloo: "Connection reset by peer", "Timed out waiting ..."; device: .device_group
            text = str(exc).strip()
            failure = text.splitlines()[0] if text else type(exc).__name__
        if failure is not None:
            # Safe while transfers are pending: Gloo's pairs hold a posted buffer by a weak pointer
            # that its destructor invalidates (gloo/common/memory.h), so a late transfer is dropped.
            self._works, self._keep = [], None
        return failure


class _FailedPost:
    """A transfer whose posting raised (Gloo refuses to post to a peer whose connection is already
    closed): it fails at wait, where a posted transfer's failure would, and holds only the message."""

    def __init__(self, exc: BaseException) -> None:
        self._message = str(exc)

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        raise RuntimeError(self._message)


def _post(post: Callable[..., Any], *args: Any) -> Any:
    """Posts one transfer of an exchange; a peer already gone must not stop the transfers to the
    live peers from being posted: a live peer waits for them, and a rank that posted its receives
    but not its sends left that peer blocked until PIPESGD_TIMEOUT (measured under Horovod
    elastic: the other survivor of a lost worker waited 600 s)."""
    try:
        return post(*args)
    except RuntimeError as exc:  # Gloo: "Connection closed by peer"
        return _FailedPost(exc)


def _gloo_group(store: Any, rank: int, size: int, address: str, timeout: Optional[float]) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    opts._timeout = _limit(timeout)
    return dist.ProcessGroupGloo(store, rank, size, opts)


class PipelineChannel:
    """Collectives for the pipeline's own traffic (the Communicator protocol of :mod:`.base`).

    ``store``: a torch.distributed Store every rank reaches (rank 0 usually serves it);
    ``address``: this rank's address for Gloo's connections (:func:`.addresses.channel_address`);
    ``prefix``: keeps the keys of several channels (or generations, under elastic) apart.
    Construction is collective. Use :meth:`from_horovod` under Horovod."""

    def __init__(self, store: Any, rank: int, size: int, *, address: str, timeout: Optional[float] = None,
                 prefix: str = "psgd.channel", error: Type[PeerLostError] = PeerLostError,
                 ops: Optional[TorchOps] = None, device_group: GroupFactory = nccl_group) -> None:
        """``error``: the PeerLostError subclass a failure raises (under Horovod, one that is also
        a HorovodInternalError, so that ``hvd.elastic.run`` resets on it). ``ops``: the tensor-op
        table that names a tensor's device (tests pass one with a fake CUDA table);
        ``device_group``: makes the group for device tensors (tests pass a Gloo stand-in)."""
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        self._rank, self._size, self._address = rank, size, address
        self._timeout = timeout if timeout is not None else default_timeout()
        self._store = store
        self._prefix = prefix
        self._tensors = _gloo_group(dist.PrefixStore(f"{prefix}/gloo", store), rank, size, address, self._timeout)
        # Checks get a group of their own: they run while reductions are in flight, and a rank
        # that is missing one of those (fewer step() calls) must still answer the check.
        self._checks = _gloo_group(dist.PrefixStore(f"{prefix}/checks", store), rank, size, address, self._timeout)
        self._ops = ops if ops is not None else TORCH_OPS
        self._device_of = self._ops.streams.cuda.device_of
        self._device_factory = device_group
        self._nccl: Optional[DeviceGroup] = None
        self._closed = False
        self._error = error

    # --------------------------------------------------------------------------- building
    @classmethod
    def from_horovod(cls, timeout: Optional[float] = None, name: str = "psgd.channel") -> "PipelineChannel":
        """Builds the channel over Horovod's world (``hvd.init()`` first). Collective: call it on
        every rank at the same point, from the training thread; it issues one named
        ``hvd.broadcast_object`` (rank 0's store address) and no Horovod op afterwards."""
        import horovod.torch as hvd

        if not hvd.is_initialized():
            raise RuntimeError("Horovod is not initialized: call hvd.init() before building the pipeline channel")
        rank, size = hvd.rank(), hvd.size()
        timeout = timeout if timeout is not None else default_timeout()
        offer: Any = None
        server = None
        address = ""
        try:
            address = channel_address(single_host=hvd.local_size() == size)
            if rank == 0:
                # Port 0: the OS picks a free one; workers are not awaited here (they connect
                # only after the broadcast below).
                server = dist.TCPStore(address, 0, None, True, timeout=_limit(timeout), wait_for_workers=False)
                offer = ("ok", address, server.port)
        except Exception as exc:  # noqa: BLE001 - sent to every rank below, then raised here
            offer = ("error", f"rank {rank}: {type(exc).__name__}: {exc}")
            if rank != 0:
                raise
        # Every rank takes part even when rank 0 failed, so that all of them raise, none hangs.
        offer = hvd.broadcast_object(offer, root_rank=0, name=f"{name}.rendezvous")
        if offer[0] != "ok":
            raise RuntimeError(f"the pipeline channel could not start: {offer[1]}")
        _, host, port = offer
        store = server if server is not None else dist.TCPStore(host, port, None, False, timeout=_limit(timeout))
        from .horovod_torch import HorovodPeerLostError

        return cls(store, rank, size, address=address, timeout=timeout, prefix=name, error=HorovodPeerLostError)

    def close(self) -> None:
        """Ends the groups without waiting for their peers (a lost peer, or a world that is gone at
        a Horovod elastic reset); the channel is unusable afterwards. Dropping the groups closes
        their sockets once no transfer holds them, which ends the peers' waits on this rank at
        once. A transfer of this rank still waiting on a live peer that will never answer ends
        only at the timeout: Gloo's abort does not interrupt a posted receive (measured)."""
        if self._closed:
            return
        self._closed = True
        for group in (self._tensors, self._checks, self._nccl):
            if group is not None:
                group.abort()
        self._tensors = self._checks = self._nccl = None
        self._store = None

    # ------------------------------------------------------------------------- properties
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def address(self) -> str:
        """This rank's address for the channel's connections (for logs and diagnosis)."""
        return self._address

    def _group(self, x: torch.Tensor) -> Any:
        if self._closed:
            raise RuntimeError("the pipeline channel was closed")
        if self._device_of(x) is None:
            if x.device.type != "cpu":
                raise ValueError(f"the pipeline channel reduces CPU or CUDA tensors, got one on {x.device}")
            return self._tensors
        if self._nccl is None:
            self._nccl = self._nccl_group()
        return self._nccl

    def _nccl_group(self) -> DeviceGroup:
        # Made once, by the thread issuing the first device collective (the issue thread,
        # .ordered), at the same point of the issue order on every rank: same store, own prefix.
        group = self._device_factory(dist.PrefixStore(f"{self._prefix}/nccl", self._store), self._rank, self._size,
                                     self._timeout)
        return DeviceGroup(group, self._timeout)

    # ------------------------------------------------------------------------ collectives
    def allreduce_async_(self, x: torch.Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> Any:
        after = postscale_factor(op, postscale, self._size)
        if self._size == 1:
            if prescale * after != 1.0:
                x.mul_(prescale * after)
            return DoneHandle(x)
        if prescale != 1.0:
            x.mul_(prescale)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        # Gloo's ring all-reduce sends in chunks and kept pace with a plain TCP exchange (docs/transports.md).
        work = _post(self._group(x).allreduce, [x], opts)
        return _WorkHandle([work], lambda: x.mul_(after) if after != 1.0 else x, f"allreduce '{name}'",
                           error=self._error, timeout=self._timeout)

    def alltoall_async(self, x: torch.Tensor, name: str) -> Any:
        if x.dim() == 0 or x.shape[0] != self._size:
            raise ValueError(f"alltoall '{name}': the tensor needs one row per rank ({self._size}), "
                             f"got shape {tuple(x.shape)}")
        x = x.contiguous()
        if self._size == 1:
            return DoneHandle(x.clone())
        out = torch.empty_like(x)
        group = self._group(x)
        if group is not self._tensors:
            works = [_post(group.alltoall_base, out, x, [], [], dist.AllToAllOptions())]
        else:
            out[self._rank] = x[self._rank]
            works = self._exchange(group, [(p, x[p], out[p]) for p in self._peers()])
        return _WorkHandle(works, lambda: out, f"alltoall '{name}'", keep=(x, out), error=self._error, timeout=self._timeout)

    def allgather_async(self, x: torch.Tensor, name: str) -> Any:
        x = x.contiguous()
        if self._size == 1:
            return DoneHandle(x.clone())
        rows = x.shape[0]
        out = x.new_empty((self._size * rows,) + tuple(x.shape[1:]))
        group = self._group(x)
        if group is not self._tensors:
            works = [_post(group._allgather_base, out, x)]
        else:
            out[self._rank * rows:(self._rank + 1) * rows] = x
            works = self._exchange(group, [(p, x, out[p * rows:(p + 1) * rows]) for p in self._peers()])
        return _WorkHandle(works, lambda: out, f"allgather '{name}'", keep=(x, out), error=self._error, timeout=self._timeout)

    def _peers(self) -> List[int]:
        # Starting at the next rank spreads the first sends over the ranks instead of all at rank 0.
        return [(self._rank + i) % self._size for i in range(1, self._size)]

    @staticmethod
    def _exchange(group: Any, transfers: Sequence[Any]) -> List[Any]:
        """Point-to-point: every receive is posted before any send. Why (measured, docs/transports.md):
        Gloo's TCP pair sends a message only once the receiver announced its receive, and queues
        that announcement behind any data it is still writing; when a rank's send starts first,
        its announcement waits for all of its data, so the two directions of an exchange take
        turns and Gloo's own alltoall (and Horovod's) reach about half of a plain TCP exchange."""
        works = [_post(group.recv, [recv], peer, 0) for peer, _, recv in transfers]
        return works + [_post(group.send, [send], peer, 0) for peer, send, _ in transfers]

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        if self._closed:
            raise RuntimeError("the pipeline channel was closed")
        if self._size == 1:
            return [pickle.loads(pickle.dumps(obj))]
        # Sizes first, then every rank's bytes padded to the longest.
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = torch.empty(self._size, dtype=torch.int64)
        what = f"allgather_object '{name}'"
        _WorkHandle([self._checks._allgather_base(sizes, torch.tensor([data.numel()], dtype=torch.int64))],
                    lambda: None, what, error=self._error, timeout=self._timeout).wait()
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        gathered = torch.empty(self._size * longest, dtype=torch.uint8)  # Gloo wants size x the input's shape
        _WorkHandle([self._checks._allgather_base(gathered, padded)], lambda: None, what, error=self._error, timeout=self._timeout).wait()
        rows = gathered.view(self._size, longest)
        return [pickle.loads(rows[r, :int(sizes[r])].numpy().tobytes()) for r in range(self._size)]
