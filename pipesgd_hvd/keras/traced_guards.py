"""The guards of :mod:`pipesgd_hvd.pipeline.guards`, inside a traced TensorFlow step.

``model.fit`` and a custom ``tf.function`` loop run the step as a graph: its Python runs once, at
trace time, and its collectives are Horovod ops that block in the graph executor, where Python
cannot poll them. So both guards are built from graph ops and variables:

* :class:`ReplicaCheck` (``check_replicas_every=N``): every N-th step, a fingerprint of every
  variable the optimizer updates, gathered across ranks by one small Horovod allgather (a graph
  op, like the reductions); only when the rows differ does Python run, to raise the error of
  :func:`pipesgd_hvd.pipeline.guards.raise_if_replicas_differ` (the same message as PyTorch's).
* :class:`StepProgress`: two counters the step increments (begun: once this rank's gradients
  exist; ended: once every collective of the step is done), read by a
  :class:`~pipesgd_hvd.pipeline.guards.StepWatchdog` thread that ends the process when a step waits for
  its peers longer than ``PIPESGD_TIMEOUT``.
"""
from __future__ import annotations

import atexit
import contextlib
import weakref
from typing import Any, Iterator, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ..comm.base import Communicator, default_timeout, exit_if_stuck
from ..pipeline.guards import StepWatchdog, raise_if_replicas_differ
from ..pipeline.schedule import Schedule

# How a Keras user re-syncs every rank's weights from rank 0 (ends the drift message).
KERAS_RESYNC = "pipesgd_hvd.keras.broadcast_global_variables(0, model=model)"


def fingerprints(variables: Sequence[Any]) -> tf.Tensor:
    """One int64 per variable: farmhash64 of its raw bytes (``tf.fingerprint``), so equal iff the
    values are bitwise equal, in practice. A graph op, unlike :func:`pipesgd_hvd.pipeline.guards.checksum`."""
    return tf.concat([tf.bitcast(tf.fingerprint(tf.reshape(tf.convert_to_tensor(v), (1, -1))), tf.int64)
                      for v in variables], 0)


class ReplicaCheck:
    """``check_replicas_every=N``: call it at the start of every step, before the update, with the
    step's index; every N-th step it compares the variables across ranks.

    Why inside the graph rather than in Python between steps: ``model.fit`` gives an optimizer no
    Python hook between steps (a callback would not run in a custom ``tf.function`` loop), and a
    ``py_function`` that gathered host copies would hold the GIL and nest eager Horovod calls inside
    a graph op. As graph ops the check runs in both kinds of loop; its allgather is a Horovod op
    like the reductions (a lost peer does to it what it does to them: see :class:`StepProgress`),
    it needs no host copy beyond the fingerprint's, and Python runs only on a mismatch, to raise.
    TensorFlow re-raises an error from inside a graph as ``tf.errors.UnknownError`` whose message
    holds ``ReplicaDriftError: replicas differ at step ...``; eagerly the error is raised as itself.
    """

    def __init__(self, comm: Communicator, schedule: Schedule, names: Sequence[str],
                 pipeline_name: str) -> None:
        self.comm, self.schedule, self.names = comm, schedule, list(names)
        self._op_name = f"{pipeline_name}.replicas"  # the same on every rank (agreed at construction)
        with tf.init_scope():  # created eagerly even when Keras builds the optimizer inside a trace
            # The step of the last check that passed, for the message (not checkpointed: after a
            # restore it says 0, as PyTorch's does).
            self.agreed_at = tf.Variable(0, dtype=tf.int64, trainable=False, name="pipesgd_replicas_agreed_at")

    def __call__(self, step: tf.Tensor, variables: Sequence[Any]) -> Optional[tf.Tensor]:
        """Eagerly: checks if due, raises ReplicaDriftError / StepCountMismatchError, returns None.
        Traced: returns a bool tensor to make the update wait for (the check fails the step)."""
        step = tf.cast(step, tf.int64)
        due = self.schedule.replica_check_due(step)
        if tf.executing_eagerly():
            if bool(due):
                self._compare(self._gather(step, variables).numpy(), int(step), int(self.agreed_at.numpy()))
                self.agreed_at.assign(step)
            return None
        return tf.cond(due, lambda: self._check_traced(step, variables), lambda: tf.constant(True))

    def _gather(self, step: tf.Tensor, variables: Sequence[Any]) -> tf.Tensor:
        """Every rank's row (step, fingerprint of each variable), shape (ranks, 1 + variables)."""
        row = tf.concat([tf.reshape(step, (1,)), fingerprints(variables)], 0)
        return self.comm.allgather_async(row[None], self._op_name).wait()

    def _check_traced(self, step: tf.Tensor, variables: Sequence[Any]) -> tf.Tensor:
        gathered = self._gather(step, variables)
        agree = tf.reduce_all(tf.equal(gathered, gathered[:1]))

        def passed() -> tf.Tensor:
            self.agreed_at.assign(step)
            return tf.constant(True)

        def differ() -> tf.Tensor:  # every rank gathered the same rows, so every rank raises
            tf.py_function(lambda g, s, a: self._compare(g.numpy(), int(s), int(a)),
                           [gathered, step, self.agreed_at.read_value()], [])
            return tf.constant(False)

        return tf.cond(agree, passed, differ)

    def _compare(self, gathered: np.ndarray, step: int, agreed_at: int) -> None:
        everyone = [(int(row[0]), [int(x) for x in row[1:]]) for row in gathered]
        raise_if_replicas_differ(everyone, step, self.names, agreed_at, KERAS_RESYNC)
        if len({tuple(row) for row in gathered.tolist()}) > 1:  # rows differ, so the line above raised
            raise AssertionError(f"replica check of step {step}: rows differ but no difference was named")


