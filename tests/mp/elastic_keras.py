"""Horovod elastic with Keras 3 ``model.fit`` and the pipelined optimizer (width 2, int8): a worker
joins, one is killed mid-pipeline, training goes on. Run by tests/test_elastic_keras.py under
``horovodrun --gloo --min-np 1 --max-np 3 --host-discovery-script DIR/discover.sh``.

Usage: DIR JOIN_HOST

The Keras twin of tests/mp/elastic_torch.py (read it first): the same hosts (localhost,
127.0.0.1, then JOIN_HOST; one slot each, a worker known by ``HOROVOD_HOSTNAME``), a schedule
counted in steps done, ``g = state.epoch * STEPS_PER_EPOCH + state.batch``: ``EPOCHS`` epochs of
``STEPS_PER_EPOCH`` batches inside ``hvd.elastic.run``, with Horovod's elastic callbacks (ours,
for Keras 3, listed in the order of Horovod's example: CommitStateCallback first) committing
every ``COMMIT_EVERY`` batches and at each epoch's end. When ``JOIN`` steps are done rank 0 adds
JOIN_HOST to ``DIR/hosts`` and every rank stays at that step, committing every 0.5 s, until the
new worker is in (at most ``JOIN_WAIT`` s). When ``KILL`` steps are done the worker on JOIN_HOST
SIGKILLs itself as its next batch begins, so the others lose it inside their traced step, with
the pending gradient's reduction in flight: they restore the last commit (step 15, in the
middle of an epoch) and finish as two. A (re)start in the middle of an epoch first fits the
rest of that epoch (Keras 3 takes no step count from callbacks).

Every rank compares (allgather of digests) the weights, pipeline step, pending gradients, epoch
and batch of all ranks at each start, before each commit (a check in ``commit()``), after the
first step of each world ("first": a joined worker applied the same carried gradient as the
others) and at the end; rank 0 appends a JSON line per event to ``DIR/log.jsonl``.
"""
import hashlib
import json
import os
import signal
import sys
import time

import keras
import numpy as np

import pipesgd_hvd.keras as hvd
from keras_common import BATCH, FEATURES, LOSS, make_model

out_dir, join_host = sys.argv[1], sys.argv[2]
EPOCHS, STEPS_PER_EPOCH = 4, 6
JOIN, KILL, COMMIT_EVERY, JOIN_WAIT = 4, 17, 3, 40.0
HOST = os.environ.get("HOROVOD_HOSTNAME", "?")
LOG = os.path.join(out_dir, "log.jsonl")

hvd.init()
model = make_model()  # the same initial weights everywhere; sync() broadcasts rank 0's anyway
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), width=2, compression="int8")
model.compile(optimizer=opt, loss=LOSS)


def epoch_data(rank: int, first: int):
    """Batches ``first``.. of an epoch on ``rank`` (every epoch sees the same batches)."""
    xs, ys = [], []
    for b in range(first, STEPS_PER_EPOCH):
        rng = np.random.default_rng(1000 * b + rank)
        x = rng.standard_normal((BATCH, FEATURES)).astype("float32")
        xs.append(x)
        ys.append((x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32"))  # < CLASSES
    return np.concatenate(xs), np.concatenate(ys)


def digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def done(state) -> int:
    return state.epoch * STEPS_PER_EPOCH + state.batch


def pipeline_view(settle: bool):
    """(pipeline step, pending gradients, digest of the reduced ones). ``settle``: reduce the
    pending gradients first (collective), as the commit that follows does anyway."""
    pipe = opt.engine
    entry = pipe.state_dict() if settle else pipe.reduced_state_dict()
    grads = [g for e in entry["in_flight"] for _, g in sorted(e["grads"].items())]
    return pipe.step, len(entry["in_flight"]), digest(grads)


def log(event: str, **fields) -> None:
    if hvd.rank() == 0:
        with open(LOG, "a") as f:
            f.write(json.dumps({"event": event, "size": hvd.size(), "t": round(time.time(), 2), **fields}) + "\n")


def check_replicas(state, event: str) -> None:
    """Every rank holds the same weights, pipeline step, pending gradients, epoch and batch."""
    step, in_flight, pending = pipeline_view(settle=event != "first")
    mine = (digest(v.numpy() for v in model.variables), step, in_flight, pending, state.epoch, state.batch)
    views = hvd.allgather_object((HOST, mine), name=f"check.{event}.{state.rendezvous}.{done(state)}")
    if len({view for _, view in views}) != 1:
        raise AssertionError(f"{event}: replicas differ across ranks: {views}")
    log(event, epoch=state.epoch, batch=state.batch, done=done(state), rendezvous=state.rendezvous,
        weights=mine[0], step=step, in_flight=in_flight, pending=pending, hosts=sorted(h for h, _ in views))


class CheckedState(hvd.elastic.KerasState):
    def commit(self):
        check_replicas(self, "commit")  # the joined worker's weights too
        super().commit()


class Scenario(keras.callbacks.Callback):
    """Adds the host and waits for the new worker, kills it, checks each world's first step."""

    def __init__(self, state):
        super().__init__()
        self.state, self.first = state, True

    def on_train_batch_begin(self, batch, logs=None):
        if done(self.state) == KILL and HOST == join_host:
            print(f"worker on {HOST} (rank {hvd.rank()}) kills itself at step {KILL}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # the others' next step waits for it

    def on_train_batch_end(self, batch, logs=None):
        state = self.state  # listed after UpdateBatchStateCallback: state.batch counts this batch
        if self.first:
            self.first = False
            check_replicas(state, "first")
        if done(state) == JOIN and state.rendezvous == 1:
            if hvd.rank() == 0:
                with open(os.path.join(out_dir, "hosts"), "w") as f:
                    f.write(f"localhost:1\n127.0.0.1:1\n{join_host}:1\n")
            for _ in range(int(JOIN_WAIT / 0.5)):  # counted, not timed: every rank leaves alike
                time.sleep(0.5)  # until the driver sees the new host and notifies the workers
                state.commit()  # raises HostsUpdatedInterrupt then, on every rank
            raise AssertionError(f"the worker on {join_host} did not join within {JOIN_WAIT} s")


@hvd.elastic.run
def train(state):
    state.rendezvous += 1
    check_replicas(state, "start")
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY),
                 hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
                 Scenario(state)]
    if state.batch:  # the rest of the epoch a reset interrupted
        x, y = epoch_data(hvd.rank(), state.batch)
        model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0, callbacks=callbacks)
    x, y = epoch_data(hvd.rank(), 0)
    model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=EPOCHS - state.epoch, verbose=0, callbacks=callbacks)
    if done(state) > KILL and hvd.size() != 2:
        raise AssertionError(f"expected 2 workers after the kill, have {hvd.size()}")


def on_reset():
    log("reset", epoch=state.epoch, batch=state.batch, done=done(state))


state = CheckedState(model, epoch=0, batch=0, rendezvous=0)
state.register_reset_callbacks([on_reset])
train(state)
opt.flush()
check_replicas(state, "end")
print(f"DONE {HOST} rank {hvd.rank()} of {hvd.size()} at step {done(state)}", flush=True)
