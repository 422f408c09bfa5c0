"""Fused host kernels of the byte codecs (``_kernels.c``): one pass over memory per call.

A quantizer written as tensor ops makes about ten passes over a bucket (abs, max, divide, round,
clip, cast, pack, and as many again to decode for error feedback); each pass costs what a plain
copy costs, and on a fast link one pass costs as much as sending the bucket. The kernels do
encode-with-error-feedback in one read of the gradient and the residual, and decode+sum of N
received rows in one read of the codes.

Each function here returns ``None`` when the kernels cannot take the call: the extension was not
built, or a tensor is not a C-contiguous host buffer of the expected dtype (a CUDA tensor without
Triton, a TensorFlow GPU tensor, a table built with ``fused=False``). The codec then runs its unfused
tensor-op composition, which is the reference the kernels are tested against bit for bit
(tests/test_codec_kernels.py). Written once for every table: the only per-framework pieces are
``TensorOps.kernel_address`` and ``TensorOps.kernel_device`` (CUDA tensors go to the Triton
twins of these kernels, ``triton_kernels.py``, when Triton is importable; TensorFlow CPU tensors,
which have no address inside a graph, to ``tf_kernels.py``, which calls these
functions on numpy views of them inside ``tf.numpy_function``).
"""
from __future__ import annotations

import enum
import warnings
from pathlib import Path
from types import ModuleType
from typing import List, Optional, Sequence, Tuple

from ..ops.base import Shape, Tensor, TensorOps
from . import device_kernels

try:
    from . import _kernels as _native
    UNAVAILABLE: Optional[str] = None
except ImportError as exc:  # no compiler at install time: the codecs run the tensor-op reference
    _native = None
    # A missing module reads as a "circular import" here; only a file that fails to load says more.
    built = list(Path(__file__).parent.glob("_kernels.*"))
    UNAVAILABLE = ("pipesgd_hvd's fused codec kernels (compression/_kernels.c) are not "
                   + (f"loadable ({exc})" if any(p.suffix != ".c" for p in built) else "built")
                   + ", so host codecs run their unfused tensor ops (several times slower): build them "
                   "with `pip install --no-build-isolation -e .` or `python setup.py build_ext --inplace`")


class Kind(enum.IntEnum):
    """Codec layouts the kernels know (numbered as in ``_kernels.c``)."""

    QUANTIZE = -1
    FP16 = 0
    BF16 = 1
    TRUNC16 = 2
    TRUNC24 = 3
    FP16_SOFT = 4  # float16 by the portable conversion (FP16 uses F16C where the CPU has it)


# bytes per value of each cast/truncation layout; the alignment their payload rows need
_CAST_BYTES = {Kind.FP16: 2, Kind.BF16: 2, Kind.TRUNC16: 2, Kind.TRUNC24: 3, Kind.FP16_SOFT: 2}
_ALIGN = {"float32": 4, "uint8": 1}
# Names of the cast layouts in the device kernels' interface. A device module lists those it
# has in ``CAST_KINDS``: triton_kernels the 16-bit ones, tf_kernels (which runs these
# host kernels) all four. Decoders take ``bf16``: whether the values are a float32's upper bytes
# (a bfloat16 or a truncation; 2 or 3 bytes each, as the payload's row length says) or float16.
_DEVICE_CAST_LAYOUTS = {Kind.FP16: "fp16", Kind.BF16: "bf16", Kind.TRUNC16: "truncate16",
                        Kind.TRUNC24: "truncate24"}
_16BIT_LAYOUTS = ("fp16", "bf16", "truncate16")


def available() -> bool:
    """Whether the compiled kernels are importable (``UNAVAILABLE`` says why not)."""
    return _native is not None


def _usable(ops: TensorOps, x: Tensor) -> bool:
    """Whether the table offers ``x`` to the kernels and they are built (warns once if not)."""
    if ops.kernel_address(x) is None:
        return False
    if _native is None:
        warnings.warn(UNAVAILABLE or "pipesgd_hvd's fused codec kernels are not loaded: host codecs run "
                      "their unfused tensor ops", RuntimeWarning, stacklevel=3)
        return False
    return True


def accepts(ops: TensorOps, x: Tensor) -> bool:
    """Whether the kernels can encode ``x`` (a float32 tensor of a table that allows them: on the
    host, or on a device that has kernels of its own)."""
    return ops.dtype_name(x) == "float32" and (device_module(ops, x) is not None or _usable(ops, x))


def device_module(ops: TensorOps, x: Tensor) -> Optional[ModuleType]:
    """The device kernels for ``x`` (the Triton module for CUDA tensors, tf_kernels for TensorFlow
    CPU tensors), or None: host or reference."""
    device = ops.kernel_device(x)
    if device is None:
        return None
    if device == "tensorflow" and _native is None:  # they run these host kernels, which are not built
        warnings.warn(UNAVAILABLE or "pipesgd_hvd's fused codec kernels are not loaded", RuntimeWarning, stacklevel=3)
        return None
    return device_kernels.load(device)


def _device_layout(device: ModuleType, kind: Kind) -> Optional[str]:
    """``device``'s name for the cast layout ``kind``, or None where it has no kernel for it (the
    reference runs). A module that lists no ``CAST_KINDS`` has the 16-bit layouts."""
    layout = _DEVICE_CAST_LAYOUTS.get(kind)
    return layout if layout in getattr(device, "CAST_KINDS", _16BIT_LAYOUTS) else None


