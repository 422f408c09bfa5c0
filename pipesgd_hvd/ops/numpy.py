"""TensorOps for numpy arrays: host buffers (mpi4py) and reference simulations (benchmarks)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional, Sequence, Tuple

import numpy as np

from .base import Shape
from .seeds import eager_seed


def _np_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        import ml_dtypes  # numpy has no bfloat16 of its own; ml_dtypes ships with TensorFlow and JAX

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


class NumpyOps:
    name = "numpy"

    def __init__(self, fused: bool = True) -> None:
        self.fused = fused  # False: codecs run their unfused tensor-op reference (the tests' baseline)

    def dtype_name(self, x: np.ndarray) -> str:
        return "bfloat16" if x.dtype.name == "bfloat16" else x.dtype.name

    def shape(self, x: np.ndarray) -> Shape:
        return tuple(x.shape)

    def numel(self, x: np.ndarray) -> int:
        return int(x.size)

    def zeros(self, shape: Shape, dtype: str, like: Optional[np.ndarray] = None) -> np.ndarray:
        return np.zeros(shape, dtype=_np_dtype(dtype))

    def empty(self, shape: Shape, dtype: str, like: Optional[np.ndarray] = None) -> np.ndarray:
        return np.empty(shape, dtype=_np_dtype(dtype))

    def full(self, shape: Shape, value: float, dtype: str, like: Optional[np.ndarray] = None) -> np.ndarray:
        return np.full(shape, value, dtype=_np_dtype(dtype))

    def cast(self, x: np.ndarray, dtype: str) -> np.ndarray:
        return x.astype(_np_dtype(dtype), copy=False)

    def reshape(self, x: np.ndarray, shape: Shape) -> np.ndarray:
        return np.reshape(x, shape)

    def concat(self, xs: Sequence[np.ndarray], axis: int = 0) -> np.ndarray:
        return np.concatenate(list(xs), axis=axis)

    def stack(self, xs: Sequence[np.ndarray], axis: int) -> np.ndarray:
        return np.stack(list(xs), axis=axis)

    def sum(self, x: np.ndarray, axis: int, keepdims: bool = False) -> np.ndarray:
        return np.sum(x, axis=axis, keepdims=keepdims, dtype=x.dtype)

    def abs(self, x: np.ndarray) -> np.ndarray:
        return np.abs(x)

    def amax(self, x: np.ndarray, axis: int) -> np.ndarray:
        return np.max(x, axis=axis)

    def amax_abs(self, x: np.ndarray, axis: int) -> np.ndarray:
        return np.max(np.abs(x), axis=axis)

    def to_levels(self, x: np.ndarray, divisor: np.ndarray, levels: float, offset: float,
                  noise: Optional[np.ndarray] = None) -> np.ndarray:
        y = x / divisor
        y *= np.float32(levels)
        if noise is None:
            np.round(y, out=y)
        else:
            y += noise
            np.floor(y, out=y)
        y += np.float32(offset)
        return np.clip(y, offset - levels, offset + levels, out=y)

    def from_levels(self, codes: np.ndarray, scale: np.ndarray, levels: float, offset: float) -> np.ndarray:
        y = codes.astype(np.float32)
        y -= np.float32(offset)
        y /= np.float32(levels)
        y *= scale
        return y

    def finite_or_zero(self, x: np.ndarray) -> np.ndarray:
        return np.where(np.isfinite(x), x, np.zeros((), x.dtype))

    def round(self, x: np.ndarray) -> np.ndarray:
        return np.round(x)

    def floor(self, x: np.ndarray) -> np.ndarray:
        return np.floor(x)

    def clip(self, x: np.ndarray, lo: float, hi: float) -> np.ndarray:
        return np.clip(x, lo, hi).astype(x.dtype, copy=False)

    def where(self, cond: np.ndarray, a: Any, b: Any) -> np.ndarray:
        out = np.where(cond, a, b)
        ref = a if isinstance(a, np.ndarray) else b
        return out.astype(ref.dtype, copy=False) if isinstance(ref, np.ndarray) else out

    def isfinite(self, x: np.ndarray) -> np.ndarray:
        return np.isfinite(x)

    def isnan(self, x: np.ndarray) -> np.ndarray:
        return np.isnan(x)

    def all(self, x: np.ndarray, axis: int) -> np.ndarray:
        return np.all(x, axis=axis)

    def logical_and(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.logical_and(a, b)

    def logical_not(self, a: np.ndarray) -> np.ndarray:
        return np.logical_not(a)

    def bitcast(self, x: np.ndarray, dtype: str) -> np.ndarray:
        return np.ascontiguousarray(x).view(_np_dtype(dtype))

    def uniform(self, shape: Shape, seed: Any, like: Optional[np.ndarray] = None) -> np.ndarray:
        return np.random.default_rng(eager_seed(seed)).random(shape, dtype=np.float32)

    def new_state(self, value: np.ndarray) -> np.ndarray:
        return np.array(value, copy=True)

    def assign(self, state: np.ndarray, value: np.ndarray) -> np.ndarray:
        state[...] = value
        return state

    def read(self, state: np.ndarray) -> np.ndarray:
        return state

    def assign_scaled(self, state: np.ndarray, x: np.ndarray, scale: Any, accumulate: bool = False) -> np.ndarray:
        if accumulate:
            return np.add(state, x * scale, out=state)
        return np.multiply(x, scale, out=state)

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return x

    def from_numpy(self, a: np.ndarray, like: Optional[np.ndarray] = None) -> np.ndarray:
        return a

    def kernel_address(self, x: np.ndarray) -> Optional[int]:
        if not self.fused or not x.flags.c_contiguous:
            return None
        return int(x.ctypes.data)

    def copy_into_(self, dst: np.ndarray, offset: int, src: np.ndarray) -> None:
        dst[offset:offset + src.size] = np.ravel(src)

    def fill_(self, dst: np.ndarray, offset: int, numel: int, value: float) -> None:
        dst[offset:offset + numel] = value

    def view(self, flat: np.ndarray, offset: int, numel: int, shape: Shape) -> np.ndarray:
        return flat[offset:offset + numel].reshape(shape)

    def record_use(self, x: np.ndarray) -> None:
        return None

    def kernel_device(self, x: np.ndarray) -> Optional[str]:
        return None  # host arrays: the host kernels

    def host_array(self, x: np.ndarray) -> np.ndarray:
        return np.array(x)

    def move_like(self, x: np.ndarray, like: Optional[np.ndarray]) -> np.ndarray:
        return x

    def device_seconds(self, like: np.ndarray, work: Callable[[], Any]) -> Tuple[Any, Optional[float]]:
        return work(), None

    def stream_guard(self, like: Optional[np.ndarray] = None) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def ready_marker(self, like: np.ndarray) -> Any:
        return None

    def wait_marker(self, marker: Any) -> None:
        return None


NUMPY_OPS = NumpyOps()
