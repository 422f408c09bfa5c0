"""Fused host kernels of the byte codecs (``_kernels.c``): one pass over memory per call.

A quantizer written as tensor ops makes about ten passes over a bucket (abs, max, divide, round,
clip, cast, pack, and as many again to decode for error feedback); each pass costs what a plain
copy costs, and on a fast link one pass costs as much as sending the bucket. The kernels do
encode-with-error-feedback in one read of the gradient and the residual, and decode+sum of N
received rows in one read of the codes.

Each function here returns ``None`` when the kernels cannot take the call: the extension was not
built, or a tensor is not a C-contiguous host buffer of the expected dtype (a table built with
``fused=False``, a tensor without an address). The codec then runs its unfused tensor-op
composition, which is the reference the kernels are tested against bit for bit
(tests/test_codec_kernels.py). Written once for every table: the per-framework piece is
``TensorOps.kernel_address``.

The codecs call ``kernels.py``, which sends a tensor with a device of its own to that device's
kernels and every other one here. This module sits below both: ``tf_kernels.py`` runs these
functions on numpy views of TensorFlow's CPU buffers, and imports nothing that imports it.
"""
from __future__ import annotations

import enum
import warnings
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ..ops.base import Shape, Tensor, TensorOps

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


def available() -> bool:
    """Whether the compiled kernels are importable (``UNAVAILABLE`` says why not)."""
    return _native is not None


def usable(ops: TensorOps, x: Tensor) -> bool:
    """Whether the table offers ``x`` to the kernels and they are built (warns once if not)."""
    if ops.kernel_address(x) is None:
        return False
    if _native is None:
        warnings.warn(UNAVAILABLE or "pipesgd_hvd's fused codec kernels are not loaded: host codecs run "
                      "their unfused tensor ops", RuntimeWarning, stacklevel=3)
        return False
    return True


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
    if not specs or specs[0][0] is None or not usable(ops, specs[0][0]):
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
    rows, cols = shape = ops.shape(x)
    addresses = _addresses(ops, [(x, "float32", shape)])
    if addresses is None:
        return None
    payload, payload_at = _empty(ops, (rows, cols * _CAST_BYTES[kind]), "uint8", x)
    _native.cast_encode(int(kind), addresses[0], rows * cols, payload_at)
    return payload


def _payload_address(ops: TensorOps, payload: Tensor, kind: Kind, cols: int, width: int,
                     bits: int) -> Optional[int]:
    if len(ops.shape(payload)) != 2 or not usable(ops, payload):
        return None
    rows = ops.shape(payload)[0]
    # 16-bit layouts are read as uint16: their rows (2 * cols bytes) must start on even addresses
    align = 2 if _CAST_BYTES.get(kind) == 2 else 1
    return _address(ops, payload, "uint8", (rows, row_bytes(kind, cols, width, bits)), align)


def decode(ops: TensorOps, payload: Tensor, kind: Kind, *, cols: int, width: int = 0,
           bits: int = 0) -> Optional[Tensor]:
    """uint8 rows -> float32 rows ``[rows, cols]``."""
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
    at = _payload_address(ops, payload, kind, cols, width, bits)
    if at is None or ops.shape(payload)[0] < 1:
        return None
    out, out_at = _empty(ops, (1, cols), "float32", payload)
    _native.decode_sum(int(kind), bits, at, ops.shape(payload)[0], cols, width, out_at, float(scale))
    return out


__all__ = ["Kind", "UNAVAILABLE", "available", "cast_encode", "decode", "decode_sum", "quantize_encode", "row_bytes",
           "usable"]
