"""Horovod elastic for Keras 3 (``pipesgd_hvd.keras.elastic``): KerasState with the pipelined
optimizer, ``run``'s error mapping, the elastic callbacks, and a real elastic job.

The rule (``pipesgd_hvd/optimizer/elastic_rule.py``, as for PyTorch): a commit settles the pipeline, a lost
worker sends every survivor back to the last commit (its pending gradient included), and every
rank of a new world, joining ones too, continues from rank 0's state, traced anew.
"""
import json
import re
import stat
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt  # noqa: E402

import pipesgd_hvd.keras as hvd  # noqa: E402
from launcher import HOROVODRUN_CHECKED, TESTS, run_command  # noqa: E402
from pipesgd_hvd.comm.base import PeerLostError  # noqa: E402
from pipesgd_hvd.compression import resolve_compression  # noqa: E402
from pipesgd_hvd.keras.elastic import lost_world, raise_lost_world_as_internal_error  # noqa: E402
from pipesgd_hvd.ops.tensorflow import TensorFlowOps  # noqa: E402
from pipesgd_hvd.keras.traced_engine import TracedEngine  # noqa: E402
from pipesgd_hvd.pipeline.config import PipelineConfig  # noqa: E402
from pipesgd_hvd.pipeline.fusion import TensorSpec  # noqa: E402
from pipesgd_hvd.testing import LocalWorld  # noqa: E402
from test_elastic import third_local_name  # noqa: E402
from threads import run_threads  # noqa: E402

STEPS = 24  # tests/mp/elastic_keras.py: 4 epochs of 6 batches; join after 4 steps, kill after 17


# ----------------------------------------------------------------------------- the real job
@pytest.fixture(scope="module")
def elastic_job(tmp_path_factory):
    """Runs ``tests/mp/elastic_keras.py`` once under elastic horovodrun; (events, output, host)."""
    tmp_path = tmp_path_factory.mktemp("keras_elastic")
    join_host = third_local_name()
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")  # two host names, both this machine
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(discover.stat().st_mode | stat.S_IEXEC)
    cmd = [*HOROVODRUN_CHECKED, "-np", "2", "--min-np", "1", "--max-np", "3", "--gloo",
           "--host-discovery-script", str(discover),
           sys.executable, str(TESTS / "mp" / "elastic_keras.py"), str(tmp_path), join_host]
    # Gloo's timeout bounds two waits: the survivors' rendezvous with the joining worker, which
    # starts only then and must import TensorFlow first (6-7 s from the host's appearance to the
    # new world's first step when the suite runs alone on 2 cores), and, after the kill, the
    # survivor whose pending receive was from the other survivor (it sees no broken connection:
    # it waits the whole timeout). 30 s covers the first four times over and bounds the second.
    out = run_command(cmd, "elastic_keras.py", 420, {"HOROVOD_GLOO_TIMEOUT_SECONDS": "30"}, False)
    events = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    return events, out, join_host


def _last_commit_before(events, event):
    return [e for e in events[:events.index(event)] if e["event"] == "commit"][-1]


