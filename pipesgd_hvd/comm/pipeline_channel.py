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
user's default process group, if any, is not touched. The store listens on the channel's address
only (a socket bound there and handed to torch), as Gloo's connections do. Device (CUDA) tensors,
as the tensor-op table names them (``ops``), go through a device group (``ProcessGroupNCCL``;
injectable) made from the same store at the first device collective, by the thread that issues
it: its creation is at the same point of the issue order on every rank. Its works wait and fail as
Gloo's do (:mod:`.device_group`). Collectives are matched by issue order within each group, as in
MPI: names only label errors.

Who can talk to it (docs/reliability.md, "Who can talk to a job"): rank 0 makes a per-job secret
and sends it with the store's address through Horovod's broadcast, which runs inside the job.
Every rank proves it on every pair of each group before the group is used (a challenge-response
over each pair's own connection, :func:`prove_pairs`), the device group included, so a
connection that Gloo or NCCL made to anyone outside the job (a rendezvous entry written from
outside) fails there with an error that says so. Objects are gathered in a typed encoding, never
pickled (:mod:`.wire`), and each carries its sender's MAC; entries of the status board
(:mod:`.board`) are signed the same way with a sequence number inside the MAC, and one that is
forged, replayed or deleted is ignored and counted; every board call is bounded in time
(:mod:`.store_lane`), since rank 0, which serves the store, may be frozen.

Building it is collective (:meth:`PipelineChannel.from_horovod`): every rank calls it at the
same point of the program, from the training thread (two named ``hvd.broadcast`` ops carry the
store's address and the job's secret). For Horovod elastic, :meth:`close` the old channel at a reset and build a new
one in the new world, from the training thread at the point where every rank (new workers too)
rebuilds its engine: a new store on the new rank 0.

One thread issues the tensor collectives of a channel: the groups match transfers by issue
order. :mod:`.ordered` gives the process one channel, shared by every optimizer, whose
collectives all go through one issue thread in the order they were submitted.
"""
from __future__ import annotations

import datetime
import secrets
import socket
from typing import Any, Callable, Dict, List, Optional, Sequence, Type

import torch
import torch.distributed as dist

from ..ops.torch import TORCH_OPS, TorchOps
from . import wire
from .addresses import channel_address
from .base import TIMEOUT_CAUSES, DoneHandle, PeerLostError, PolledHandle, ReduceOp, default_timeout, postscale_factor
from .board import StoreBoard, store_lane
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


class ForeignPeerError(RuntimeError):
    """A connection of the pipeline channel did not prove the job's secret: it does not lead to a
    rank of this job."""


NONCE_BYTES = 16


def prove_pairs(group: Any, rank: int, size: int, secret: bytes, context: Sequence[bytes],
                wait: Callable[[Any], None], like: Optional[torch.Tensor] = None) -> List[int]:
    """The ranks whose connection on ``group`` did not prove ``secret`` (empty: every one did).

    A challenge-response on every pair: rank r sends each peer p a fresh nonce of its own, then
    ``HMAC(secret, context, r, p, the nonce p sent r, the nonce r sent p)``, and checks p's proof
    the same way. Both rounds are an ``alltoall``, which Gloo and NCCL run as a direct exchange
    with every peer, so each pair's own connection carries its proof in both directions. (The
    proof before issue 40 was an allgather, which Gloo runs as a ring: with 4 or more ranks it
    proved only neighbours' connections, while the tensors group sends to every peer directly.)
    ``wait(work)`` waits for a transfer; ``like``: a tensor on the group's device."""
    nonces = [secrets.token_bytes(NONCE_BYTES) for _ in range(size)]  # nonces[p]: the one sent to p

    def exchange(rows: Sequence[bytes], width: int) -> List[bytes]:
        sent = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8)
        if like is not None:
            sent = sent.to(like.device)
        got = torch.empty_like(sent)
        wait(_post(group.alltoall_base, got, sent, [], [], dist.AllToAllOptions()))
        raw = got.cpu().numpy().tobytes()
        return [raw[p * width:(p + 1) * width] for p in range(size)]

    theirs = exchange(nonces, NONCE_BYTES)  # theirs[p]: the nonce p sent this rank
    me = str(rank).encode()
    proofs = exchange([wire.mac(secret, *context, b"from", me, b"to", str(p).encode(), theirs[p], nonces[p])
                       for p in range(size)], wire.MAC_BYTES)
    return [p for p in range(size) if p != rank and not wire.mac_ok(
        secret, proofs[p], *context, b"from", str(p).encode(), b"to", me, nonces[p], theirs[p])]


