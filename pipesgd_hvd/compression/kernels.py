"""The fused kernels the codecs call, by where a tensor lives: one pass over memory per call.

Host buffers go to the C kernels (``host_kernels.py``). A tensor whose table names a device of its
own (``TensorOps.kernel_device``) goes to that device's kernels (``device_kernels.load``): CUDA
tensors to the Triton twins of the C kernels (``triton_kernels.py``) when Triton is importable,
TensorFlow CPU tensors, which have no address inside a graph, to ``tf_kernels.py``, which runs the
C kernels on numpy views of them inside ``tf.numpy_function``.

Each function returns ``None`` when no kernel can take the call (the extension was not built, a
CUDA tensor without Triton, a layout a device has no kernel for, a table built with
``fused=False``): the codec then runs its unfused tensor-op composition, the reference every
kernel is tested against bit for bit (tests/test_codec_kernels.py, tests/test_device_kernels.py,
tests/test_tf_kernels.py).

Imports go one way: this module -> ``device_kernels`` -> a device module -> ``host_kernels``; no
kernel module imports this one.
"""
from __future__ import annotations

import warnings
from types import ModuleType
from typing import Optional, Tuple

from ..ops.base import Tensor, TensorOps
from . import device_kernels, host_kernels
from .host_kernels import UNAVAILABLE, Kind, available, row_bytes

# Names of the cast layouts in the device kernels' interface. A device module lists those it
# has in ``CAST_KINDS``: triton_kernels the 16-bit ones, tf_kernels (which runs the host
# kernels) all four. Decoders take ``bf16``: whether the values are a float32's upper bytes
# (a bfloat16 or a truncation; 2 or 3 bytes each, as the payload's row length says) or float16.
_DEVICE_CAST_LAYOUTS = {Kind.FP16: "fp16", Kind.BF16: "bf16", Kind.TRUNC16: "truncate16",
                        Kind.TRUNC24: "truncate24"}
_16BIT_LAYOUTS = ("fp16", "bf16", "truncate16")


def accepts(ops: TensorOps, x: Tensor) -> bool:
    """Whether the kernels can encode ``x`` (a float32 tensor of a table that allows them: on the
    host, or on a device that has kernels of its own)."""
    return ops.dtype_name(x) == "float32" and (device_module(ops, x) is not None or host_kernels.usable(ops, x))


def device_module(ops: TensorOps, x: Tensor) -> Optional[ModuleType]:
    """The device kernels for ``x`` (the Triton module for CUDA tensors, tf_kernels for TensorFlow
    CPU tensors), or None: host or reference."""
    device = ops.kernel_device(x)
    if device is None:
        return None
    if device == "tensorflow" and not host_kernels.available():  # they run the host kernels, which are not built
        warnings.warn(UNAVAILABLE or "pipesgd_hvd's fused codec kernels are not loaded", RuntimeWarning, stacklevel=3)
        return None
    return device_kernels.load(device)


def _device_layout(device: ModuleType, kind: Kind) -> Optional[str]:
    """``device``'s name for the cast layout ``kind``, or None where it has no kernel for it (the
    reference runs). A module that lists no ``CAST_KINDS`` has the 16-bit layouts."""
    layout = _DEVICE_CAST_LAYOUTS.get(kind)
    return layout if layout in getattr(device, "CAST_KINDS", _16BIT_LAYOUTS) else None


def quantize_encode(ops: TensorOps, x: Tensor, *, width: int, bits: int, noise: Optional[Tensor] = None,
                    residual: Optional[Tensor] = None, error_feedback: bool = False,
                    overwrite_residual: bool = True) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """Quantize float32 rows ``x`` (``x + residual`` when given) -> ``(payload, new_residual)``
    (``host_kernels.quantize_encode`` says where the new residual goes)."""
    device = device_module(ops, x)
    if device is not None and ops.dtype_name(x) == "float32":
        return device.quantize_encode(x, width=width, bits=bits, noise=noise, residual=residual,
                                      error_feedback=error_feedback)
    return host_kernels.quantize_encode(ops, x, width=width, bits=bits, noise=noise, residual=residual,
                                        error_feedback=error_feedback, overwrite_residual=overwrite_residual)


def cast_encode(ops: TensorOps, x: Tensor, kind: Kind) -> Optional[Tensor]:
    """float32 rows -> uint8 rows of float16 / bfloat16 / the upper 2 or 3 bytes of each value."""
    device = device_module(ops, x)
    if device is not None:  # a layout the device has no kernel for (Triton: TRUNC24) runs the reference
        layout = _device_layout(device, kind)
        return device.cast_encode(x, layout=layout) if layout and ops.dtype_name(x) == "float32" else None
    return host_kernels.cast_encode(ops, x, kind)


def decode(ops: TensorOps, payload: Tensor, kind: Kind, *, cols: int, width: int = 0,
           bits: int = 0) -> Optional[Tensor]:
    """uint8 rows -> float32 rows ``[rows, cols]``."""
    device = device_module(ops, payload)
    if device is not None:
        if kind == Kind.QUANTIZE:
            return device.quantize_decode(payload, cols=cols, width=width, bits=bits)
        if _device_layout(device, kind):
            return device.cast_decode(payload, cols=cols, bf16=kind != Kind.FP16)
        return None
    return host_kernels.decode(ops, payload, kind, cols=cols, width=width, bits=bits)


def decode_sum(ops: TensorOps, payload: Tensor, kind: Kind, *, cols: int, scale: float, width: int = 0,
               bits: int = 0) -> Optional[Tensor]:
    """uint8 rows -> ``[1, cols]`` float32: ``((0 + row0) + row1) + ...`` in rank order, then
    ``* scale`` unless it is 1 (float32 arithmetic, the reference's order of operations)."""
    device = device_module(ops, payload)
    if device is not None:
        if kind == Kind.QUANTIZE:
            return device.quantize_decode_sum(payload, cols=cols, width=width, bits=bits, scale=scale)
        if _device_layout(device, kind):
            return device.cast_decode_sum(payload, cols=cols, bf16=kind != Kind.FP16, scale=scale)
        return None
    return host_kernels.decode_sum(ops, payload, kind, cols=cols, scale=scale, width=width, bits=bits)


__all__ = ["Kind", "UNAVAILABLE", "accepts", "available", "cast_encode", "decode", "decode_sum", "quantize_encode",
           "row_bytes"]
