"""PipelineChannel in one process: 2 ranks as threads on one TCPStore over loopback (no Horovod),
against plain torch references; and how the channel picks its address.

The multi-process tests (tests/test_pipeline_channel.py) compare it with Horovod's ops and kill
peers; these are the quick tier.
"""
import datetime
import re
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from pipesgd_hvd.comm import addresses
from pipesgd_hvd.comm.base import PeerLostError, ReduceOp
from pipesgd_hvd.comm.pipeline_channel import ForeignPeerError, PipelineChannel

SIZE = 2
SECRET = b"0123456789abcdef-the-jobs-secret"  # what rank 0 makes and Horovod's broadcast carries


def run_pair(fn, timeout=60, channel_timeout=30.0, secrets=(SECRET, SECRET)):
    """``fn(rank, channel)`` on 2 threads, each with its own channel (built with ``secrets[rank]``);
    returns the results and the errors."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    stores = [server, dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=30))]
    results, errors = [None] * SIZE, []

    def target(rank):
        try:
            channel = PipelineChannel(stores[rank], rank, SIZE, address="127.0.0.1", secret=secrets[rank],
                                      timeout=channel_timeout)
            results[rank] = fn(rank, channel)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread below
            errors.append((rank, exc))

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(SIZE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"ranks still running after {timeout} s")
    return results, errors


def data(rank, shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(shape, generator=g).to(dtype)


def test_collectives_match_plain_references():
    def body(rank, ch):
        x = data(rank, (SIZE, 1001))
        a2a = ch.alltoall_async(x, "a2a").wait()
        ag = ch.allgather_async(x[:1], "ag").wait()
        summed = ch.allreduce_async_(x.clone(), "sum").wait()
        averaged = ch.allreduce_async_(x.clone(), "avg", ReduceOp.AVERAGE, 0.5, 4.0).wait()
        objs = ch.allgather_object({"r": rank, "blob": "x" * (rank * 1000)}, "obj")
        return x, a2a, ag, summed, averaged, objs

    results, errors = run_pair(body)
    assert not errors, errors
    inputs = [r[0] for r in results]
    for rank, (x, a2a, ag, summed, averaged, objs) in enumerate(results):
        assert torch.equal(a2a, torch.stack([inputs[src][rank] for src in range(SIZE)]))
        assert torch.equal(ag, torch.stack([inputs[src][0] for src in range(SIZE)]))
        assert torch.equal(summed, inputs[0] + inputs[1])
        # Horovod's AVERAGE: sum of prescaled values, times postscale / size (exact in binary here).
        assert torch.equal(averaged, (inputs[0] * 0.5 + inputs[1] * 0.5) * (4.0 / SIZE))
        assert objs == [{"r": r, "blob": "x" * (r * 1000)} for r in range(SIZE)]


def test_a_peer_without_the_jobs_secret_is_refused():
    """Someone in a rank's place at the rendezvous (here: a "rank" that knows the store but not the
    secret) is refused on every side before any byte it sends is used (issue 32)."""
    results, errors = run_pair(lambda rank, ch: True, secrets=(SECRET, b"not-the-jobs-secret-but-as-long"))
    assert sorted(rank for rank, _ in errors) == [0, 1], errors
    for rank, exc in errors:
        assert isinstance(exc, ForeignPeerError), exc
        assert re.search(rf"connection\(s\) to rank\(s\) \[{1 - rank}\] did not prove this job's secret: they do not "
                         r"lead to a rank of this job", str(exc)), exc


def test_objects_are_gathered_in_the_typed_encoding_with_their_senders_mac():
    def body(rank, ch):
        with pytest.raises(TypeError, match="cannot send a builtins.set between ranks"):
            ch.allgather_object({1, 2}, "bad")  # refused before anything is sent
        return ch.allgather_object({"step": rank, "w": torch.arange(3.0) + rank}, "ok")

    results, errors = run_pair(body)
    assert not errors, errors
    for got in results:
        assert [g["step"] for g in got] == [0, 1] and torch.equal(got[1]["w"], torch.arange(3.0) + 1)


def test_handles_report_done_and_results_stay_valid():
    def body(rank, ch):
        handles = [ch.alltoall_async(torch.full((SIZE, 4), 10 * rank + i, dtype=torch.uint8), f"a2a.{i}")
                   for i in range(5)]  # several in flight at once, matched by issue order
        outs = [h.wait() for h in handles]
        return [o[:, 0].tolist() for o in outs], all(h.done() for h in handles)

    results, errors = run_pair(body)
    assert not errors, errors
    for rank, (firsts, done) in enumerate(results):
        assert done and firsts == [[i, 10 + i] for i in range(5)]


def test_a_silent_peer_gives_peer_lost_error_at_the_timeout():
    timeout = 1.5
    gave_up = threading.Event()

    def body(rank, ch):
        if rank == 1:
            # never issues the collective, and keeps its channel open until rank 0 has given up
            gave_up.wait(10 * timeout)
            return None
        started = time.monotonic()
        try:
            with pytest.raises(PeerLostError, match="pipeline channel.*PIPESGD_TIMEOUT"):
                ch.alltoall_async(torch.zeros(SIZE, 8), "a2a").wait()
        finally:
            gave_up.set()
        return time.monotonic() - started

    results, errors = run_pair(body, channel_timeout=timeout)
    assert not errors, errors
    # at the timeout: not before it (clock slack), nor long after (2 ranks' threads on 2 shared cores)
    assert 0.9 * timeout <= results[0] <= 2.5 * timeout, results[0]


def test_a_peer_that_closes_its_channel_ends_the_others_wait_at_once():
    """What a Horovod elastic reset relies on: closing drops the groups, whose sockets close."""
    timeout = 30.0
    posted = threading.Event()

    def body(rank, ch):
        if rank == 1:
            posted.wait(timeout)  # rank 0's collective is posted: it waits, or is about to
            ch.close()
            return None
        started = time.monotonic()
        with pytest.raises(PeerLostError, match="closed by peer|reset by peer"):
            handle = ch.alltoall_async(torch.zeros(SIZE, 8), "a2a")
            posted.set()
            handle.wait()
        return time.monotonic() - started

    results, errors = run_pair(body, channel_timeout=timeout)
    assert not errors, errors
    assert results[0] < timeout / 3, results[0]  # far below the timeout


# A third rank in its own process, so that it can die by SIGKILL as a lost worker does; it takes
# part in ROUNDS - 1 allgathers of one row each. Argument: the store's port, and the way it dies.
DYING_RANK = """
import datetime, os, signal, sys, time
import torch, torch.distributed as dist
from pipesgd_hvd.comm.pipeline_channel import ForeignPeerError, PipelineChannel
port, how = int(sys.argv[1]), sys.argv[2]
store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=30))
ch = PipelineChannel(store, 2, 3, address="127.0.0.1", secret=b"0123456789abcdef-the-jobs-secret", timeout=30.0)
x = torch.full((1, 64), 2.0)
for _ in range(2):
    ch.allgather_async(x, "ag").wait()
