"""Horovod elastic for Keras 3 (``pipesgd_hvd.keras.elastic``), pipelined optimizer or not.

Horovod's ``horovod.tensorflow.keras.elastic`` does not work on Keras 3, and knows nothing of a
pipeline: its ``KerasState`` calls ``optimizer.variables()`` (a list property in Keras 3: a
TypeError at construction) and would miss the pending gradients, which live in the pipeline's
slot variables, unreduced and different on every rank; its ``run`` turns only TensorFlow errors
naming HorovodAllreduce/Allgather/Broadcast into ``HorovodInternalError`` and returns None for
any other ``UnknownError``: a worker lost during a pipelined step (whose error names our
collective, e.g. an alltoall) would end training silently, as if it had finished; its
``UpdateBatchStateCallback`` shortens the first epoch after a reset by writing
``params["steps"]``, which Keras 3 never reads.

Here, with the rule of :mod:`pipesgd_hvd.optimizer.elastic_rule` (the same as PyTorch's ``TorchState``):

* ``state.commit()`` settles the pipeline (collective: the pending gradients are reduced and stay
  reduced, the same bytes on every rank) and saves the model's variables, the optimizer's own
  variables and the pipeline's checkpoint entry (step count, reduced pending gradients);
* ``restore()`` (a worker was lost) drops what is in flight and goes back to that commit;
* ``sync()`` (every rank of a new world, joining workers too) rebuilds the pipeline for the new
  world and continues from rank 0's weights, optimizer variables, pending gradients and step;
  error-feedback residuals start afresh. Both replace the pipeline and the world's size is a
  constant of a traced step, so the train function is traced again (``model.train_function =
  None``; a custom ``tf.function`` loop must make its function anew after a reset).
"""
from __future__ import annotations

import functools
import re
from typing import Any, Callable, Dict, List, Optional

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HorovodInternalError

from ..comm.base import PeerLostError
from ..comm.horovod_tensorflow import broadcast_object
from .traced_step import KerasCore
from .optimizer import _PipelinedOptimizer
from .callbacks import broadcast_variables

# What a Horovod op says when its world broke: Horovod shut down after a transport error (a lost
# worker) and fails every op with UnknownError "Horovod has been shut down ...". A traced step's
# message names the node (our collective's name, e.g. "psgd.2.9522f1ca.b0.stale.a2a") and the
# Python call that made it ("horovod_alltoall"); an eager op's names the kernel
# ("__wrapped__HorovodAllgather"). Mismatched tensors are other error types (FailedPrecondition,
# InvalidArgument): a bug to report, not a reason to restore.
_HOROVOD_OP = re.compile(r"Horovod has been shut down|horovod_?(allreduce|allgather|broadcast|alltoall|reducescatter)",
                         re.IGNORECASE)


def lost_world(error: BaseException) -> bool:
    """Whether ``error`` means a collective failed because the world broke (a worker was lost):
    :class:`~pipesgd_hvd.comm.base.PeerLostError`, or an ``UnknownError`` from a Horovod op, ours
    (the reductions' allreduce/alltoall/allgather, ``allgather_object`` in the checks) or the user's."""
    if isinstance(error, PeerLostError):
        return True
    return isinstance(error, tf.errors.UnknownError) and _HOROVOD_OP.search(str(error.message)) is not None


