"""One pipeline communicator per process, shared by every optimizer, every tensor collective issued
by one thread in submission order (pipesgd_hvd/comm/ordered.py, issue 34).

The in-process world (LocalWorld) matches collectives by issue order and raises on a mismatch,
so two optimizers whose collectives reach a shared transport in a different order on different
ranks fail there; the skew below makes that order differ unless one thread issues them all.
"""
import datetime
import socket
import threading
import time

import torch
import torch.distributed as dist

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.comm.ordered import OrderedCommunicator, shared_communicator
from pipesgd_hvd.comm.torch_default import default_communicator
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.pipeline.config import PipelineConfig
from pipesgd_hvd.pipeline.engine import PipelineEngine
from pipesgd_hvd.pipeline.fusion import TensorSpec
from pipesgd_hvd.testing import LocalWorld
from reference import loss_fn, make_batches, make_model
from threads import run_threads


class SlowAlltoall:
    """What rank 1's engines see: each alltoall is handed on 50 ms late, as a loaded host's comm
    thread would hand it (the shared communicator's issue thread stays visible)."""

    def __init__(self, comm, delay):
        self._comm, self._delay = comm, delay
        self.rank, self.size = comm.rank, comm.size
        self.issue_thread = comm.issue_thread

    def allreduce_async_(self, *args, **kw):
        return self._comm.allreduce_async_(*args, **kw)

    def alltoall_async(self, x, name):
        time.sleep(self._delay)
        return self._comm.alltoall_async(x, name)

    def allgather_async(self, x, name):
        return self._comm.allgather_async(x, name)

    def allgather_object(self, obj, name):
        return self._comm.allgather_object(obj, name)


SPECS = [TensorSpec("w", (300,), "float32", "cpu"), TensorSpec("b", (40,), "float32", "cpu")]


def test_two_optimizers_on_the_shared_communicator_issue_in_one_order_from_one_thread():
    """Optimizer A (int8: its phases run as comm jobs) and B (none: its all-reduce is called on
    the training thread) share the communicator; rank 1's alltoalls are late. B's all-reduce must
    still follow A's alltoall on both ranks (it overtook it on rank 1: a mismatch)."""
    world = LocalWorld(2, TORCH_OPS, timeout=20.0)
    shared = {}

    def rank_fn(rank, comm):
        ordered = OrderedCommunicator(comm, TORCH_OPS)
        ordered.issued = []
        shared[rank] = ordered
        seen = SlowAlltoall(ordered, 0.05 if rank == 1 else 0.0)
        engines = [PipelineEngine(SPECS, ops=TORCH_OPS, comm=seen, codec=resolve_compression(codec),
                                  config=PipelineConfig(width=2, name=f"opt{k}"))
                   for k, codec in enumerate(["int8", "none"])]
        out = []
        for step in range(4):
            for k, engine in enumerate(engines):
                engine.begin_step([0, 1])
                engine.add_gradient_(0, torch.full((300,), float(step + rank + k)))
                engine.add_gradient_(1, torch.full((40,), 1.0 + k))
                out += [(k, a.step, a.grads[0].clone()) for a in engine.end_step()]
        for k, engine in enumerate(engines):
            out += [(k, a.step, a.grads[0].clone()) for a in engine.flush()]
            engine.close()
        ordered.close()
        return out

    results = run_threads(world, rank_fn, timeout=120)
    for rank in (0, 1):
        threads = {thread for thread, _ in shared[rank].issued}
        assert threads == {shared[rank].issue_thread.ident}, threads  # one thread issued every collective
    assert [n for _, n in shared[0].issued] == [n for _, n in shared[1].issued]
    for (k0, s0, g0), (k1, s1, g1) in zip(*results):
        assert (k0, s0) == (k1, s1) and torch.equal(g0, g1)
    assert len(results[0]) == 2 * 4


def test_the_shared_communicator_is_built_once_until_it_is_closed():
    built = []

    class Comm:
        rank, size = 0, 1

        def close(self):
            built.append("closed")

    def build():
        built.append("built")
        return Comm()

    first = shared_communicator(("test", 0, 1), build, TORCH_OPS)
    assert shared_communicator(("test", 0, 1), build, TORCH_OPS) is first and built == ["built"]
    first.close()
    second = shared_communicator(("test", 0, 1), build, TORCH_OPS)
    assert second is not first and built == ["built", "closed", "built"]
    second.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_optimizer_of_a_process_uses_the_one_communicator_and_exit_keeps_it_for_the_others():
    """torch.distributed, a world of one: two optimizers get the same communicator (one group
    set, one issue thread); the first one's exit handler leaves it open for the second's."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        comm, _ = default_communicator()
        assert default_communicator()[0] is comm
        models = [make_model(seed) for seed in (0, 1)]
        opts = [psgd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                          width=2, compression=codec) for m, codec in zip(models, ["int8", "none"])]
        assert opts[0].engine.comm is opts[1].engine.comm is comm
        batches = make_batches(3, 1)
        for t in range(3):
            for model, opt in zip(models, opts):
                opt.zero_grad()
                loss_fn(model, batches[t][0]).backward()
                opt.step()
        opts[0]._core.finish_at_exit()
        assert not comm.closed
        assert opts[1].flush() == 1  # its last step is still reduced through the shared communicator
        comm.close()
    finally:
        dist.destroy_process_group()


def test_node_groups_are_built_on_the_shared_channel(monkeypatch):
    """The hierarchical reduction's node groups (comm/topology.py) are sub-channels of the
    pipeline channel; the optimizer now holds the channel inside the shared communicator, and
    hierarchical=True must still find it (it raised 'not on OrderedCommunicator'). Every optimizer
    of the process builds its own groups on that one channel, under keys of its own (two ranks in
    one process did not hang under shared keys; tests/mp/hierarchical_cluster.py, across
    processes, did)."""
    from pipesgd_hvd.comm import topology
    from pipesgd_hvd.comm.pipeline_channel import PipelineChannel
    from pipesgd_hvd.comm.topology import NodeLayout, resolve_topology

    ranks = {}
    monkeypatch.setattr(topology, "_horovod_layout", lambda required: NodeLayout(ranks[threading.get_ident()], 2, 0, 1))
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    stores = [server, dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=30))]
    results, errors = [None, None], []

    def rank_fn(rank):
        ranks[threading.get_ident()] = rank
        comm = OrderedCommunicator(PipelineChannel(stores[rank], rank, 2, address="127.0.0.1", secret=b"0123456789abcdef-the-jobs-secret",
                                                   timeout=15.0), TORCH_OPS)
        try:
            first = resolve_topology(True, comm, name="t.topology")
            second = resolve_topology(True, comm, name="u.topology")  # a second optimizer's, the first still open
            results[rank] = [(type(groups.local).__name__, groups.local.size, groups.cross.size,
                              groups.local.allgather_async(torch.full((1, 3), float(rank + i)), f"t.ag{i}")
                              .wait()[:, 0].tolist()) for i, groups in enumerate((first, second))]
            first.close()
            second.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            comm.close()

    threads = [threading.Thread(target=rank_fn, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == [[("PipelineChannel", 2, 1, [0.0, 1.0]), ("PipelineChannel", 2, 1, [1.0, 2.0])]] * 2
