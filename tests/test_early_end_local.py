"""Issue 32 on in-process ranks (LocalWorld, with its status board in memory): the membership
flags ride with a bucket (no collective of their own), flush() then join() works, join() works
with the replica check and the auto mode, a stall is reported within the threshold naming the
missing rank, and a rank that can never come (exiting, in Horovod's own join) ends the others'
waits in seconds with its name. The multi-process versions: tests/test_early_end.py."""
import importlib.util
import logging
import threading
import time

import numpy as np
import pytest
import torch

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.comm.base import PeerLostError
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.compression.allreduce import side_region
from pipesgd_hvd.ops.numpy import NUMPY_OPS
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.pipeline.config import PipelineConfig
from pipesgd_hvd.pipeline.engine import PipelineEngine
from pipesgd_hvd.pipeline.fusion import TensorSpec
from pipesgd_hvd.testing import LocalWorld
from reference import loss_fn, make_batches, make_model
from threads import run_threads

SPECS = [TensorSpec("a", (700,), "float32"), TensorSpec("b", (300,), "float32")]


# ------------------------------------------------------------------------- membership flags
@pytest.mark.parametrize("codec", ["none", "int8", "fp16"])
def test_membership_rides_with_the_last_bucket_and_survives_its_codec(codec):
    """Which ranks train is read from the step's last bucket: no collective of its own (the code
    before issued one more all-reduce per step), exact under int8 beside an inf gradient (its
    block of its own), and no error-feedback residue where the flags sit."""
    steps, joined_from = 4, 2

    def fn(rank, comm):
        engine = PipelineEngine(SPECS, ops=NUMPY_OPS, comm=comm, codec=resolve_compression(codec),
                                config=PipelineConfig(width=2, fusion_threshold_bytes=2000, name="m"))
        training = []
        for t in range(steps):
            joined = rank == 1 and t >= joined_from
            engine.begin_step([0, 1], joined=joined)
            if not joined:
                for i in (1, 0):
                    g = np.full(SPECS[i].shape, 1e3 * (rank + 1), np.float32)
                    if t == 1 and rank == 0 and i == 0:
                        g[5] = np.inf  # in the last bucket (ready last), beside the flags
                    engine.add_gradient_(i, g)
            training += [a.training() for a in engine.end_step()]
        training += [a.training() for a in engine.flush(check_steps=False)]
        layout = engine.layout_for([0, 1])
        residual = None
        if codec == "int8":
            residual = engine.codec.residual(f"{layout.key}.b{len(layout.buckets) - 1}/send")
        engine.close()
        return training, layout, engine._flag_at[layout.key], residual

    world = LocalWorld(2, NUMPY_OPS)
    results = run_threads(world, fn)
    for training, layout, (at, length), residual in results:
        assert training == [[True, True]] * joined_from + [[True, False]] * (steps - joined_from)
        if residual is not None:
            assert np.all(residual.reshape(-1)[at:at + 2] == 0)
    buckets = len(results[0][1].buckets)
    per_bucket = 1 if codec == "none" else 2  # all-reduce, or alltoall + allgather
    key = results[0][1].key  # the tensor collectives (not the construction's object checks)
    started = [name for rank, what, name in world.events if rank == 0 and what == "start" and key in name]
    assert len(started) == steps * buckets * per_bucket, started


@pytest.mark.parametrize("codec", ["none", "int8", "int4", "fp16", "truncate16"])
@pytest.mark.parametrize("numel, size", [(1, 2), (511, 2), (512, 2), (1000, 2), (5000, 3), (10, 8), (700, 600)])
def test_side_region_is_a_block_of_its_own(codec, numel, size):
    c = resolve_compression(codec)
    at, length = side_region(c, numel, size, size)
    assert numel <= at and at + size <= length
    if c.summable:
        assert (at, length) == (numel, numel + size)
        return
    cols = length // size
    assert length == size * cols and c.padded_cols(cols) == cols  # whole rows the all-reduce keeps
    width = c.block_width(cols)
    assert (at % cols) % width == 0 and at % cols + size <= cols  # starts a block, within one row
    assert at // cols == (at + size - 1) // cols


# ----------------------------------------------------------------------- the torch optimizer
def _uneven(rank, comm, steps, finish, **kw):
    model = make_model()
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    named_parameters=model.named_parameters(), communicator=comm, **kw)
    batches = make_batches(12, 2)
    for t in range(steps):
        opt.zero_grad()
        loss_fn(model, batches[t][rank]).backward()
        opt.step()
    return finish(model, opt)


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_flush_then_join_works_on_the_rank_that_ran_out(codec):
    """README: flush() at the end; migrating.md: join() for uneven data. Both, in that order, on
    the rank with fewer batches (the code before: its flush() waited in a step check the
    training rank never reached, until the timeout)."""
    def finish(model, opt):
        opt.flush()
        return opt.join(), [p.detach().clone() for p in model.parameters()]

    world = LocalWorld(2, TORCH_OPS, timeout=20)
    started = time.monotonic()
    results = run_threads(world, lambda rank, comm: _uneven(rank, comm, 6 if rank == 0 else 12, finish,
                                                            compression=codec), timeout=60)
    assert [last for last, _ in results] == [1, 1]
    assert time.monotonic() - started < 15