def raise_lost_world_as_internal_error(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with the errors of :func:`lost_world` raised as Horovod's ``HorovodInternalError``
    (what ``hvd.elastic.run`` restores from); every other error propagates unchanged."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - classified, then re-raised
            if lost_world(error):
                raise HorovodInternalError(error) from error
            raise

    return wrapper


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod's ``hvd.elastic.run``: runs ``func(state, ...)`` again whenever the world changes,
    after ``state.restore()`` (a worker was lost) or not (hosts added or removed), Horovod's reset
    and ``state.sync()``. No collective may run before ``func``'s body (a joining worker would
    issue it while the others sync)."""
    return run_fn(raise_lost_world_as_internal_error(func), _reset)


def _reset() -> None:
    hvd.shutdown()
    hvd.init()


class KerasState(ObjectState):
    """Horovod's elastic state of a Keras 3 model and its optimizer (``optimizer`` or the model's,
    pipelined or plain); ``kwargs`` become attributes, saved, restored and synced with the rest
    (``batch=0, epoch=0``). ``backend``: accepted for Horovod's signature, unused.

    Build the model first. An unbuilt optimizer is built here, on the model's trainable variables
    as ``fit`` would (the pipelined optimizer issues no collective while building under an
    elastic ``horovodrun``). Creating the state saves it (no collective for a fresh optimizer).
    ``width``/``compression="auto"`` and ``staleness_correction`` are not supported yet.
    """

    def __init__(self, model: keras.Model, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not model.built:
            raise ValueError("build the model first (call it on a batch, or model.build(input_shape)): its "
                             "variables must exist to be saved and synced")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError("no optimizer: pass optimizer=..., or compile the model first")
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        self.model, self.optimizer = model, optimizer
        self._core: Optional[KerasCore] = optimizer.core if isinstance(optimizer, _PipelinedOptimizer) else None
        if self._core is not None:
            self._core.check_elastic_support()
        self._save_model()
        # The typed broadcast: Horovod's own unpickles what it receives (comm/wire.py says why)
        super().__init__(bcast_object=broadcast_object, get_rank=hvd.rank, **kwargs)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        _assign(self.model.variables, self._saved_model)
        _assign(self.optimizer.variables, self._saved_optimizer)
        if self._core is not None:
            self._core.elastic_restore(self._saved_pipeline)
        self._retrace()
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self.model.variables, root_rank=0, name="pipesgd.elastic.model")
        if self._core is None:
            broadcast_variables(self.optimizer.variables, root_rank=0, name="pipesgd.elastic.optimizer")
        else:
            self._core.elastic_sync_from(lambda: _values(self.optimizer.variables),
                                         lambda values: _assign(self.optimizer.variables, values))
        self._retrace()
        self._save_model()  # collective-free: every pending gradient is reduced now
        super().sync()

    def _save_model(self) -> None:
        # The pipeline first: state_dict() reduces the pending gradients (collective, at the same
        # commit on every rank; none on a fresh optimizer or right after a sync).
        self._saved_pipeline: Optional[Dict[str, Any]] = None if self._core is None else self._core.state_dict()
        self._saved_model = _values(self.model.variables)
        self._saved_optimizer = _values(self.optimizer.variables)

    def _retrace(self) -> None:
        # The traced step holds the old pipeline's variables and the old world's size and names.
        self.model.train_function = None


TensorFlowKerasState = KerasState  # Horovod's name in horovod.tensorflow.elastic


def _values(variables: List[Any]) -> List[np.ndarray]:
    return [np.array(v.numpy(), copy=True) for v in variables]


def _assign(variables: List[Any], values: List[np.ndarray]) -> None:
    if len(variables) != len(values):
        raise ValueError(f"saved {len(values)} values for {len(variables)} variables: the model or the optimizer "
                         "changed since the state was saved")
    for v, value in zip(variables, values):
        v.assign(value)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at the end of every epoch, as
    Horovod's does. The commit runs when the next batch or epoch begins, or when training ends,
    so after every callback of the batch or epoch: ``state.batch``/``state.epoch`` (updated by
    the two callbacks below) are committed with the weights they belong to, whatever the order of
    the callback list (Horovod's own example lists this one first: on Keras 3 its commit saves the
    previous batch's number with this batch's weights)."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state, self.batches_per_commit = state, batches_per_commit
        self.batches_remaining = batches_per_commit
        self._due = False

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        # Counted from each (re)start, so every rank of a new world commits at the same batches.
        self.batches_remaining, self._due = self.batches_per_commit, False

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.batches_remaining, self._due = self.batches_per_commit, True

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._due = True

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._commit_if_due()

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._commit_if_due()

    def on_train_end(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self._commit_if_due()

    def _commit_if_due(self) -> None:
        if self._due:
            self._due = False
            self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` equal to the number of batches of the current epoch done (0 after
    each epoch), counting those done before a reset: a ``fit`` that starts with ``state.batch =
    k`` continues the epoch at its batch k. Horovod's stores the last batch's index instead (one
    less) and, after a reset, shortens the first epoch through ``params["steps"]``, which Keras 3
    does not read: start the first ``fit`` after a reset with the rest of the interrupted epoch
    (``steps_per_epoch - state.batch`` batches, ``epochs=1``; docs/reliability.md)."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self._done_before = 0

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self._done_before = self.state.batch

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.batch = self._done_before + batch + 1

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.batch, self._done_before = 0, 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` equal to the number of epochs done, across resets (Horovod's: ``fit``
    counts epochs from 0 at every call, ``epochs=total - state.epoch``)."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1


__all__ = ["CommitStateCallback", "KerasState", "TensorFlowKerasState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "lost_world", "raise_lost_world_as_internal_error", "run"]
