"""One rank of benchmarks/phase_transport.py: the compressed all-reduce's two phases (and a float32
all-reduce) through every transport at hand, alone and beside a busy compute thread.

Two ranks, one per emulated host. Each transport gets the same blocking calls, issued from the
main thread (the engine's comm thread plays this part), while a second thread runs a one-thread
torch matmul loop ("beside compute") or sleeps ("alone"). Every sample starts after a barrier
over a control socket of our own, so no transport under test carries the benchmark's traffic;
transports, conditions and operations are interleaved round by round. Rank 0 prints one JSON line
(``MARKER``) with every rank's samples; progress goes to the file ``PSGD_PROGRESS`` names.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

MARKER = "PHASE_TRANSPORT_JSON "
GRAD_ELEMS = 4 * (1024 * 1024 + 1024)  # the throughput benchmark's 4 x Linear(1024, 1024): 16.8 MB float32
OPS = ("a2a-int8", "ag-int8", "a2a-fp16", "ag-fp16", "ar-fp32")


def payload_rows(codec_name: str, ranks: int) -> Tuple[int, int]:
    """(rows, bytes per row) of the encoded gradient the compressed all-reduce sends."""
    from pipesgd_hvd.compression import resolve_compression
    from pipesgd_hvd.ops.torch import TORCH_OPS

    codec = resolve_compression(codec_name)
    cols = codec.padded_cols(-(-GRAD_ELEMS // ranks))
    payload, _ = codec.encode(TORCH_OPS, torch.zeros(ranks, cols), key="size", seed=0)
    return ranks, int(payload.shape[1])


# ---------------------------------------------------------------------------- control link
class Link:
    """Two TCP connections between ranks 0 and 1 that no transport under test uses: ``control``
    for barriers, ``data`` for the plain TCP exchange (the wire reference)."""

    def __init__(self, hvd: Any, address: str) -> None:
        rank = hvd.rank()
        server = socket.create_server((address, 0)) if rank == 0 else None
        offer = hvd.broadcast_object(server.getsockname()[:2] if server else None, 0, name="bench.link")
        socks: Dict[bytes, socket.socket] = {}
        if server is not None:
            for _ in range(2):
                conn = server.accept()[0]
                socks[conn.recv(1)] = conn
            server.close()
        else:
            for kind in (b"c", b"d"):
                conn = socket.create_connection(tuple(offer), timeout=60)
                conn.sendall(kind)
                socks[kind] = conn
        for s in socks.values():
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.control, self.data, self.rank = socks[b"c"], socks[b"d"], rank

    def barrier(self) -> None:
        if self.rank == 0:
            self.control.recv(1)
            self.control.sendall(b"y")
        else:
            self.control.sendall(b"x")
            self.control.recv(1)

    def exchange(self, nbytes: int) -> None:
        """Both ranks send ``nbytes`` and receive the other's at once, as a 2-rank alltoall does."""
        got = bytearray(nbytes)
        view = memoryview(got)

        def receive() -> None:
            done = 0
            while done < nbytes:
                done += self.data.recv_into(view[done:], min(1 << 20, nbytes - done))

        reader = threading.Thread(target=receive)
        reader.start()
        self.data.sendall(bytes(nbytes))
        reader.join()


# ------------------------------------------------------------------------------ transports
Op = Callable[[torch.Tensor], Any]


class Transport:
    """Blocking alltoall (``x``: one row per rank), allgather (``x``: one row), allreduce (in place)."""

    key = ""
    alltoall: Op
    allgather: Op
    allreduce: Op


class HorovodOps(Transport):
    key = "hvd"

    def __init__(self, hvd: Any) -> None:
        # Fixed names: one op in flight at a time. Horovod's own synchronize() waits.
        self.alltoall = lambda x: hvd.alltoall(x, name="bench.a2a")
        self.allgather = lambda x: hvd.allgather(x, name="bench.ag")
        self.allreduce = lambda x: hvd.allreduce_(x, op=hvd.Sum, name="bench.ar")


def private_gloo(hvd: Any, address: str, name: str) -> Tuple[Any, Any]:
    """A torch.distributed Gloo group of our own on a store rank 0 serves (no default group);
    returns (group, store): the store must outlive the group."""
    import torch.distributed as dist

    rank = hvd.rank()
    server = dist.TCPStore(address, 0, None, True, wait_for_workers=False) if rank == 0 else None
    offer = hvd.broadcast_object((address, server.port) if server else None, 0, name=f"bench.{name}")
    store = server or dist.TCPStore(offer[0], offer[1], None, False)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    opts._timeout = datetime.timedelta(seconds=600)
    return dist.ProcessGroupGloo(store, rank, hvd.size(), opts), store