@pytest.mark.parametrize("kw", [{"check_replicas_every": 2}, {"width": "auto", "auto_measure_steps": 3,
                                                              "auto_recheck_every": 4}])
def test_join_takes_part_in_replica_checks_and_auto_checks(kw):
    """The code before refused both ("their checks are collectives that a joined rank does not
    take part in"); a check at steps 8 and 10 (every 2), and auto checks at 7 and 11, fall inside
    rank 0's join."""
    def finish(model, opt):
        last = opt.join()
        core = opt._core
        checks = core.engine._replicas_agreed_at if "check_replicas_every" in kw else \
            [r.step for r in core.auto_controller.history]
        return last, checks

    results = run_threads(LocalWorld(2, TORCH_OPS, timeout=20),
                          lambda rank, comm: _uneven(rank, comm, 6 if rank == 0 else 12, finish, **kw), timeout=60)
    assert [last for last, _ in results] == [1, 1]
    if "check_replicas_every" in kw:
        assert [checks for _, checks in results] == [12, 12]  # rank 0 took part in 8, 10, 12
    else:
        assert results[0][1] == results[1][1] and max(results[0][1]) >= 7, results


# ----------------------------------------------------------------------------- the inspector
def test_a_stall_is_reported_within_the_threshold_naming_the_missing_rank(monkeypatch, caplog):
    monkeypatch.setenv("PIPESGD_STALL_CHECK_TIME_SECONDS", "1")
    caplog.set_level(logging.WARNING, logger="pipesgd_hvd.stall")
    slept = {}

    def fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                        named_parameters=model.named_parameters(), communicator=comm,
                                        compression="int8")
        batches = make_batches(6, 2)
        for t in range(6):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
            if rank == 1 and t == 2:
                slept["at"] = time.monotonic()
                time.sleep(3.0)  # SLEEPS HERE
        opt.flush()

    run_threads(LocalWorld(2, TORCH_OPS, timeout=20), fn, timeout=60)
    warnings = [r for r in caplog.records if "pipesgd_hvd stall: rank 0 has waited" in r.getMessage()]
    assert warnings, [r.getMessage() for r in caplog.records]
    message = warnings[0].getMessage()
    assert "for the reduction of step 3" in message and "rank 1 (outside the pipeline for" in message, message
    assert "test_early_end_local.py" in message and "Likely causes" in message, message
    assert warnings[0].created - time.time() + time.monotonic() - slept["at"] < 2.5  # 1 s threshold, 0.5 s ticks


def _waiting_rank_raises(rank1_leaves, match):
    """Rank 1 stops after 2 steps (``rank1_leaves``); rank 0's third step must end within
    seconds with ``match``, not at the world's 30 s timeout."""
    outcome = {}

    def fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                        named_parameters=model.named_parameters(), communicator=comm)
        batches = make_batches(4, 2)
        steps = 4 if rank == 0 else 2
        started = time.monotonic()
        try:
            for t in range(steps):
                opt.zero_grad()
                loss_fn(model, batches[t][rank]).backward()
                started = time.monotonic()
                opt.step()
        except PeerLostError as exc:
            outcome["raised"] = (time.monotonic() - started, str(exc))
            return None
        if rank == 1:
            return rank1_leaves(opt)

    results = run_threads(LocalWorld(2, TORCH_OPS, timeout=30), fn, timeout=60)
    seconds, message = outcome["raised"]
    assert seconds < 8 and match in message, (seconds, message)
    return results


def test_a_rank_that_exits_without_join_is_named_and_says_so_itself():
    def leave(opt):
        return opt._core.inspector.check_at_exit(opt._core.engine.step, grace=10)

    results = _waiting_rank_raises(leave, "rank 1 is exiting after 2 step(s) while this rank waits for its share")
    assert "this rank exits after 2 step(s) while rank(s) [0] still need its share" in results[1], results[1]


