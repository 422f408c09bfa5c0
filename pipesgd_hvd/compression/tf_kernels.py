"""The fused host kernels (``compression/_kernels.c``) for TensorFlow CPU tensors, eager or traced.

Inside ``tf.function`` a tensor has no address, so ``kernel_address`` cannot offer it to the
kernels, and the codecs' tensor-op composition makes a dozen passes over a bucket (12-45 plain
copies per encode+decode, docs/benchmarks.md "codec_speed"). Here each kernel call becomes one
``tf.numpy_function``: TensorFlow hands the function numpy views of its CPU buffers (no copy), the
function runs ``compression/host_kernels.py`` with the numpy table, and the kernels release the GIL
while they run. Shapes are static (``host_kernels.row_bytes``), so the traced graph keeps its shapes.

This module has the interface of the device kernels (``compression/triton_kernels.py``) that
``device_kernels.load("tensorflow")`` returns, for the float32 and uint8 tensors that
``TensorFlowOps.kernel_device`` names as TensorFlow CPU tensors, when the kernels are built. The bits are those of the host
kernels, which equal the reference's (tests/test_tf_kernels.py). What differs from the host path:

* the residual is an input TensorFlow owns (a variable's value), so the new residual is a new
  tensor, never written in place; ``ErrorFeedback`` assigns it to its variable;
* outputs are allocated 64-byte aligned, so TensorFlow adopts them instead of copying them.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ..ops.base import Shape
from ..ops.numpy import NumpyOps
from . import host_kernels
from .host_kernels import Kind

# The cast layouts here: all the host kernels have (kernels.py's _DEVICE_CAST_LAYOUTS names them).
CAST_KINDS = {"fp16": Kind.FP16, "bf16": Kind.BF16, "truncate16": Kind.TRUNC16, "truncate24": Kind.TRUNC24}
# TensorFlow wraps a numpy_function's output without a copy only if its data is aligned to
# EIGEN_MAX_ALIGN_BYTES (64 at most); a large numpy array sits 16 bytes past a page (malloc's header).
_ALIGN = 64


class _AlignedNumpyOps(NumpyOps):
    """The numpy table, with new arrays on 64-byte boundaries (see ``_ALIGN``)."""

    def empty(self, shape: Shape, dtype: str, like: Optional[np.ndarray] = None) -> np.ndarray:
        dt = np.dtype(dtype)  # the kernels allocate float32 and uint8 only
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        raw = np.empty(nbytes + _ALIGN, np.uint8)
        start = -raw.ctypes.data % _ALIGN
        return raw[start:start + nbytes].view(dt).reshape(shape)


_HOST = _AlignedNumpyOps()


def _host(a: np.ndarray) -> np.ndarray:
    """``a`` as the kernels take it: C-contiguous, on a 4-byte boundary (float32 values, 16-bit
    codes). TensorFlow's CPU buffers are, so this copies nothing in practice; without it, a buffer
    that is not would fail the step instead of costing a copy."""
    if a.flags.c_contiguous and a.ctypes.data % 4 == 0:
        return a
    out = _HOST.empty(a.shape, a.dtype.name)
    out[...] = a
    return out


def _shape(x: Any) -> Tuple[int, int]:
    rows, cols = (int(d) for d in x.shape)
    return rows, cols


def _run(fn: Callable[..., List[np.ndarray]], inputs: Sequence[Any], outputs: Sequence[Tuple[tf.DType, Shape]],
         name: str) -> List[tf.Tensor]:
    """``fn`` on numpy views of ``inputs``, as one op of the graph (or eagerly), with static shapes."""
    # stateful=False: a pure function of its inputs. A stateful op would also be chained, in
    # program order, to the step's other stateful ops by automatic control dependencies, and the
    # stale reduction would no longer overlap the forward and backward pass (tf_pipeline.py).
    got = tf.numpy_function(fn, list(inputs), [dtype for dtype, _ in outputs], stateful=False,
                            name=f"pipesgd_{name}")
    got = list(got) if isinstance(got, (list, tuple)) else [got]  # one output comes back bare
    for tensor, (_, shape) in zip(got, outputs):
        tensor.set_shape(shape)
    return got


def _fused(result: Optional[Any], what: str) -> Any:
    # host_kernels.py declines only tensors of the wrong dtype, shape or alignment; these are TensorFlow
    # CPU buffers of the shapes set above, so a None is a bug here, not a case for the reference.
    if result is None:
        raise RuntimeError(f"pipesgd_hvd: the host kernels declined {what} for a TensorFlow CPU tensor")
    return result


def quantize_encode(x: Any, *, width: int, bits: int, noise: Optional[Any] = None, residual: Optional[Any] = None,
                    error_feedback: bool = False) -> Tuple[tf.Tensor, Optional[tf.Tensor]]:
    """The contract of ``host_kernels.quantize_encode``; the new residual is always a new tensor."""
    rows, cols = _shape(x)
    has_residual, has_noise = residual is not None, noise is not None

    def run(x_np: np.ndarray, *rest: np.ndarray) -> List[np.ndarray]:
        x_np, extra = _host(x_np), iter(_host(a) for a in rest)
        r_np = next(extra) if has_residual else None
        n_np = next(extra) if has_noise else None
        encoded = host_kernels.quantize_encode(_HOST, x_np, width=width, bits=bits, noise=n_np, residual=r_np,
                                               error_feedback=error_feedback, overwrite_residual=False)
        payload, new = _fused(encoded, "quantize_encode")
        return [payload, new] if error_feedback else [payload]

    outputs = [(tf.uint8, (rows, host_kernels.row_bytes(Kind.QUANTIZE, cols, width, bits)))]
    outputs += [(tf.float32, (rows, cols))] if error_feedback else []
    inputs = [x] + [t for t in (residual, noise) if t is not None]
    got = _run(run, inputs, outputs, f"int{bits}_encode")
    return got[0], (got[1] if error_feedback else None)


def cast_encode(x: Any, *, layout: str) -> tf.Tensor:
    rows, cols = _shape(x)
    kind = CAST_KINDS[layout]

    def run(x_np: np.ndarray) -> List[np.ndarray]:
        return [_fused(host_kernels.cast_encode(_HOST, _host(x_np), kind), f"{layout} encode")]

    return _run(run, [x], [(tf.uint8, (rows, host_kernels.row_bytes(kind, cols, 0, 0)))], f"{layout}_encode")[0]


def _cast_kind(payload: Any, cols: int, bf16: bool) -> Kind:
    """The layout of rows of ``cols`` values: float16, or a float32's upper 2 or 3 bytes."""
    if not bf16:
        return Kind.FP16
    return Kind.TRUNC24 if _shape(payload)[1] == 3 * cols else Kind.BF16  # truncate16 decodes as bf16


