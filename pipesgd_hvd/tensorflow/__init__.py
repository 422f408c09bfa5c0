"""``import pipesgd_hvd.tensorflow as psgd``: the pipelined optimizer for custom TensorFlow loops.

``psgd.DistributedOptimizer(keras_optimizer)`` is the same object as in ``pipesgd_hvd.keras``;
use it with ``tf.GradientTape`` and ``optimizer.apply_gradients(zip(grads, variables))``,
eagerly or inside ``tf.function`` (where the reduction overlaps the next step's compute).
"""
from ..compression import Compression
from ..staleness.choice import AccuracyWarning
from ..staleness.halves import halves
from ..keras.optimizer import DistributedOptimizer

__all__ = ["AccuracyWarning", "Compression", "DistributedOptimizer", "halves"]