def test_a_closed_connection_is_explained_by_the_board_when_the_peer_said_why():
    """A rank that leaves tells the board, then its process ends and its connections close; the
    closed connection can reach the waiting rank before the monitor's next look at the board. The
    error must still name the rank and why it left (CI saw the transport's bare error once)."""
    from pipesgd_hvd.testing.board import MemoryBoard
    from pipesgd_hvd.pipeline.stall import StallInspector, StallSettings

    shared, lock = {}, threading.Lock()
    boards = [MemoryBoard(shared, lock, r, 2, "job") for r in range(2)]
    boards[1].publish(entry(phase="exit", begun=2, ended=2))
    settings = StallSettings(period_s=3600.0, check_s=0.0, shutdown_s=0.0)  # the monitor never looks
    inspector = StallInspector(0, 2, boards[0], "job", settings=settings)

    class Closed:
        future = None

        def done(self):
            return True

        def wait(self):
            raise PeerLostError("alltoall failed: connection closed by peer")

    try:
        with pytest.raises(PeerLostError, match=r"rank 1 is exiting after 2 step\(s\)") as raised:
            inspector.wait(Closed(), step=2, bucket=0, what="the reduction")
        assert "connection closed by peer" in str(raised.value.__cause__)
    finally:
        inspector.close()


def test_a_rank_inside_horovods_own_join_is_named(tmp_path):
    """Horovod's join blocks in C with the GIL released; a function named join in a horovod
    directory, blocked on an event, stands in for it."""
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "mpi_ops.py").write_text("def join(event):\n    event.wait(30)\n")
    spec = importlib.util.spec_from_file_location("fake_horovod_ops", tmp_path / "horovod" / "mpi_ops.py")
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    released = threading.Event()

    def horovod_join(opt):
        timer = threading.Timer(12, released.set)
        timer.start()
        fake.join(released)
        timer.cancel()

    try:
        _waiting_rank_raises(horovod_join, "rank 1 is inside Horovod's own hvd.join()")
    finally:
        released.set()


# ------------------------------------------------------------------ the rules on board entries
def entry(**kw):
    base = {"phase": "train", "begun": 6, "ended": 6, "wait": None, "flushes": [], "in_horovod": False,
            "hvd_join": False, "for_s": 0.0, "where": "train.py:9 in main", "answers": 1, "error": None,
            "joined_at": None, "knows": []}
    return {**base, **kw}


@pytest.mark.parametrize("other, outcome", [
    (entry(phase="flush", flushes=[[1, 6]]), "agreed"),                          # both flush at step 6
    (entry(phase="flush", flushes=[[1, 6], [2, 6]]), "agreed"),                  # agreed, and in its next flush()
    (entry(phase="join", joined_at=3), "agreed"),                                # it serves whatever steps run
    (entry(begun=8, ended=7, wait=[6, 0, "the reduction", 1.0]), "behind"),      # blocked on our step 6
    (entry(begun=8, ended=8, in_horovod=True, for_s=1.5), "behind"),             # its metric waits for our join
    (entry(begun=8, ended=8, in_horovod=True, for_s=0.2), None),                 # a metric that may just finish
    (entry(begun=7, ended=6, wait=[5, 0, "the reduction", 0.1]), None),          # still training toward its flush
    (entry(begun=6, ended=6), None),                                             # between steps: ask again
    (None, None),
])
def test_flush_decides_from_the_entries(other, outcome):
    from pipesgd_hvd.pipeline import rank_status
    assert rank_status.flush_outcome([None, other], 0, 1, 6, PeerLostError) == outcome


def test_flush_at_different_counts_and_a_failed_rank_raise():
    from pipesgd_hvd.pipeline import rank_status
    from pipesgd_hvd.pipeline.guards import StepCountMismatchError
    with pytest.raises(StepCountMismatchError, match=r"rank 0: 6, rank 1: 9"):
        rank_status.flush_outcome([None, entry(phase="flush", flushes=[[1, 9]])], 0, 1, 6, PeerLostError)
    with pytest.raises(PeerLostError, match="rank 1 stopped at an error while this rank was in flush"):
        rank_status.flush_outcome([None, entry(phase="failed", error="boom")], 0, 1, 6, PeerLostError)
    # a rank that failed after agreeing (it saw the same mismatch first) still counts with its step
    with pytest.raises(StepCountMismatchError):
        rank_status.flush_outcome([None, entry(phase="failed", flushes=[[1, 9]])], 0, 1, 6, PeerLostError)


def test_who_can_never_come_and_who_needs_an_exiting_rank():
    from pipesgd_hvd.pipeline import rank_status
    assert rank_status.gone([None, entry(phase="exit")], 0, 6)[0] == 1
    assert rank_status.gone([None, entry(phase="exit", ended=7)], 0, 6) is None   # it gave its share of step 6
    assert "Horovod's own hvd.join()" in rank_status.gone([None, entry(hvd_join=True)], 0, 6)[1]
    assert rank_status.gone([None, entry(hvd_join=True, phase="join")], 0, 6) is None
    assert rank_status.needing([None, entry(begun=7, ended=6)], 0, 6) == [1]
    assert rank_status.needing([None, entry(begun=6)], 0, 6) == []
    assert rank_status.undecided([None, entry(begun=6)], 0, 6)