@pytest.mark.multiprocess
def test_keras_elastic_worker_joins_then_one_is_killed_and_training_continues(elastic_job):
    """width 2, int8 + error feedback, ``model.fit`` with the elastic callbacks: starts on 2
    workers, a third joins after step 4 (mid-epoch), the joined one SIGKILLs itself as step 18
    begins, the 2 survivors go back to the commit of step 15 (mid-epoch) and finish 24 steps."""
    events, out, join_host = elastic_job
    two, three = ["127.0.0.1", "localhost"], sorted(["127.0.0.1", "localhost", join_host])
    starts = [e for e in events if e["event"] == "start"]
    assert [(s["size"], s["hosts"]) for s in starts] == [(2, two), (3, three), (2, two)], events
    # Every rank checked (allgather) that all ranks hold the same weights, pipeline step, pending
    # gradients, epoch and batch at each start, first step, commit and end; the pipeline's step
    # is the number of steps done (epoch * 6 + batch, kept by the elastic callbacks).
    checked = [e for e in events if e["event"] in ("start", "first", "commit", "end")]
    assert all(e["step"] == e["done"] for e in checked), events
    assert any(e["event"] == "commit" and e["size"] == 3 for e in events), "no commit with the joined worker"
    # Commits happen after every callback of the batch (CommitStateCallback is listed first):
    # every third batch of a fit and at each epoch's end, and every 0.5 s while waiting at step 4.
    commits = sorted({e["done"] for e in events if e["event"] == "commit"})
    assert commits == [3, 4, 6, 9, 12, 15, 18, 21, 24], events

    # Join (HostsUpdatedInterrupt at a commit): nothing was in flight unreduced, nothing is lost;
    # the new worker starts with the others' weights and their pending (averaged) gradient.
    joined, committed = starts[1], _last_commit_before(events, starts[1])
    assert (joined["epoch"], joined["batch"]) == (0, 4) and joined["in_flight"] == 1, events
    assert (joined["weights"], joined["pending"]) == (committed["weights"], committed["pending"]), events
    # Kill (HorovodInternalError inside the traced step): the survivors drop the reduction in
    # flight and go back to the commit of step 15, pending gradient included.
    resumed, committed = starts[2], _last_commit_before(events, starts[2])
    assert committed["size"] == 3 and resumed["done"] == committed["done"] == 15, events
    assert (resumed["epoch"], resumed["batch"]) == (2, 3), events
    assert (resumed["weights"], resumed["pending"]) == (committed["weights"], committed["pending"]), events
    resets = [e for e in events if e["event"] == "reset"]
    assert [(r["size"], r["done"]) for r in resets] == [(3, 4), (2, 15)], events
    end = events[-1]
    assert end["event"] == "end" and end["done"] == end["step"] == STEPS and end["in_flight"] == 0, events
    assert (end["epoch"], end["batch"]) == (4, 0), events
    assert re.search(rf"worker on {re.escape(join_host)} \(rank \d\) kills itself at step 17", out), out
    done = sorted(re.findall(r"DONE (\S+) rank (\d) of 2 at step 24", out))
    assert [host for host, _ in done] == two and {r for _, r in done} == {"0", "1"}, out


@pytest.mark.multiprocess
def test_keras_elastic_joined_worker_applies_the_carried_pending_gradient_at_its_first_step(elastic_job):
    """The first step of the 3-worker world applies the gradient pending at the join (step 3's,
    averaged by the 2 old workers and carried to the new one): after it every rank, the joined
    one included, holds the same new weights (an allgather in the script). A joined worker
    without that gradient would apply nothing there (its pipeline filling) and differ."""
    events, _, join_host = elastic_job
    joined = [e for e in events if e["event"] == "start"][1]
    first = events[events.index(joined) + 1]
    assert first["event"] == "first" and join_host in first["hosts"] and first["size"] == 3, events
    assert first["step"] == joined["step"] + 1 == 5, events
    assert first["weights"] != joined["weights"], "the first step of the new world applied a gradient"
    # The averaged gradient it applied was the pending one, the same bytes on every rank: the
    # one the new worker received at the start (its digest matched everyone's there).
    assert joined["in_flight"] == 1 and first["in_flight"] == 0, events


# --------------------------------------------------------------- in-process: state and pipeline
def _model_and_optimizer(comm, **options):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), communicator=comm,
                                   compression="int8", **options)
    model.compile(optimizer=opt, loss="mse")
    return model, opt


def _step(model, opt, seed):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((8, 4)).astype("float32"), rng.standard_normal((8, 3)).astype("float32")
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


def _pending(opt):
    entry = opt.engine.reduced_state_dict()
    return opt.engine.step, [[g for _, g in sorted(e["grads"].items())] for e in entry["in_flight"]]