if how == "after-serving-rank-0":  # its last round's transfers with rank 0 only, as if rank 1's were still queued
    group, out = ch._tensors, torch.empty(1, 64)
    for work in [group.recv([out], 0, 0), group.send([x], 0, 0)]:
        work.wait()
time.sleep(0.3)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["before-its-last-round", "after-serving-rank-0"])
def test_a_killed_peer_ends_every_survivors_wait_within_seconds(how):
    """3 ranks, the third SIGKILLed mid-run (Horovod elastic's lost worker). Rank 1 meets the loss
    first, closes its channel and keeps the error, as an elastic reset does; rank 0 is then
    waiting for rank 1 and must fail when rank 1 closes, not at the 30 s timeout.
    before-its-last-round: rank 1 posts its last round after the death, and Gloo refuses the
    transfers to the dead rank; its sends to rank 0 must still go out (they did not: 30 s).
    after-serving-rank-0: rank 0 finishes the round rank 1 fails and waits on rank 1 in the next;
    rank 1's failed handle must not keep the connections open (it did: 30 s)."""
    import subprocess
    import sys

    from launcher import ROOT, rank_env

    timeout = 30.0  # the channels' and stores'
    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    dying = subprocess.Popen([sys.executable, "-c", DYING_RANK, str(server.port), how], cwd=ROOT, env=rank_env())
    stores = [server, dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=30))]
    outcome = {}

    def survivor(rank):
        channel = PipelineChannel(stores[rank], rank, 3, address="127.0.0.1", secret=SECRET, timeout=timeout)
        x = torch.full((1, 64), float(rank))
        for round_ in range(4):
            if rank == 1 and round_ == 2:
                dying.wait(timeout)  # rank 1 posts its third round once the dying rank is gone
            started = time.monotonic()
            try:
                channel.allgather_async(x, f"ag{round_}").wait()
            except PeerLostError as exc:
                channel.close()
                outcome[rank] = (round_, time.monotonic() - started, exc)  # the error stays referenced
                return
        outcome[rank] = (4, 0.0, None)

    threads = [threading.Thread(target=survivor, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert dying.wait(30) == -9
    assert not any(t.is_alive() for t in threads), "a survivor still waits after 60 s"
    assert sorted(outcome) == [0, 1] and all(o[2] is not None for o in outcome.values()), outcome
    assert outcome[1][0] == 2, outcome  # rank 1 meets the loss in its third round
    assert outcome[0][1] < timeout / 3, outcome  # rank 1's wait for the death and a close, far below the timeout


def test_closed_channel_refuses_collectives():
    def body(rank, ch):
        ch.close()
        ch.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            ch.alltoall_async(torch.zeros(SIZE, 2), "a2a")
        return True

    results, errors = run_pair(body)
    assert not errors and results == [True, True], errors


# ------------------------------------------------------------------------------ addresses
def test_address_order_interface_variables_first():
    assert addresses.channel_address(False, {"PIPESGD_CHANNEL_IFACE": "lo", "HOROVOD_GLOO_IFACE": "nope0"}) == "127.0.0.1"
    assert addresses.channel_address(False, {"HOROVOD_GLOO_IFACE": "lo"}) == "127.0.0.1"
    assert addresses.channel_address(True, {}) == "127.0.0.1"


def test_unknown_interface_names_the_variable_to_set():
    with pytest.raises(RuntimeError, match="'nope0' has no IPv4 address.*PIPESGD_CHANNEL_IFACE"):
        addresses.channel_address(False, {"PIPESGD_CHANNEL_IFACE": "nope0"})


def test_several_hosts_with_a_loopback_host_name_is_refused(monkeypatch):
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    with pytest.raises(RuntimeError, match="loopback address.*PIPESGD_CHANNEL_IFACE"):
        addresses.channel_address(False, {})
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "198.18.0.2")
    assert addresses.channel_address(False, {}) == "198.18.0.2"
