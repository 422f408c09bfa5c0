"""Horovod's Keras callbacks, for Keras 3 (Horovod's own crash or do nothing there).

Same names, arguments and meaning as ``horovod.tensorflow.keras.callbacks``; they work with any
Keras 3 model, with pipesgd_hvd's optimizer or without it. Each of them also gives the pipelined
optimizer the Python it needs between steps (``optimizer.after_steps()``: the auto mode's
measurements and switches), so one of them in ``fit``'s list is enough.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Union

import horovod.tensorflow as hvd
import keras
import tensorflow as tf


class _DrivesPipeline:
    """Mixed into every callback here: after each batch, lets a pipelined optimizer run its
    between-step work, and traces the train function again when the pipeline was rebuilt. Several
    of these callbacks in one list run it once per step (the optimizer ignores repeats)."""

    model: Any

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        parent = getattr(super(), "on_train_batch_end", None)
        if parent is not None:
            parent(batch, logs)
        after_steps = getattr(getattr(self.model, "optimizer", None), "after_steps", None)
        if after_steps is not None and after_steps():
            self.model.make_train_function(force=True)


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, name: str = "pipesgd.broadcast") -> None:
    """Overwrites ``variables`` (Keras 3 or tf.Variables) on every rank with root_rank's values,
    eagerly. One broadcast per dtype: the values are packed into one flat buffer."""
    by_dtype: Dict[str, list] = {}
    for v in variables:
        by_dtype.setdefault(tf.as_dtype(v.dtype).name, []).append(v)
    for dtype, group in sorted(by_dtype.items()):
        flat = tf.concat([tf.reshape(tf.convert_to_tensor(v), (-1,)) for v in group], 0)
        flat = hvd.broadcast(flat, root_rank, name=f"{name}.{dtype}")
        offset = 0
        for v in group:
            n = int(tf.size(v))
            v.assign(tf.reshape(flat[offset:offset + n], v.shape))
            offset += n


def broadcast_global_variables(root_rank: int = 0, model: Optional[keras.Model] = None) -> None:
    """Horovod's name. Keras 3 keeps no global collection of variables, so pass the model: its
    variables and its optimizer's are broadcast from ``root_rank``."""
    if model is None:
        raise ValueError("Keras 3 has no global variables to find: call broadcast_global_variables(root_rank, "
                         "model=model), or add BroadcastGlobalVariablesCallback(root_rank) to model.fit's callbacks")
    variables = list(model.variables)
    if getattr(model, "optimizer", None) is not None and model.optimizer.built:
        variables += list(model.optimizer.variables)
    broadcast_variables(variables, root_rank, name="pipesgd.broadcast_global_variables")


class BroadcastGlobalVariablesCallback(_DrivesPipeline, keras.callbacks.Callback):
    """Broadcasts the model's and optimizer's variables from ``root_rank`` when training starts,
    so every rank starts from the same weights (random initialisation differs per rank)."""

    def __init__(self, root_rank: int = 0, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self.broadcast_done:  # once: later fit() calls continue from equal weights
            broadcast_global_variables(self.root_rank, model=self.model)
            self.broadcast_done = True


class MetricAverageCallback(_DrivesPipeline, keras.callbacks.Callback):
    """Replaces each metric in the epoch's logs by its average over ranks (put it before any
    callback that reads the metrics, such as ModelCheckpoint or ReduceLROnPlateau)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not logs:
            return
        for metric in sorted(logs):  # the same order on every rank
            value = logs[metric]
            if isinstance(value, (int, float)) or (tf.is_tensor(value) and value.shape.rank == 0):
                averaged = hvd.allreduce(tf.constant(float(value), tf.float64), op=hvd.Average,
                                         name=f"pipesgd.metric.{metric}")
                logs[metric] = float(averaged)


class LearningRateScheduleCallback(_DrivesPipeline, keras.callbacks.Callback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` until
    ``end_epoch``; with ``staircase=False`` the epoch is fractional and the rate changes every
    batch. ``initial_lr`` None: the optimizer's rate when training starts.

    ``momentum_correction`` is accepted and has no effect: a Keras 3 optimizer's momentum is a
    constant of the traced step, so it cannot be rescaled per batch.
    """

    def __init__(self, initial_lr: Optional[float] = None, multiplier: Union[float, Callable[[float], float]] = 1.0,
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        if not callable(multiplier):
            constant = float(multiplier)
            staircase = True
            multiplier = (lambda epoch: constant)
        self.multiplier = multiplier
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _optimizer(self) -> Any:
        return self.model.optimizer

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.initial_lr is None:
            self.initial_lr = float(self._optimizer().learning_rate)
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__}: pass steps_per_epoch (it could not be read from fit's "
                                 "parameters, e.g. with a dataset of unknown length)")

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.current_epoch = epoch

    def _active(self) -> bool:
        return self.current_epoch >= self.start_epoch and (self.end_epoch is None or self.current_epoch < self.end_epoch)

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self._active():
            return
        if self.staircase:
            if batch == 0:
                self._set(self.current_epoch)
        else:
            self._set(self.current_epoch + float(batch) / self.steps_per_epoch)

    def _set(self, epoch: float) -> None:
        self._optimizer().learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if logs is not None:
            logs["learning_rate"] = float(self._optimizer().learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s gradual warm-up, as in Horovod: the rate grows from ``initial_lr / size`` to
    ``initial_lr`` (which is meant to be already scaled by the number of ranks) over
    ``warmup_epochs`` epochs, adjusted every batch."""

    def __init__(self, initial_lr: Optional[float] = None, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0) -> None:
        size = hvd.size()

        def multiplier(epoch: float) -> float:
            # shifted by one batch so the rate reaches round values at the end of each epoch
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(self._optimizer().learning_rate):g}.")


class BestModelCheckpoint(_DrivesPipeline, keras.callbacks.ModelCheckpoint):
    """Keras's ModelCheckpoint with ``save_best_only=True``, saving on rank 0 only. Horovod leaves
    ``filepath`` to its Spark estimator; here pass it (``filepath="best.keras"``). Use it after
    MetricAverageCallback so every rank agrees on what "best" is."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, save_weights_only: bool = False,
                 mode: str = "auto", save_freq: Union[str, int] = "epoch", *, filepath: Optional[str] = None) -> None:
        if filepath is None:
            raise ValueError("BestModelCheckpoint needs filepath=... (e.g. 'best.keras'); Horovod sets it from its "
                             "Spark estimator, which pipesgd_hvd does not have")
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

    def _save_model(self, epoch: int, batch: Any, logs: Any) -> None:
        if hvd.rank() == 0:
            super()._save_model(epoch, batch, logs)


class PipelineFlushCallback(_DrivesPipeline, keras.callbacks.Callback):
    """Applies the gradient still in flight when ``fit`` ends (``optimizer.flush()``), so the
    final weights include every step's gradient. Without it the gradient stays in the optimizer
    and is applied by the next ``fit`` call."""

    def on_train_end(self, logs: Optional[Dict[str, Any]] = None) -> None:
        flush = getattr(self.model.optimizer, "flush", None)
        if flush is not None:
            flush()


__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback", "PipelineFlushCallback",
           "broadcast_global_variables", "broadcast_variables"]