def _bound_listener(address: str) -> socket.socket:
    """A listening socket on ``address`` only (port chosen by the OS), for the store's server:
    torch's own server listens on every interface, whatever host it is given."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, 0))
    sock.listen(128)
    return sock


class PipelineChannel:
    """Collectives for the pipeline's own traffic (the Communicator protocol of :mod:`.base`).

    ``store``: a torch.distributed Store every rank reaches (rank 0 usually serves it);
    ``address``: this rank's address for Gloo's connections (:func:`.addresses.channel_address`);
    ``secret``: the job's secret, the same bytes on every rank (:func:`.wire.new_secret` on one
    rank, sent to the others inside the job); ``prefix``: keeps the keys of several channels (or
    generations, under elastic) apart. Construction is collective. Use :meth:`from_horovod` under
    Horovod."""

    def __init__(self, store: Any, rank: int, size: int, *, address: str, secret: bytes,
                 timeout: Optional[float] = None, prefix: str = "psgd.channel",
                 error: Type[PeerLostError] = PeerLostError, ops: Optional[TorchOps] = None,
                 device_group: GroupFactory = nccl_group, store_rank: Optional[int] = 0) -> None:
        """``error``: the PeerLostError subclass a failure raises (under Horovod, one that is also
        a HorovodInternalError, so that ``hvd.elastic.run`` resets on it). ``ops``: the tensor-op
        table that names a tensor's device (tests pass one with a fake CUDA table);
        ``device_group``: makes the group for device tensors (tests pass a Gloo stand-in);
        ``store_rank``: the rank whose process serves ``store`` (named when it stops answering;
        None: not a rank of this channel)."""
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("secret must be the job's secret, at least 16 random bytes shared by every rank "
                             "(pipesgd_hvd.comm.wire.new_secret() on one rank, sent to the others inside the job)")
        self._rank, self._size, self._address = rank, size, address
        self._timeout = timeout if timeout is not None else default_timeout()
        self._store = store
        self._prefix = prefix
        self._secret = secret
        self._error = error
        self._closed = False
        self._nccl: Any = None
        self._device_failure: Optional[BaseException] = None
        self._store_rank = store_rank
        self._boards: List[Any] = []
        self._tensors = _gloo_group(dist.PrefixStore(f"{prefix}/gloo", store), rank, size, address, self._timeout)
        # Checks get a group of their own: they run while reductions are in flight, and a rank
        # that is missing one of those (fewer step() calls) must still answer the check.
        self._checks = _gloo_group(dist.PrefixStore(f"{prefix}/checks", store), rank, size, address, self._timeout)
        self._ops = ops if ops is not None else TORCH_OPS
        self._device_of = self._ops.streams.cuda.device_of
        self._device_factory = device_group
        self._prove(self._tensors, "tensors")
        self._prove(self._checks, "checks")

    @property
    def error_type(self) -> Type[PeerLostError]:
        """What this channel raises when a peer is lost (the stall inspector raises the same)."""
        return self._error

    def _prove(self, group: Any, label: str, like: Optional[torch.Tensor] = None, what: Optional[str] = None) -> None:
        """Every rank proves the job's secret on each of ``group``'s connections before anything
        is used (:func:`prove_pairs`); a connection that leads to someone outside the job (a
        rendezvous entry written from outside) fails here, with words, on the rank that holds it.
        ``like``: a tensor on the group's device (the device group's nonces live there);
        ``what``: the collective that waits for it (named by a timeout)."""
        if self._size == 1:
            return
        what = what or f"the secret check of the pipeline channel's {label} group"

        def wait(work: Any) -> None:
            _WorkHandle([work], lambda: None, what, error=self._error, timeout=self._timeout).wait()

        foreign = prove_pairs(group, self._rank, self._size, self._secret,
                              (b"psgd-hello", self._prefix.encode(), label.encode()), wait, like)
        if foreign:
            raise ForeignPeerError(
                f"the pipeline channel's connection(s) to rank(s) {foreign} did not prove this job's secret: they do "
                f"not lead to a rank of this job ({label} group; someone outside it wrote to the pipeline's store, or "
                "a stale job used the same port). Nothing received on them was used; check who can reach the "
                "training hosts (docs/reliability.md, 'Who can talk to a job')")

    # --------------------------------------------------------------------------- building
    @classmethod
    def from_horovod(cls, timeout: Optional[float] = None, name: str = "psgd.channel") -> "PipelineChannel":
        """Builds the channel over Horovod's world (``hvd.init()`` first). Collective: call it on
        every rank at the same point, from the training thread; it issues two named
        ``hvd.broadcast`` ops (rank 0's store address and the job's secret, in the typed encoding
        of :mod:`.wire`) and no Horovod op afterwards."""
        import horovod.torch as hvd

        if not hvd.is_initialized():
            raise RuntimeError("Horovod is not initialized: call hvd.init() before building the pipeline channel")
        rank, size = hvd.rank(), hvd.size()
        timeout = timeout if timeout is not None else default_timeout()
        offer: Dict[str, Any] = {}
        server = None
        address = ""
        try:
            address = channel_address(single_host=hvd.local_size() == size)
            if rank == 0:
                # Bound to the channel's address only; the OS picks a free port. Workers are not
                # awaited here (they connect only after the broadcast below).
                listener = _bound_listener(address)
                port = listener.getsockname()[1]
                server = dist.TCPStore(address, port, None, True, timeout=_limit(timeout), wait_for_workers=False,
                                       master_listen_fd=listener.detach())
                offer = {"ok": True, "host": address, "port": port, "secret": wire.new_secret()}
        except Exception as exc:  # noqa: BLE001 - sent to every rank below, then raised here
            offer = {"ok": False, "error": f"rank {rank}: {type(exc).__name__}: {exc}"}
            if rank != 0:
                raise
        # Every rank takes part even when rank 0 failed, so that all of them raise, none hangs.
        offer = _broadcast_object(hvd, offer if rank == 0 else None, f"{name}.rendezvous")
        if not offer.get("ok"):
            raise RuntimeError(f"the pipeline channel could not start: {offer.get('error')}")
        store = server if server is not None else dist.TCPStore(offer["host"], offer["port"], None, False,
                                                                timeout=_limit(timeout))
        from .horovod_torch import HorovodPeerLostError

        return cls(store, rank, size, address=address, secret=offer["secret"], timeout=timeout, prefix=name,
                   error=HorovodPeerLostError)

    def status_board(self, namespace: str) -> Optional[StoreBoard]:
        """This rank's view of the status board ``namespace`` (:mod:`.board`), on a connection of
        its own to the store, with a short timeout; None for a single rank."""
        if self._size == 1 or self._closed:
            return None
        server = f"rank {self._store_rank}" if self._store_rank is not None else "the store's host"
        board = StoreBoard(store_lane(self._store, server=server), self._rank, self._size, self._secret,
                           f"{self._prefix}/{namespace}", server_rank=self._store_rank)
        self._boards.append(board)
        return board

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
        for board in self._boards:
            board.lane.close()
        self._boards = []

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

    def _group(self, x: torch.Tensor, what: str) -> Any:
        if self._closed:
            raise RuntimeError("the pipeline channel was closed")
        if self._device_of(x) is None:
            if x.device.type != "cpu":
                raise ValueError(f"the pipeline channel reduces CPU or CUDA tensors, got one on {x.device}")
            return self._tensors
        if self._nccl is None:
            self._nccl = self._nccl_group(x, what)
        return self._nccl

    def _nccl_group(self, x: torch.Tensor, what: str) -> DeviceGroup:
        """Made once, by the thread issuing the first device collective (the issue thread,
        .ordered), at the same point of the issue order on every rank: same store, own prefix.
        Proved like the Gloo groups before its first collective (its rendezvous key, NCCL's
        unique id, is read from the store, which anyone who reaches it can write); a group that
        fails is aborted, and every later device collective raises the same error."""
        if self._device_failure is not None:
            raise self._device_failure
        group = DeviceGroup(self._device_factory(dist.PrefixStore(f"{self._prefix}/nccl", self._store), self._rank,
                                                 self._size, self._timeout), self._timeout)
        try:
            self._prove(group, "device", like=x, what=f"{what} (with the secret check of its new device group)")
        except (ForeignPeerError, PeerLostError) as exc:
            group.abort("its secret check failed")
            self._device_failure = exc
            raise
        return group

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
        work = _post(self._group(x, f"allreduce '{name}'").allreduce, [x], opts)
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
        group = self._group(x, f"alltoall '{name}'")
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
        group = self._group(x, f"allgather '{name}'")
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
        """Every rank's ``obj`` (:mod:`.wire`'s types only), each checked against its sender's MAC
        before it is decoded."""
        if self._closed:
            raise RuntimeError("the pipeline channel was closed")
        if self._size == 1:
            return [wire.decode(wire.encode(obj))]
        # Sizes first, then every rank's bytes padded to the longest.
        framed = wire.seal(self._secret, self._object_context(self._rank), wire.encode(obj))
        data = torch.frombuffer(bytearray(framed), dtype=torch.uint8)
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
        out = []
        for r in range(self._size):
            frame = rows[r, :max(0, min(int(sizes[r]), longest))].numpy().tobytes()
            out.append(wire.decode(wire.open_sealed(self._secret, self._object_context(r), frame, f"rank {r}")))
        return out

    def _object_context(self, rank: int) -> bytes:
        return f"{self._prefix}/object/{rank}".encode()


def _broadcast_object(hvd: Any, obj: Any, name: str) -> Any:
    """Rank 0's ``obj`` on every rank, through two named Horovod broadcasts of its typed encoding
    (Horovod's own ``broadcast_object`` unpickles what it receives). Each is waited for in a
    sleeping poll with no limit, as Horovod's own ops wait: ranks reach this point seconds apart
    (imports, data), and Horovod's ``synchronize()`` would spin on a core the whole time."""
    def broadcast(tensor: torch.Tensor, op_name: str) -> torch.Tensor:
        handle = hvd.broadcast_async(tensor, root_rank=0, name=op_name)
        return PolledHandle(lambda: hvd.poll(handle), lambda: hvd.synchronize(handle), op_name).wait()

    data = wire.encode(obj) if hvd.rank() == 0 else b""
    size = broadcast(torch.tensor([len(data)], dtype=torch.int64), f"{name}.size")
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8)
    if hvd.rank() == 0 and data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return wire.decode(broadcast(buffer, name).numpy().tobytes())
