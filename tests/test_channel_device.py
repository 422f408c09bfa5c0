"""The pipeline channel's device (NCCL) branch, driven on a CPU (issue 34).

The tensor-op table decides the branch: its fake CUDA table (tests/fake_cuda.py) reports every
tensor on cuda:1 except the engine's membership flags, which stay host tensors as on a GPU. The
device group is a Gloo group with NCCL's work semantics (tests/fake_nccl.py): ``wait()`` neither
blocks nor raises for a transfer in flight. Ranks are threads, each with its own channel on one
TCPStore over loopback, wrapped as the process's shared communicator (comm/ordered.py), so every
collective is issued by the channel's one issue thread.

What only a GPU can show (NCCL's kernels, streams, its watchdog) is tools/gpu_check_channel.py.
"""
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from fake_cuda import FakeCuda
from fake_nccl import NcclLikeFactory
from pipesgd_hvd.comm.base import PeerLostError, ReduceOp
from pipesgd_hvd.comm.ordered import OrderedCommunicator
from pipesgd_hvd.comm.pipeline_channel import PipelineChannel
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.ops.torch import TorchOps
from pipesgd_hvd.pipeline.config import PipelineConfig
from pipesgd_hvd.pipeline.engine import PipelineEngine
from pipesgd_hvd.pipeline.fusion import TensorSpec
from pipesgd_hvd.testing import LocalWorld
from threads import run_threads

CODECS = ["none", "fp16", "bf16", "truncate16", "int8", "int4"]


SECRET = b"0123456789abcdef-the-jobs-secret"  # what rank 0 makes and Horovod's broadcast carries


def device_ops(size):
    """A table whose tensors are all on (fake) cuda:1, but for the membership flags (a float32
    vector of one value per rank): no test tensor here has that shape."""
    return TorchOps(cuda=FakeCuda(default=1, host=lambda x: x.dim() == 1 and x.numel() == size
                                  and x.dtype == torch.float32))


