"""TensorOps for TensorFlow: the same codecs and compressed all-reduce, eager or inside tf.function.

Everything here is functional (TensorFlow tensors are immutable); the only state is what
:meth:`new_state` creates, a ``tf.Variable``, so codec state such as error-feedback residuals
lives in the graph and is saved by ``tf.train.Checkpoint`` like any other variable.

The byte codecs run the fused host kernels on CPU tensors (``compression/tf_kernels.py``, through
``tf.numpy_function``), and their tensor-op composition on GPU tensors or with ``fused=False``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from .base import Shape
from .seeds import Seed

_DTYPES = {"float16": tf.float16, "bfloat16": tf.bfloat16, "float32": tf.float32, "float64": tf.float64,
           "uint8": tf.uint8, "int8": tf.int8, "int32": tf.int32, "int64": tf.int64, "bool": tf.bool}


def tf_dtype(dtype: str) -> tf.DType:
    return _DTYPES[dtype]


def _on_cpu(x: Any) -> bool:
    """Whether ``x`` lives (or, traced, will run) on the CPU. A graph tensor outside any
    ``tf.device`` scope names no device type (a numpy_function's output names only its task);
    the placer puts it on a GPU when one is visible."""
    kind = tf.DeviceSpec.from_string(x.device or "").device_type
    if kind:
        return kind == "CPU"
    return not tf.config.list_logical_devices("GPU")


class TensorFlowOps:
    name = "tensorflow"

    def __init__(self, fused: bool = True) -> None:
        self.fused = fused  # False: codecs run their unfused tensor-op reference (the tests' baseline)

    def dtype_name(self, x: Any) -> str:
        return tf.as_dtype(x.dtype).name

    def shape(self, x: Any) -> Shape:
        return tuple(int(d) for d in x.shape)

    def numel(self, x: Any) -> int:
        return int(np.prod(self.shape(x), dtype=np.int64))

    def zeros(self, shape: Shape, dtype: str, like: Optional[Any] = None) -> tf.Tensor:
        return tf.zeros(shape, tf_dtype(dtype))

    def full(self, shape: Shape, value: float, dtype: str, like: Optional[Any] = None) -> tf.Tensor:
        return tf.fill(shape, tf.constant(value, tf_dtype(dtype)))

    def cast(self, x: Any, dtype: str) -> tf.Tensor:
        return tf.cast(x, tf_dtype(dtype))

    def reshape(self, x: Any, shape: Shape) -> tf.Tensor:
        return tf.reshape(x, shape)

    def concat(self, xs: Sequence[Any], axis: int = 0) -> tf.Tensor:
        return tf.concat(list(xs), axis=axis)

    def stack(self, xs: Sequence[Any], axis: int) -> tf.Tensor:
        return tf.stack(list(xs), axis=axis)

    def sum(self, x: Any, axis: int, keepdims: bool = False) -> tf.Tensor:
        return tf.reduce_sum(x, axis=axis, keepdims=keepdims)

    def abs(self, x: Any) -> tf.Tensor:
        return tf.abs(x)

    def amax(self, x: Any, axis: int) -> tf.Tensor:
        return tf.reduce_max(x, axis=axis)

    def amax_abs(self, x: Any, axis: int) -> tf.Tensor:
        return tf.reduce_max(tf.abs(x), axis=axis)

    def to_levels(self, x: Any, divisor: Any, levels: float, offset: float, noise: Optional[Any] = None) -> tf.Tensor:
        y = x / divisor * levels
        y = tf.round(y) if noise is None else tf.floor(y + noise)
        return tf.clip_by_value(y + offset, offset - levels, offset + levels)

    def from_levels(self, codes: Any, scale: Any, levels: float, offset: float) -> tf.Tensor:
        return (tf.cast(codes, tf.float32) - offset) / levels * scale

    def finite_or_zero(self, x: Any) -> tf.Tensor:
        return tf.where(tf.math.is_finite(x), x, tf.zeros((), x.dtype))

    def round(self, x: Any) -> tf.Tensor:
        return tf.round(x)  # banker's rounding, like numpy and torch

    def floor(self, x: Any) -> tf.Tensor:
        return tf.floor(x)

    def clip(self, x: Any, lo: float, hi: float) -> tf.Tensor:
        return tf.clip_by_value(x, tf.cast(lo, x.dtype), tf.cast(hi, x.dtype))

    def where(self, cond: Any, a: Any, b: Any) -> tf.Tensor:
        ref = a if tf.is_tensor(a) else b
        a = a if tf.is_tensor(a) else tf.cast(a, ref.dtype)
        b = b if tf.is_tensor(b) else tf.cast(b, ref.dtype)
        return tf.where(cond, a, b)

    def isfinite(self, x: Any) -> tf.Tensor:
        return tf.math.is_finite(x)

    def isnan(self, x: Any) -> tf.Tensor:
        return tf.math.is_nan(x)

    def all(self, x: Any, axis: int) -> tf.Tensor:
        return tf.reduce_all(x, axis=axis)

    def logical_and(self, a: Any, b: Any) -> tf.Tensor:
        return tf.logical_and(a, b)

    def logical_not(self, a: Any) -> tf.Tensor:
        return tf.logical_not(a)

    def bitcast(self, x: Any, dtype: str) -> tf.Tensor:
        # tf.bitcast adds (wider -> narrower) or consumes (narrower -> wider) a trailing axis;
        # fold it into the last axis so the result matches numpy's ``view`` along that axis.
        target = tf_dtype(dtype)
        src_size, dst_size = tf.as_dtype(x.dtype).size, target.size
        shape = self.shape(x)
        if src_size == dst_size:
            return tf.bitcast(x, target)
        if src_size > dst_size:
            out = tf.bitcast(x, target)
            return tf.reshape(out, shape[:-1] + (shape[-1] * (src_size // dst_size),))
        ratio = dst_size // src_size
        return tf.bitcast(tf.reshape(x, shape[:-1] + (shape[-1] // ratio, ratio)), target)

    def uniform(self, shape: Shape, seed: Any, like: Optional[Any] = None) -> tf.Tensor:
        # A Seed's step may be the traced step counter: fresh noise every step, with the same
        # graph. A plain int seed (codec tests) is split into two 31-bit words.
        if isinstance(seed, Seed):
            words = [tf.constant(seed.base & 0x7FFFFFFF, tf.int64), tf.cast(seed.step, tf.int64)]
        else:
            value = int(seed) & 0x7FFFFFFFFFFFFFFF
            words = [tf.constant(value & 0x7FFFFFFF, tf.int64), tf.constant((value >> 31) & 0x7FFFFFFF, tf.int64)]
        return tf.random.stateless_uniform(shape, seed=tf.stack(words), dtype=tf.float32)

    def new_state(self, value: Any) -> tf.Variable:
        # Created outside any trace (init_scope) with a static shape, then assigned in place, so
        # this works eagerly and on the first trace of a tf.function alike.
        value = tf.convert_to_tensor(value)
        with tf.init_scope():
            state = tf.Variable(tf.zeros(value.shape, value.dtype), trainable=False,
                                name="pipesgd_state")
        state.assign(value)
        return state

    def assign(self, state: Any, value: Any) -> Any:
        state.assign(value)
        return state

    def read(self, state: Any) -> tf.Tensor:
        return state.read_value() if isinstance(state, tf.Variable) else tf.convert_to_tensor(state)

    def assign_scaled(self, state: Any, x: Any, scale: Any, accumulate: bool = False) -> Any:
        if accumulate:
            state.assign_add(x * scale)
        else:
            state.assign(x * scale)
        return state

    def kernel_address(self, x: Any) -> Optional[int]:
        # A graph tensor has no address, and TensorFlow owns its buffers: CPU tensors reach the
        # kernels through tf_kernels (kernel_device below), eager or traced alike.
        return None

    def record_use(self, x: Any) -> None:
        return None  # TensorFlow orders its own streams

    def kernel_device(self, x: Any) -> Optional[str]:
        # GPU tensors keep the composition: a numpy_function would copy them to the host and back.
        if not self.fused or self.dtype_name(x) not in ("float32", "uint8") or not _on_cpu(x):
            return None
        return "tensorflow"

    def move_like(self, x: Any, like: Optional[Any]) -> Any:
        return x  # TensorFlow places each op itself

    def host_array(self, x: Any) -> np.ndarray:
        return np.array(x.numpy())

    def device_seconds(self, like: Any, work: Callable[[], Any]) -> Tuple[Any, Optional[float]]:
        return work(), None  # the auto mode keeps the process's CPU time here

    def to_numpy(self, x: Any) -> np.ndarray:
        return x.numpy()

    def from_numpy(self, a: np.ndarray, like: Optional[Any] = None) -> tf.Tensor:
        return tf.convert_to_tensor(a)