def test_keras_state_builds_the_optimizer_and_restore_goes_back_to_the_commit_pending_gradient_included():
    comm = LocalWorld(1, TensorFlowOps()).communicator(0)
    model, opt = _model_and_optimizer(comm)
    assert not opt.built
    state = hvd.elastic.KerasState(model, batch=0)
    assert opt.built and opt.engine is not None, "built on the model's trainable variables, as fit would"
    for s in range(3):
        _step(model, opt, s)
    model.train_function = "traced"  # stands for a traced step of the old pipeline
    state.batch = 3
    state.save()  # commit() without the host check: settles the pending gradient of step 2
    weights, slots = [v.numpy() for v in model.variables], [v.numpy() for v in opt.variables]
    step, pending = _pending(opt)
    assert step == 3 and len(pending) == 1, "the commit holds the reduced pending gradient"
    old_pipeline = opt.engine
    for s in range(3, 5):
        _step(model, opt, s)
    state.batch = 5
    opt.core.progress.begun.assign_add(1)  # a traced step that failed (it never ends)

    state.restore()
    assert state.batch == 3
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(weights, model.variables))
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(slots, opt.variables))
    assert _pending(opt)[0] == 3
    assert all(np.array_equal(a, b) for a, b in zip(pending[0], _pending(opt)[1][0]))
    assert opt.engine is not old_pipeline and opt.engine is opt.core.engine, "checkpoints track the new one"
    assert model.train_function is None, "traced again at the next fit"
    begun, ended = opt.core.progress.counts()
    assert begun == ended, "the failed step no longer counts as in progress (watchdog, exit)"
    # The restored pipeline goes on where the commit stood: its next step applies that gradient.
    before = [v.numpy() for v in model.trainable_variables]
    _step(model, opt, 3)
    assert any(not np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables))