def run_ranks(size, fn, *, ops, factory, channel_timeout=30.0, timeout=90):
    """``fn(rank, comm)`` on ``size`` threads, each with its channel (on ``factory``'s device
    group) behind an OrderedCommunicator; returns (results, errors, comms)."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    stores = [server] + [dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=30))
                         for _ in range(size - 1)]
    results, errors, comms = [None] * size, [], [None] * size

    def target(rank):
        try:
            channel = PipelineChannel(stores[rank], rank, size, address="127.0.0.1", secret=SECRET,
                                      timeout=channel_timeout, ops=ops, device_group=factory)
            comms[rank] = OrderedCommunicator(channel, ops)
            results[rank] = fn(rank, comms[rank])
        except BaseException as exc:  # noqa: BLE001 - handed to the test below
            errors.append((rank, exc))

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"ranks still running after {timeout} s"
    return results, errors, comms


def data(rank, shape, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(10 + rank)).to(dtype)


def test_collectives_take_the_device_group_once_made_on_the_issue_thread():
    ops, factory = device_ops(2), NcclLikeFactory()

    def body(rank, comm):
        x = data(rank, (2, 1001))
        payload = (data(rank, (2, 37)) * 40).to(torch.uint8)  # a byte codec's rows
        flags = torch.tensor([1.0, float(rank)])               # host: the Gloo group
        return (x, payload, comm.alltoall_async(x, "a2a").wait(), comm.alltoall_async(payload, "a2a.u8").wait(),
                comm.allgather_async(payload[:1], "ag").wait(), comm.allreduce_async_(x.clone(), "sum").wait(),
                comm.allreduce_async_(x.clone(), "avg", ReduceOp.AVERAGE, 0.5, 4.0).wait(),
                comm.allreduce_async_(flags, "flags").wait(), comm.issue_thread.ident)

    results, errors, _ = run_ranks(2, body, ops=ops, factory=factory)
    assert not errors, errors
    xs, payloads = [r[0] for r in results], [r[1] for r in results]
    for rank, (_, _, a2a, a2a_u8, ag, summed, averaged, flags, issuer) in enumerate(results):
        assert torch.equal(a2a, torch.stack([xs[src][rank] for src in range(2)]))
        assert torch.equal(a2a_u8, torch.stack([payloads[src][rank] for src in range(2)]))
        assert torch.equal(ag, torch.cat([payloads[src][:1] for src in range(2)]))
        assert torch.equal(summed, xs[0] + xs[1])
        assert torch.equal(averaged, (xs[0] * 0.5 + xs[1] * 0.5) * (4.0 / 2))
        assert flags.tolist() == [2.0, 1.0]
        made = [(thread, group) for r, thread, group in factory.made if r == rank]
        assert len(made) == 1, made                 # once per channel
        assert made[0][0] == issuer                 # by the thread that issues its collectives


def test_a_silent_peer_gives_peer_lost_error_within_the_timeout_on_every_survivor():
    """Three ranks; after a first exchange rank 2 stops issuing. NCCL's wait() returns at once,
    so the survivors must poll the work's status, give up at PIPESGD_TIMEOUT (1.5 s here) and
    abort their device group (before the watchdog's own, later timeout)."""
    ops, factory = device_ops(3), NcclLikeFactory()

    def body(rank, comm):
        x = torch.full((3, 64), float(rank))
        comm.alltoall_async(x, "a2a.0").wait()
        if rank == 2:
            time.sleep(5.0)  # alive, silent
            return None
        started = time.monotonic()
        with pytest.raises(PeerLostError, match="alltoall 'a2a.1' on the pipeline channel did not complete within "
                                               "1.5 s .PIPESGD_TIMEOUT."):
            comm.alltoall_async(x, "a2a.1").wait()
        return time.monotonic() - started

    results, errors, _ = run_ranks(3, body, ops=ops, factory=factory, channel_timeout=1.5)
    assert not errors, errors
    for rank in (0, 1):
        assert 1.4 <= results[rank] <= 4.0, results
        group = [g for r, _, g in factory.made if r == rank][0]
        assert group.aborts == 1  # once, however many waits fail afterwards


def test_a_peer_that_has_not_joined_the_device_group_gives_peer_lost_error_within_the_timeout():
    """NCCL makes its communicator at the first device collective and blocks there, without a
    timeout, until every rank has joined (the stand-in blocks too: Gloo's own bound is 11.5 s
    here). Rank 1 comes 3 s late; rank 0 must give up at PIPESGD_TIMEOUT (1.5 s)."""
    ops, factory = device_ops(2), NcclLikeFactory(margin=10.0)

    def body(rank, comm):
        x = torch.full((2, 64), float(rank))
        if rank == 1:
            time.sleep(3.0)
            with pytest.raises(PeerLostError):  # rank 0 has given up on this collective
                comm.alltoall_async(x, "a2a.0").wait()
            return None
        started = time.monotonic()
        with pytest.raises(PeerLostError, match="alltoall 'a2a.0' .with the secret check of its new device group. on "
                                               "the pipeline channel did not complete within 1.5 s .PIPESGD_TIMEOUT."):
            comm.alltoall_async(x, "a2a.0").wait()
        return time.monotonic() - started

    results, errors, _ = run_ranks(2, body, ops=ops, factory=factory, channel_timeout=1.5)
    assert not errors, errors
    assert 1.4 <= results[0] <= 2.9, results


def test_an_nccl_error_is_peer_lost_error_at_once_and_aborts_the_group():
    """A peer's process dies mid-collective: NCCL records an error on the survivor's work (here
    injected while the survivor waits), which must be raised as PeerLostError long before the
    timeout, naming what happened, with the group aborted."""
    ops, factory = device_ops(2), NcclLikeFactory()

    def body(rank, comm):
        x = torch.full((2, 64), float(rank))
        comm.alltoall_async(x, "a2a.0").wait()
        if rank == 1:
            time.sleep(0.5)
            [g for r, _, g in factory.made if r == 0][0].inject_error("remote process exited or there was a network error")
            return None
        started = time.monotonic()
        with pytest.raises(PeerLostError, match="alltoall 'a2a.1' failed on the pipeline channel .*remote process "
                                               "exited.*TORCH_NCCL_ASYNC_ERROR_HANDLING"):
            comm.alltoall_async(x, "a2a.1").wait()
        return time.monotonic() - started

    results, errors, _ = run_ranks(2, body, ops=ops, factory=factory, channel_timeout=5.0)
    assert not errors, errors
    assert 0.4 <= results[0] < 3.0, results
    assert [g for r, _, g in factory.made if r == 0][0].aborts == 1


def test_close_aborts_the_device_group_and_refuses_collectives():
    ops, factory = device_ops(2), NcclLikeFactory()

    def body(rank, comm):
        comm.allgather_async(torch.ones(1, 8), "ag").wait()  # makes the device group
        comm.close()
        comm.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            comm.alltoall_async(torch.zeros(2, 2), "a2a")
        with pytest.raises(RuntimeError, match="closed"):
            comm.inner.alltoall_async(torch.zeros(2, 2), "a2a")
        return True

    results, errors, _ = run_ranks(2, body, ops=ops, factory=factory)
    assert not errors and results == [True, True], errors
    assert sorted(g.aborts for _, _, g in factory.made) == [1, 1]


def test_wrong_shapes_are_refused_before_anything_is_issued():
    ops, factory = device_ops(2), NcclLikeFactory()

    def body(rank, comm):
        with pytest.raises(ValueError, match="one row per rank"):
            comm.inner.alltoall_async(torch.zeros(3, 4), "a2a")
        return True

    results, errors, _ = run_ranks(2, body, ops=ops, factory=factory)
    assert not errors and results == [True, True], errors
    assert factory.made == []


# ------------------------------------------------------------------------------ the engine
SPECS = [TensorSpec("a", (7,), "float32", "cuda:1"), TensorSpec("b", (513,), "float32", "cuda:1"),
         TensorSpec("c", (3, 11), "float32", "cuda:1"), TensorSpec("d", (1,), "float32", "cuda:1")]
STEPS = 5


def gradient(rank, step, spec):
    g = torch.randn(spec.shape, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + len(spec.name)))
    if step == 2 and rank == 1 and spec.name == "b":
        g[5], g[300] = float("inf"), float("nan")  # non-finite on one rank: every rank decodes the same bits
    return g