class Channel(Transport):
    """pipesgd_hvd.comm.pipeline_channel: receives posted before sends, Gloo's all-reduce."""

    key = "channel"

    def __init__(self) -> None:
        from pipesgd_hvd.comm.pipeline_channel import PipelineChannel

        ch = PipelineChannel.from_horovod(name="bench.channel")
        self.channel = ch
        self.alltoall = lambda x: ch.alltoall_async(x, "a2a").wait()
        self.allgather = lambda x: ch.allgather_async(x, "ag").wait()
        self.allreduce = lambda x: ch.allreduce_async_(x, "ar").wait()


class GlooCollectives(Transport):
    """torch.distributed Gloo's own collectives (alltoall_base, _allgather_base, allreduce)."""

    key = "tdist-coll"

    def __init__(self, hvd: Any, address: str) -> None:
        import torch.distributed as dist

        (pg, self.store), size = private_gloo(hvd, address, "coll"), hvd.size()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM

        def alltoall(x: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(x)
            pg.alltoall_base(out, x, [], [], dist.AllToAllOptions()).wait()
            return out

        def allgather(x: torch.Tensor) -> torch.Tensor:
            out = x.new_empty((size * x.shape[0],) + tuple(x.shape[1:]))
            pg._allgather_base(out, x).wait()
            return out

        self.alltoall, self.allgather = alltoall, allgather
        self.allreduce = lambda x: pg.allreduce([x], opts).wait()


class _Pairwise(Transport):
    """The three operations from one exchange with the peer (``_swap``), for 2 ranks."""

    rank = 0
    peer = 1

    def _swap(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        raise NotImplementedError

    def alltoall(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        out[self.rank] = x[self.rank]
        self._swap(x[self.peer], out[self.peer])
        return out

    def allgather(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((2,) + tuple(x.shape[1:]), dtype=x.dtype)
        out[self.rank] = x[0]
        self._swap(x[0], out[self.peer])
        return out

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        # Reduce-scatter by exchanging halves, add, then exchange the reduced halves back.
        halves = x.view(2, -1)
        mine = halves[self.rank]
        theirs = torch.empty_like(mine)
        self._swap(halves[self.peer], theirs)
        mine.add_(theirs)
        self._swap(mine, halves[self.peer])
        return x


class GlooPairwise(_Pairwise):
    """torch.distributed Gloo send/recv with the peer, the send posted first (the order that
    makes Gloo's two directions take turns; PipelineChannel posts the receive first)."""

    key = "tdist-p2p"

    def __init__(self, hvd: Any, address: str) -> None:
        self.pg, self.store = private_gloo(hvd, address, "p2p")
        self.rank, self.peer = hvd.rank(), 1 - hvd.rank()

    def _swap(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        works = [self.pg.send([send.contiguous()], self.peer, 0), self.pg.recv([recv], self.peer, 0)]
        for w in works:
            w.wait()


class MpiBlocking(Transport):
    """mpi4py blocking calls on a Dup() of COMM_WORLD, from this (non-compute) thread."""

    key = "mpi-blocking"

    def __init__(self) -> None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD.Dup()
        self.comm, self.MPI = comm, MPI

    def alltoall(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self.comm.Alltoall(x.numpy(), out.numpy())
        return out

    def allgather(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((2 * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype)
        self.comm.Allgather(x.numpy(), out.numpy())
        return out

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        self.comm.Allreduce(self.MPI.IN_PLACE, x.numpy(), op=self.MPI.SUM)
        return x


class MpiNonblocking(Transport):
    """pipesgd_hvd.comm.mpi4py as the engine uses it: I-collectives, polled with short sleeps."""

    key = "mpi-nonblocking"

    def __init__(self) -> None:
        from pipesgd_hvd.comm.mpi4py import Mpi4pyCommunicator
        from pipesgd_hvd.ops.torch import TORCH_OPS

        comm = Mpi4pyCommunicator(TORCH_OPS)
        self.alltoall = lambda x: comm.alltoall_async(x, "a2a").wait()
        self.allgather = lambda x: comm.allgather_async(x, "ag").wait()
        self.allreduce = lambda x: comm.allreduce_async_(x, "ar").wait()


class MpiPairwise(_Pairwise):
    """mpi4py Sendrecv with the peer (blocking), on a Dup() of COMM_WORLD."""

    key = "mpi-p2p"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.comm = MPI.COMM_WORLD.Dup()
        self.rank = self.comm.Get_rank()
        self.peer = 1 - self.rank

    def _swap(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        self.comm.Sendrecv(send.contiguous().numpy(), self.peer, 0, recv.numpy(), self.peer, 0)


class TcpReference(Transport):
    """The wire reference: a plain TCP exchange of the bytes the operation sends per rank."""

    key = "tcp"

    def __init__(self, link: Link) -> None:
        self.alltoall = lambda x: link.exchange(x[0].numel() * x.element_size())
        self.allgather = lambda x: link.exchange(x.numel() * x.element_size())
        # A 2-rank ring all-reduce sends 2 (N-1)/N of the buffer: all of it.
        self.allreduce = lambda x: link.exchange(x.numel() * x.element_size())


# --------------------------------------------------------------------------------- compute
class Compute:
    """A one-thread torch matmul loop that runs while ``on`` is set; counts finished products."""

    def __init__(self, dim: int) -> None:
        self.a, self.b = torch.randn(dim, dim), torch.randn(dim, dim)
        self.on = threading.Event()
        self.count = 0
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            self.on.wait()
            torch.mm(self.a, self.b)
            self.count += 1

    def stop(self) -> None:
        self._stop = True
        self.on.set()
        self.thread.join()


# ----------------------------------------------------------------------------------- main
def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description="one rank of benchmarks/phase_transport.py")
    parser.add_argument("--controller", choices=("gloo", "mpi"), required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--dim", type=int, default=256, help="compute thread's matmul size")
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    import horovod.torch as hvd

    hvd.init()
    assert hvd.size() == 2, "the phase benchmark runs on exactly 2 ranks (one per host)"
    from pipesgd_hvd.comm.addresses import channel_address

    address = channel_address(single_host=hvd.local_size() == hvd.size())
    link = Link(hvd, address)
    transports: List[Transport] = [HorovodOps(hvd), Channel(), GlooCollectives(hvd, address), GlooPairwise(hvd, address)]
    if args.controller == "mpi":
        transports += [MpiBlocking(), MpiNonblocking(), MpiPairwise()]
    transports.append(TcpReference(link))

    rows8, bytes8 = payload_rows("int8", 2)
    rows16, bytes16 = payload_rows("fp16", 2)
    inputs = {"a2a-int8": torch.randint(0, 255, (rows8, bytes8), dtype=torch.uint8),
              "ag-int8": torch.randint(0, 255, (1, bytes8), dtype=torch.uint8),
              "a2a-fp16": torch.randint(0, 255, (rows16, bytes16), dtype=torch.uint8),
              "ag-fp16": torch.randint(0, 255, (1, bytes16), dtype=torch.uint8),
              "ar-fp32": torch.zeros(GRAD_ELEMS)}  # zeros: in-place sums stay finite and normal
    method = {"a2a": "alltoall", "ag": "allgather", "ar": "allreduce"}
    compute = Compute(args.dim)
    progress = _progress_writer(hvd.rank())

    # samples[(transport, op, condition)] = [(seconds, cpu seconds of the process, matmuls done)]
    samples: Dict[str, List[Tuple[float, float, int]]] = {}
    baseline: List[Tuple[float, int]] = []   # compute alone: (seconds, matmuls)
    start = time.perf_counter()
    for r in range(args.rounds + 1):  # round 0 warms every path up and is dropped
        conditions = ("alone", "beside") if r % 2 == 0 else ("beside", "alone")
        for cond in conditions:
            if cond == "beside":
                compute.on.set()
            else:
                compute.on.clear()
            time.sleep(0.05)
            for op in OPS:
                order = transports[r % len(transports):] + transports[:r % len(transports)]
                for t in order:
                    fn = getattr(t, method[op.split("-")[0]])
                    x = inputs[op]
                    link.barrier()
                    c0, p0, t0 = compute.count, time.process_time(), time.perf_counter()
                    fn(x)
                    t1, p1, c1 = time.perf_counter(), time.process_time(), compute.count
                    if r > 0:
                        samples.setdefault(f"{t.key}|{op}|{cond}", []).append((t1 - t0, p1 - p0, c1 - c0))
                if cond == "beside":  # compute alone, right after: the rate "beside" is judged against
                    link.barrier()
                    c0, t0 = compute.count, time.perf_counter()
                    time.sleep(0.15)
                    if r > 0:
                        baseline.append((time.perf_counter() - t0, compute.count - c0))
        compute.on.clear()
        progress(f"{args.label} round {r}/{args.rounds} done, {time.perf_counter() - start:.0f} s")
    compute.stop()

    everyone = hvd.allgather_object({"samples": samples, "baseline": baseline}, name="bench.result")
    if hvd.rank() == 0:
        out = {"controller": args.controller, "rounds": args.rounds, "row_bytes": {"int8": bytes8, "fp16": bytes16},
               "grad_bytes": GRAD_ELEMS * 4, "transports": [t.key for t in transports], "per_rank": everyone}
        sys.stdout.write(MARKER + json.dumps(out) + "\n")
        sys.stdout.flush()


def _progress_writer(rank: int) -> Callable[[str], None]:
    path: Optional[str] = os.environ.get("PSGD_PROGRESS")

    def write(line: str) -> None:
        if rank == 0 and path:
            with open(path, "a") as f:
                f.write(line + "\n")

    return write


if __name__ == "__main__":
    main(sys.argv[1:])