class StepProgress:
    """Steps begun and ended on this rank, as CPU variables the step itself increments, and the
    watchdog that ends the process when one has waited for its peers longer than
    ``PIPESGD_TIMEOUT`` (default 600 s; 0: no watchdog).

    A step counts as begun once this rank's gradients exist (so data loading, forward and backward
    are not timed, only the wait for the collectives, as PyTorch's timeout times the wait in
    ``step()``) and as ended once all its collectives are done. After a step fails with an error
    (a lost peer that the transport reported, a replica drift) it never ends: failures are final,
    and a process that goes on running still ends ``PIPESGD_TIMEOUT`` after that step began. At
    interpreter exit with a step unfinished, ``PIPESGD_EXIT_GRACE`` bounds Horovod's shutdown, as
    for PyTorch (:func:`pipesgd_hvd.comm.base.exit_if_stuck`).
    """

    def __init__(self) -> None:
        timeout = default_timeout()  # a bad PIPESGD_TIMEOUT fails here, naming the variable
        with tf.init_scope(), tf.device("/CPU:0"):  # read by another thread: keep them off the GPU
            self.begun = tf.Variable(0, dtype=tf.int64, trainable=False, name="pipesgd_steps_begun")
            self.ended = tf.Variable(0, dtype=tf.int64, trainable=False, name="pipesgd_steps_ended")
            # The auto mode's compute time: from the end of one step's collectives to this step's
            # gradients (forward, backward, data loading, the update), in seconds.
            self.ended_at = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="pipesgd_step_ended_at")
            self.compute_seconds = tf.Variable(-1.0, dtype=tf.float64, trainable=False, name="pipesgd_compute_s")
        ref = weakref.ref(self)

        def counts() -> Tuple[int, int]:  # a weak reference: the thread ends with the optimizer
            progress = ref()
            if progress is None:
                raise ReferenceError("the optimizer is gone")
            return progress.counts()

        self.watchdog = None if timeout is None else StepWatchdog(counts, timeout, "a pipelined training step")
        atexit.register(_at_exit, ref)

    def counts(self) -> Tuple[int, int]:
        return int(self.begun.numpy()), int(self.ended.numpy())

    def begin(self, after: Sequence[Optional[tf.Tensor]]) -> tf.Tensor:
        """Traced: counts the step as begun once the tensors ``after`` (the gradients) exist."""
        with tf.control_dependencies([t for t in after if t is not None]):
            now = tf.timestamp()
            previous = self.ended_at.read_value()
            self.compute_seconds.assign(tf.where(previous > 0, now - previous, -1.0))
            return self.begun.assign_add(1)

    def end(self, after: Sequence[Optional[tf.Tensor]]) -> tf.Tensor:
        """Traced: counts the step as ended once the tensors ``after`` exist."""
        with tf.control_dependencies([t for t in after if t is not None]):
            self.ended_at.assign(tf.timestamp())
            return self.ended.assign_add(1)

    @contextlib.contextmanager
    def eager_step(self) -> Iterator[None]:
        """Eagerly: a collective call (a step, a flush). An error returns to Python, where nothing
        waits any more, so the step counts as ended either way."""
        with tf.init_scope():
            self.begun.assign_add(1)
        try:
            yield
        finally:
            with tf.init_scope():
                self.ended.assign_add(1)


def _at_exit(ref: "weakref.ref[StepProgress]") -> None:
    progress = ref()
    if progress is None:
        return
    if progress.watchdog is not None:
        progress.watchdog.stop()  # TensorFlow is torn down after this; the thread must not read it
    begun, ended = progress.counts()
    if begun > ended:  # a step failed mid-way: Horovod's shutdown may wait for the peer that is gone
        exit_if_stuck("a pipelined step did not complete")