def train(comm, ops, codec, width):
    engine = PipelineEngine(SPECS, ops=ops, comm=comm, codec=resolve_compression(codec),
                            config=PipelineConfig(width=width, name=f"dev.{codec}.{width}", fusion_threshold_bytes=2048))
    applied = []
    for step in range(STEPS):
        engine.begin_step(range(len(SPECS)))
        for i in reversed(range(len(SPECS))):
            engine.add_gradient_(i, gradient(comm.rank, step, SPECS[i]))
        applied += engine.end_step()
    applied += engine.flush()
    engine.close()
    return [(a.step, i, a.grads[i].reshape(-1).clone().view(torch.int32)) for a in applied for i in sorted(a.grads)]


@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("codec", CODECS)
def test_the_engine_over_the_device_branch_gives_the_local_worlds_bits(codec, width):
    """Odd bucket sizes (1 to 513 values, several buckets), inf and nan on one rank: every rank
    gets bitwise what the in-process world gives (same tensor ops, another transport)."""
    ops, factory = device_ops(2), NcclLikeFactory()
    results, errors, comms = run_ranks(2, lambda rank, comm: train(comm, ops, codec, width), ops=ops, factory=factory)
    assert not errors, errors
    expected = run_threads(LocalWorld(2, ops), lambda rank, comm: train(comm, ops, codec, width))
    for rank in (0, 1):
        assert [(s, i) for s, i, _ in results[rank]] == [(s, i) for s, i, _ in expected[rank]]
        for (step, i, got), (_, _, want) in zip(results[rank], expected[rank]):
            assert torch.equal(got, want), (rank, step, SPECS[i].name)
        assert len([m for m in factory.made if m[0] == rank]) == 1
    for comm in comms:
        comm.close()