def row_bytes(kind: Kind, cols: int, width: int, bits: int) -> int:
    """Payload bytes of one row of ``cols`` values."""
    if kind == Kind.QUANTIZE:
        return 4 * (cols // width) + (cols if bits == 8 else cols // 2)
    return cols * _CAST_BYTES[kind]


def _address(ops: TensorOps, x: Tensor, dtype: str, shape: Shape, align: int = 0) -> Optional[int]:
    if ops.dtype_name(x) != dtype or ops.shape(x) != shape:
        return None
    address = ops.kernel_address(x)
    if address is None or address % (align or _ALIGN[dtype]):
        return None
    return address


def _addresses(ops: TensorOps, specs: Sequence[Tuple[Optional[Tensor], str, Shape]]) -> Optional[List[int]]:
    """Addresses of every given tensor (0 for None), or None if any of them cannot be used."""
    if not specs or specs[0][0] is None or not _usable(ops, specs[0][0]):
        return None
    out = []
    for x, dtype, shape in specs:
        if x is None:
            out.append(0)
            continue
        address = _address(ops, x, dtype, shape)
        if address is None:
            return None
        out.append(address)
    return out


def _empty(ops: TensorOps, shape: Shape, dtype: str, like: Tensor) -> Tuple[Tensor, int]:
    out = ops.empty(shape, dtype, like=like)  # type: ignore[attr-defined]  # host tables are mutable
    return out, ops.kernel_address(out)


def quantize_encode(ops: TensorOps, x: Tensor, *, width: int, bits: int, noise: Optional[Tensor] = None,
                    residual: Optional[Tensor] = None, error_feedback: bool = False,
                    overwrite_residual: bool = True) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """Quantize float32 rows ``x`` (``x + residual`` when given) -> ``(payload, new_residual)``.

    With ``error_feedback`` the new residual ``y - decode(encode(y))`` (non-finite values set to 0)
    is written into ``residual`` in place, or into a new tensor when ``residual`` is None or
    ``overwrite_residual`` is False (tf_kernels: ``residual`` is a view of TensorFlow's memory).
    """
    device = device_module(ops, x)
    if device is not None and ops.dtype_name(x) == "float32":
        return device.quantize_encode(x, width=width, bits=bits, noise=noise, residual=residual,
                                      error_feedback=error_feedback)
    rows, cols = shape = ops.shape(x)
    addresses = _addresses(ops, [(x, "float32", shape), (residual, "float32", shape), (noise, "float32", shape)])
    if addresses is None:
        return None
    x_at, r_at, noise_at = addresses
    payload, payload_at = _empty(ops, (rows, row_bytes(Kind.QUANTIZE, cols, width, bits)), "uint8", x)
    new_residual, out_at = None, 0
    if error_feedback:
        in_place = residual is not None and overwrite_residual
        new_residual, out_at = (residual, r_at) if in_place else _empty(ops, shape, "float32", x)
    _native.quantize_encode(x_at, r_at, out_at, noise_at, payload_at, rows, cols, width, bits)
    return payload, new_residual


def cast_encode(ops: TensorOps, x: Tensor, kind: Kind) -> Optional[Tensor]:
    """float32 rows -> uint8 rows of float16 / bfloat16 / the upper 2 or 3 bytes of each value."""
    device = device_module(ops, x)
    if device is not None:  # a layout the device has no kernel for (Triton: TRUNC24) runs the reference
        layout = _device_layout(device, kind)
        return device.cast_encode(x, layout=layout) if layout and ops.dtype_name(x) == "float32" else None
    rows, cols = shape = ops.shape(x)
    addresses = _addresses(ops, [(x, "float32", shape)])
    if addresses is None:
        return None
    payload, payload_at = _empty(ops, (rows, cols * _CAST_BYTES[kind]), "uint8", x)
    _native.cast_encode(int(kind), addresses[0], rows * cols, payload_at)
    return payload


def _payload_address(ops: TensorOps, payload: Tensor, kind: Kind, cols: int, width: int,
                     bits: int) -> Optional[int]:
    if len(ops.shape(payload)) != 2 or not _usable(ops, payload):
        return None
    rows = ops.shape(payload)[0]
    # 16-bit layouts are read as uint16: their rows (2 * cols bytes) must start on even addresses
    align = 2 if _CAST_BYTES.get(kind) == 2 else 1
    return _address(ops, payload, "uint8", (rows, row_bytes(kind, cols, width, bits)), align)


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
    at = _payload_address(ops, payload, kind, cols, width, bits)
    if at is None:
        return None
    rows = ops.shape(payload)[0]
    out, out_at = _empty(ops, (rows, cols), "float32", payload)
    _native.decode(int(kind), bits, at, rows, cols, width, out_at)
    return out


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
    at = _payload_address(ops, payload, kind, cols, width, bits)
    if at is None or ops.shape(payload)[0] < 1:
        return None
    out, out_at = _empty(ops, (1, cols), "float32", payload)
    _native.decode_sum(int(kind), bits, at, ops.shape(payload)[0], cols, width, out_at, float(scale))
    return out


__all__ = ["Kind", "UNAVAILABLE", "accepts", "available", "cast_encode", "decode", "decode_sum", "quantize_encode",
           "row_bytes"]