def test_keras_state_saves_and_restores_a_plain_keras_optimizer_too():
    """Horovod's own TensorFlowKerasState fails on Keras 3 (``optimizer.variables()``)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    state = hvd.elastic.KerasState(model, epoch=0)
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 3), "float32")
    model.fit(x, y, batch_size=4, verbose=0)
    state.epoch = 1
    state.save()
    saved = [v.numpy() for v in model.variables + model.optimizer.variables]
    model.fit(x, y, batch_size=4, verbose=0)
    state.epoch = 2
    state.restore()
    assert state.epoch == 1 and model.train_function is None
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(saved, model.variables + model.optimizer.variables))


def test_keras_state_refuses_what_it_does_not_support_and_needs_a_built_model():
    comm = LocalWorld(1, TensorFlowOps()).communicator(0)
    model, _ = _model_and_optimizer(comm, staleness_correction=True)
    with pytest.raises(ValueError, match="not support .*staleness_correction"):
        hvd.elastic.KerasState(model)
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    unbuilt.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError, match="build the model first"):
        hvd.elastic.KerasState(unbuilt)
    assert hvd.elastic.TensorFlowKerasState is hvd.elastic.KerasState


class _NoCollectives:
    """A communicator of rank 1 of 2 on which any collective fails the test."""
    rank, size = 1, 2

    def __getattr__(self, name):
        raise AssertionError(f"a collective ran: {name}")


def test_a_pipeline_built_without_the_rank_check_issues_no_collective_and_primes_like_a_checked_one():
    """A worker joining an elastic job builds its optimizer while the others sync, and the
    survivors of a lost worker rebuild theirs while Horovod is broken: no collective may run."""
    specs = [TensorSpec("w", (5, 3), "float32"), TensorSpec("b", (3,), "float32")]
    config = PipelineConfig(name="t", width=2)
    quiet = TracedEngine(specs, comm=_NoCollectives(), codec=resolve_compression("int8"), config=config,
                          check_ranks=False)

    def checked(rank, comm):
        pipe = TracedEngine(specs, comm=comm, codec=resolve_compression("int8"), config=config)
        return {k: tuple(v.shape) for k, v in pipe._residuals().items()}, pipe._sent

    shapes, sent = run_threads(LocalWorld(2, TensorFlowOps()), checked)[1]
    assert {k: tuple(v.shape) for k, v in quiet._residuals().items()} == shapes and shapes
    assert quiet._sent == sent, "the bytes one reduction sends are known as well"


# ------------------------------------------------------------------------------ run's errors
def _raising(error):
    def func():
        raise error
    return raise_lost_world_as_internal_error(func)


# What a lost worker gave in tests/mp/elastic_keras.py (abbreviated): it names none of the ops
# Horovod's own run looks for (HorovodAllreduce/Allgather/Broadcast), so that run returns None.
TRACED = ("Graph execution error: Detected at node pipesgd_stale_reduction/cond/psgd.2.9522f1ca.b0.stale.a2a "
          "defined at (most recent call last): ... in alltoall File \"<string>\", line 1853, in horovod_alltoall "
          "Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to "
          "allreduce, allgather or broadcast a tensor after one of the ranks finished execution. ... "
          "[[{{node pipesgd_stale_reduction/cond/psgd.2.9522f1ca.b0.stale.a2a}}]] [Op:__inference_multi_step_3760]")
EAGER = ("{{function_node __wrapped__HorovodAllgather_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
         "Horovod has been shut down. This was caused by an exception on one of the ranks ...")


@pytest.mark.parametrize("message", [TRACED, EAGER, "HorovodAllreduce_x failed", "HorovodBroadcast_tuple_0"],
                         ids=["traced-step", "eager-allgather_object", "allreduce", "broadcast"])
def test_run_turns_errors_of_horovods_ops_into_horovod_internal_error(message):
    if message == TRACED:
        assert not any(op in message for op in ("HorovodAllreduce", "HorovodAllgather", "HorovodBroadcast"))
    with pytest.raises(HorovodInternalError):
        _raising(tf.errors.UnknownError(None, None, message))()


def test_run_turns_peer_lost_into_horovod_internal_error_and_reraises_anything_else():
    with pytest.raises(HorovodInternalError):
        _raising(PeerLostError("allgather_object did not complete within 600 s"))()
    other = tf.errors.UnknownError(None, None, "ReplicaDriftError: replicas differ at step 10")
    with pytest.raises(tf.errors.UnknownError) as caught:  # Horovod's own run returns None here
        _raising(other)()
    assert caught.value is other
    for error in (ValueError("a bug"), HostsUpdatedInterrupt(False), HorovodInternalError("lost")):
        with pytest.raises(type(error)) as caught:
            _raising(error)()
        assert caught.value is error
    mismatch = "Mismatched allreduce tensor shapes: HorovodAllreduce_psgd_1_b0 on rank 1 ..."
    assert not lost_world(tf.errors.FailedPreconditionError(None, None, mismatch)), "a bug, not a lost worker"


# ------------------------------------------------------------------------------ callbacks
class _State:
    def __init__(self, batch=0, epoch=0):
        self.batch, self.epoch, self.commits = batch, epoch, []

    def commit(self):
        self.commits.append((self.epoch, self.batch))


def _fit(model, state, first_batch, epochs, callbacks):
    x = np.zeros((6 * 2, 2), "float32")[first_batch * 2:]
    model.fit(x, np.zeros((len(x), 1), "float32"), batch_size=2, epochs=epochs, shuffle=False, verbose=0,
              callbacks=callbacks)


def test_elastic_callbacks_commit_the_batch_and_epoch_they_belong_to_in_horovods_order():
    """Horovod's example lists CommitStateCallback first; the commit still sees the batch and
    epoch counted by the callbacks after it. ``state.batch`` counts the batches of the epoch
    done, across a restart in the middle of an epoch (fit the rest of it first)."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    state = _State()
    callbacks = lambda: [hvd.elastic.CommitStateCallback(state, batches_per_commit=4),  # noqa: E731
                         hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state)]
    _fit(model, state, 0, 2, callbacks())  # every 4 batches, counted across epochs, and at epoch ends
    assert state.commits == [(0, 4), (1, 0), (1, 2), (2, 0)] and (state.epoch, state.batch) == (2, 0)
    state.commits.clear()
    state.batch, state.epoch = 3, 2  # restored in the middle of the third epoch
    _fit(model, state, 3, 1, callbacks())  # the rest of it
    assert (state.epoch, state.batch) == (3, 0) and state.commits == [(3, 0)]
    _fit(model, state, 0, 1, callbacks())
    assert state.commits == [(3, 0), (3, 4), (4, 0)] and (state.epoch, state.batch) == (4, 0)