def quantize_decode(payload: Any, *, cols: int, width: int, bits: int) -> tf.Tensor:
    def run(p: np.ndarray) -> List[np.ndarray]:
        return [_fused(host_kernels.decode(_HOST, _host(p), Kind.QUANTIZE, cols=cols, width=width, bits=bits),
                       "decode")]

    return _run(run, [payload], [(tf.float32, (_shape(payload)[0], cols))], f"int{bits}_decode")[0]


def quantize_decode_sum(payload: Any, *, cols: int, width: int, bits: int, scale: float) -> tf.Tensor:
    def run(p: np.ndarray) -> List[np.ndarray]:
        total = host_kernels.decode_sum(_HOST, _host(p), Kind.QUANTIZE, cols=cols, scale=scale, width=width, bits=bits)
        return [_fused(total, "decode_sum")]

    return _run(run, [payload], [(tf.float32, (1, cols))], f"int{bits}_decode_sum")[0]


def cast_decode(payload: Any, *, cols: int, bf16: bool) -> tf.Tensor:
    kind = _cast_kind(payload, cols, bf16)

    def run(p: np.ndarray) -> List[np.ndarray]:
        return [_fused(host_kernels.decode(_HOST, _host(p), kind, cols=cols), "decode")]

    return _run(run, [payload], [(tf.float32, (_shape(payload)[0], cols))], f"{kind.name.lower()}_decode")[0]


def cast_decode_sum(payload: Any, *, cols: int, bf16: bool, scale: float) -> tf.Tensor:
    kind = _cast_kind(payload, cols, bf16)

    def run(p: np.ndarray) -> List[np.ndarray]:
        return [_fused(host_kernels.decode_sum(_HOST, _host(p), kind, cols=cols, scale=scale), "decode_sum")]

    return _run(run, [payload], [(tf.float32, (1, cols))], f"{kind.name.lower()}_decode_sum")[0]
