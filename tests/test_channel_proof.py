"""Issue 40: every pair of ranks that exchanges bytes proves the job's secret on its own
connection, on the Gloo groups and on the device (NCCL) group alike.

Before, the proof was an allgather, which Gloo runs as a ring (gloo/allgather.cc): each rank
received every proof, but only from its neighbour, so with 4 or more ranks the connection
between ranks 0 and 2, over which the tensors group's direct exchange sends gradients, was never
proved. And the device group was made from the store with no proof at all: an outsider who set
its rendezvous key (NCCL's unique id) had ranks join a stranger's communicator.

The pair test runs the proof on an in-memory mesh whose pair (0, 2) leads to a stranger; the
device test puts a stranger (a Gloo group with NCCL's work semantics, tests/fake_nccl.py, that
does not know the secret) on each rank's device group; the 4-rank test runs real Gloo groups.
"""
import datetime
import os
import queue
import re
import threading

import pytest
import torch
import torch.distributed as dist

from fake_cuda import FakeCuda
from fake_nccl import NcclLikeFactory
from pipesgd_hvd.comm.base import PeerLostError
from pipesgd_hvd.comm.pipeline_channel import ForeignPeerError, PipelineChannel, prove_pairs
from pipesgd_hvd.ops.torch import TorchOps

SECRET = b"0123456789abcdef-the-jobs-secret"
WRONG = b"not-the-jobs-secret-but-as-long"
CONTEXT = (b"psgd-hello", b"test", b"tensors")


class _Done:
    def wait(self):
        return True

    def is_completed(self):
        return True


class Mesh:
    """``size`` ranks joined pair by pair (one queue per direction), as Gloo's full mesh; the
    directed pairs in ``hijacked`` lead to a stranger who swallows what is sent and answers with
    random bytes. Records which directed pairs carried bytes."""

    def __init__(self, size, hijacked=()):
        self.size, self.hijacked = size, set(hijacked)
        self.links = {(a, b): queue.Queue() for a in range(size) for b in range(size) if a != b}
        self.used = set()

    def group(self, rank):
        mesh = self

        class Group:
            def alltoall_base(self, out, inp, out_splits, in_splits, opts):
                rows_in, rows_out = inp.view(mesh.size, -1), out.view(mesh.size, -1)
                rows_out[rank] = rows_in[rank]
                for p in range(mesh.size):  # sends first (unbounded queues), then receives
                    if p != rank:
                        mesh.used.add((rank, p))
                        if (rank, p) not in mesh.hijacked:
                            mesh.links[(rank, p)].put(rows_in[p].clone())
                for p in range(mesh.size):
                    if p != rank:
                        hijacked = (p, rank) in mesh.hijacked
                        rows_out[p] = (torch.frombuffer(bytearray(os.urandom(rows_out[p].numel())), dtype=torch.uint8)
                                       if hijacked else mesh.links[(p, rank)].get(timeout=10))
                return _Done()

        return Group()


