"""Keras's side of the optimizer's :class:`~pipesgd_hvd.optimizer.framework.FrameworkSide`: the
trainable variables and the wrapped Keras optimizer, as the staleness corrections reach them (its
Adam moments for ``"adam_prediction"``, its variables saved and put back around a look-ahead)."""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, List, Optional, Sequence

import keras
import tensorflow as tf

from ..ops.tensorflow import TensorFlowOps
from ..staleness.prediction import AdamState


class KerasSide:
    """Keras's :class:`~pipesgd_hvd.optimizer.framework.FrameworkSide`: the trainable variables and
    the wrapped Keras optimizer (held weakly: it owns the core that holds this)."""

    def __init__(self, variables: Sequence[Any], optimizer: Optional[Any]) -> None:
        self.ops = TensorFlowOps()
        self.variables = list(variables)
        self._optimizer = (lambda: None) if optimizer is None else weakref.ref(optimizer)

    weights_guard = contextlib.nullcontext  # variables are assigned as they are

    def weights(self) -> List[Any]:
        return self.variables

    def check_adam_support(self) -> None:
        optimizer = self._optimizer()
        if not isinstance(optimizer, keras.optimizers.Adam):  # AdamW is one too
            raise ValueError("staleness_correction='adam_prediction' predicts with Adam's own next step, but the "
                             f"wrapped optimizer is {type(optimizer).__name__}: wrap keras.optimizers.Adam or AdamW, "
                             "or use staleness_correction='weight_prediction'")

    def adam_state(self, index: int) -> Optional[AdamState]:
        """Keras 3's Adam (``update_step``): moments by variable index, ``iterations`` updates
        done, eps added to sqrt(v), weight decay decoupled (``_apply_weight_decay``) for Adam and
        AdamW alike, where ``_use_weight_decay`` says so."""
        opt, variable = self._optimizer(), self.variables[index]
        i = opt._get_variable_index(variable)
        v = opt._velocity_hats[i] if opt.amsgrad else opt._velocities[i]
        decay = float(opt.weight_decay or 0.0) if opt._use_weight_decay(variable) else 0.0
        return AdamState(m=tf.convert_to_tensor(opt._momentums[i]), v=tf.convert_to_tensor(v),
                         step=tf.cast(opt.iterations, tf.float32), lr=tf.cast(opt.learning_rate, tf.float32),
                         beta1=float(opt.beta_1), beta2=float(opt.beta_2), eps=float(opt.epsilon),
                         decoupled_weight_decay=decay, eps_on_raw_v=True)

    def look_ahead_step(self) -> None:
        """Keras's optimizers have no stateless form: a look-ahead saves and restores their variables."""
        return None

    def optimizer_snapshot(self) -> "KerasOptimizerSnapshot":
        optimizer = self._optimizer()
        if optimizer is None:
            raise ValueError("staleness_correction='split_batch' needs the wrapped Keras optimizer (KerasCore's "
                             "optimizer argument)")
        return KerasOptimizerSnapshot(optimizer)


class KerasOptimizerSnapshot:
    """The wrapped Keras optimizer's variables (iterations, learning rate, moments), saved before
    the split-batch rule's virtual update and put back after it (:mod:`pipesgd_hvd.staleness.split_batch`):
    Keras builds them all before the first update, so a copy of each is the whole state."""

    def __init__(self, optimizer: Any) -> None:
        with tf.init_scope():
            self.variables = list(optimizer.variables)
            # Zeros of each variable's shape, not its value: model.fit builds the optimizer in a
            # symbolic pass where the values are placeholders of shape (0,) (a copy of one kept
            # that shape, and the first save() failed). save() writes them before any use.
            self.saved = [tf.Variable(tf.zeros(tuple(v.shape), tf.as_dtype(v.dtype)), trainable=False,
                                      name="pipesgd_optimizer_saved") for v in self.variables]

    def save(self, when: Any) -> None:
        _copy_where(when, self.variables, self.saved)

    def restore(self, when: Any) -> None:
        _copy_where(when, self.saved, self.variables)


def _copy_where(when: Any, sources: Sequence[Any], targets: Sequence[Any]) -> None:
    def copy() -> tf.Tensor:
        for source, target in zip(sources, targets):
            target.assign(tf.convert_to_tensor(source))
        return tf.constant(True)

    if isinstance(when, bool):
        if when:
            copy()
        return
    tf.cond(when, copy, lambda: tf.constant(False))