def prove_on(mesh, secrets):
    results = [None] * mesh.size

    def run(rank):
        results[rank] = prove_pairs(mesh.group(rank), rank, mesh.size, secrets[rank], CONTEXT, lambda work: work.wait())

    threads = [threading.Thread(target=run, args=(r,)) for r in range(mesh.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_every_directed_pair_carries_a_proof_and_a_stranger_on_one_pair_is_caught_at_both_ends():
    mesh = Mesh(4, hijacked={(0, 2), (2, 0)})
    assert prove_on(mesh, [SECRET] * 4) == [[2], [], [0], []]
    assert mesh.used == {(a, b) for a in range(4) for b in range(4) if a != b}


def test_a_rank_without_the_secret_is_named_by_every_other_and_names_them_all():
    assert prove_on(Mesh(4), [SECRET, SECRET, WRONG, SECRET]) == [[2], [2], [0, 1, 3], [2]]
    assert prove_on(Mesh(3), [SECRET] * 3) == [[], [], []]


def _channels(size, secrets, **kw):
    """``size`` channels on threads over one TCPStore; returns (channels or errors, store)."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    stores = [server] + [dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=30))
                         for _ in range(size - 1)]
    out = [None] * size

    def build(rank):
        try:
            out[rank] = PipelineChannel(stores[rank], rank, size, address="127.0.0.1", secret=secrets[rank],
                                        timeout=30.0, **kw)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            out[rank] = exc

    threads = [threading.Thread(target=build, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "channels still building after 60 s"
    return out, server


def test_four_real_ranks_prove_every_pair_and_refuse_one_without_the_secret():
    built, _ = _channels(4, [SECRET, SECRET, WRONG, SECRET])
    for rank, got in enumerate(built):
        assert isinstance(got, ForeignPeerError), (rank, got)
        expected = "0, 1, 3" if rank == 2 else "2"
        assert re.search(rf"connection\(s\) to rank\(s\) \[{expected}\] did not prove this job's secret", str(got)), got


# --------------------------------------------------------------------------- the device group
class StrangerFactory:
    """Each rank's device group leads to a stranger: the group it makes is on a store prefix of
    its own, where a thread without the secret takes the other place and runs the proof (what a
    rank gets when an outsider has set the group's rendezvous key before it reads it)."""

    def __init__(self, base_store):
        self.base, self.inner, self.strangers = base_store, NcclLikeFactory(), []

    def _client(self):  # a connection each: one client serializes its waits for keys
        return dist.TCPStore("127.0.0.1", self.base.port, None, False, timeout=datetime.timedelta(seconds=30))

    def __call__(self, store, rank, size, timeout):
        prefix = f"stranger-of-{rank}"
        other = 1 - rank

        def stranger():
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            opts._timeout = datetime.timedelta(seconds=20)
            group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, self._client()), other, size, opts)
            prove_pairs(group, other, size, WRONG, (b"psgd-hello", b"psgd.channel", b"device"), lambda w: w.wait())

        thread = threading.Thread(target=stranger, daemon=True)
        thread.start()
        self.strangers.append(thread)
        return self.inner(dist.PrefixStore(prefix, self._client()), rank, size, timeout)


def test_a_device_group_that_leads_to_a_stranger_is_refused_and_aborted():
    base = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    factory = StrangerFactory(base)
    ops = TorchOps(cuda=FakeCuda(default=1))  # every tensor counts as a device tensor: the device group
    built, _ = _channels(2, [SECRET, SECRET], ops=ops, device_group=factory)
    errors = [None, None]

    def first_device_collective(rank):
        try:
            built[rank].alltoall_async(torch.full((2, 8), float(rank)), "a2a.0").wait()
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors[rank] = exc

    threads = [threading.Thread(target=first_device_collective, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for rank, exc in enumerate(errors):
        assert isinstance(exc, ForeignPeerError), (rank, exc)
        assert re.search(rf"connection\(s\) to rank\(s\) \[{1 - rank}\] did not prove this job's secret: they do not "
                         r"lead to a rank of this job \(device group", str(exc)), exc
        with pytest.raises(ForeignPeerError):  # the same error at every later device collective, no new group
            built[rank].allreduce_async_(torch.ones(4), "sum")
    groups = [g for _, _, g in factory.inner.made]
    assert len(groups) == 2 and all(g.aborts == 1 for g in groups)
    for t in factory.strangers:
        t.join(10)


def test_a_device_group_of_the_job_is_proved_and_used():
    ops, factory = TorchOps(cuda=FakeCuda(default=1)), NcclLikeFactory()
    built, _ = _channels(2, [SECRET, SECRET], ops=ops, device_group=factory)
    results = [None, None]

    def run(rank):
        results[rank] = built[rank].alltoall_async(torch.full((2, 8), float(rank)), "a2a.0").wait()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(torch.equal(results[r], torch.tensor([[0.0] * 8, [1.0] * 8])) for r in range(2)), results
    # the proof's two exchanges, then the collective, on the one device group of each rank
    assert [len(g.works) for _, _, g in factory.made] == [3, 3]
    assert not isinstance(results[0], PeerLostError)
