"""Fused GPU kernels of the byte codecs, in Triton: the CUDA twins of ``_kernels.c``.

* ``quantize_encode``: ``y = x + residual``, per block ``max|y|``, codes, the payload row (scales
  then codes, two codes per byte at 4 bits) and, with error feedback, the new residual
  ``y - decode(encode(y))`` (non-finite set to 0), in one read of ``x`` and the residual.
* ``decode`` / ``decode_sum``: payload rows -> float32 rows, or their sum in rank order from +0
  (then ``* scale``), in one read of the codes.
* ``cast_encode`` / ``cast_decode`` / ``cast_decode_sum`` of the 16-bit layouts (fp16, bf16,
  truncate16): one pass each; truncate16 decodes as bf16 does (both are a float32's upper half).

The arithmetic is the reference's, operation for operation (``compression/codecs.py``): correctly
rounded division (``div_rn``; Triton's ``/`` is approximate), round half to even (``rint``),
and no fused multiply-add (``enable_fp_fusion=False``: ``y - q * s`` must round the product
first), so nearest rounding gives the reference's bits. tools/gpu_check.py compares them
bit for bit with the CPU reference on a GPU.

Kept deliberately simple: one program per (row, block) or per column tile, no autotuning.
Imported only through ``compression/device_kernels.py``, only for CUDA tensors, only when
``triton`` is importable; anything else runs the reference ops. Checked on an H200
(tools/gpu_check.py, docs/gpu.md): bitwise equal to the CPU reference, 55-93% of each
codec's memory ceiling (docs/gpu_install.md).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

try:  # where libdevice lives moved between Triton releases
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton
    from triton.language.extra.cuda import libdevice

# Globals a @triton.jit function reads must be constexpr.
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
# No NaN global: Triton re-checks globals by ==, and NaN != NaN failed every launch after the
# first on an H200 ("Global variable _NAN has changed"); the kernel builds it from its bits.
_QUIET_NAN_BITS = tl.constexpr(0x7FC00000)
_CAST_TILE = 1024


def _pow2(n: int) -> int:
    return max(1, triton.next_power_of_2(n))


@triton.jit
def _nonfinite(y):
    return (y != y) | (tl.abs(y) > _FLT_MAX)


@triton.jit
def _quantize_encode_kernel(x_ptr, r_ptr, noise_ptr, out_r_ptr, payload_ptr, cols, row_bytes, nblocks, width,
                            LEVELS: tl.constexpr, BITS: tl.constexpr, HALF: tl.constexpr, HAS_R: tl.constexpr,
                            HAS_NOISE: tl.constexpr, EF: tl.constexpr):
    pid = tl.program_id(0)
    row = pid // nblocks
    blk = pid % nblocks
    i = tl.arange(0, HALF)
    mask = i < width // 2
    even = row * cols + blk * width + 2 * i  # even and odd values apart: 4-bit codes pair them
    ye = tl.load(x_ptr + even, mask=mask, other=0.0)
    yo = tl.load(x_ptr + even + 1, mask=mask, other=0.0)
    if HAS_R:
        ye = ye + tl.load(r_ptr + even, mask=mask, other=0.0)
        yo = yo + tl.load(r_ptr + even + 1, mask=mask, other=0.0)
    amax = tl.maximum(tl.max(tl.abs(ye), axis=0), tl.max(tl.abs(yo), axis=0))
    bad = tl.sum((_nonfinite(ye) | _nonfinite(yo)).to(tl.int32), axis=0)
    finite = bad == 0
    scale = tl.where(finite, amax, tl.full([], _QUIET_NAN_BITS, tl.int32).to(tl.float32, bitcast=True))
    safe = tl.where(finite & (amax > 0), amax, 1.0)
    qe = tl.math.div_rn(ye, safe) * LEVELS
    qo = tl.math.div_rn(yo, safe) * LEVELS
    if HAS_NOISE:
        qe = tl.floor(qe + tl.load(noise_ptr + even, mask=mask, other=0.0))
        qo = tl.floor(qo + tl.load(noise_ptr + even + 1, mask=mask, other=0.0))
    else:
        qe = libdevice.rint(qe)
        qo = libdevice.rint(qo)
    ce = tl.minimum(tl.maximum(qe + (LEVELS + 1), 1.0), 2 * LEVELS + 1.0)
    co = tl.minimum(tl.maximum(qo + (LEVELS + 1), 1.0), 2 * LEVELS + 1.0)
    row_at = payload_ptr + row * row_bytes
    bits = scale.to(tl.int32, bitcast=True)  # the scale's 4 bytes, little-endian, at the row's start
    for k in tl.static_range(4):
        tl.store(row_at + 4 * blk + k, ((bits >> (8 * k)) & 255).to(tl.uint8))
    codes_at = row_at + 4 * nblocks
    if BITS == 8:
        tl.store(codes_at + blk * width + 2 * i, ce.to(tl.uint8), mask=mask)
        tl.store(codes_at + blk * width + 2 * i + 1, co.to(tl.uint8), mask=mask)
    else:
        tl.store(codes_at + blk * (width // 2) + i, (ce + co * 16.0).to(tl.uint8), mask=mask)
    if EF:
        re = ye - tl.math.div_rn(ce - (LEVELS + 1), LEVELS * 1.0) * scale
        ro = yo - tl.math.div_rn(co - (LEVELS + 1), LEVELS * 1.0) * scale
        tl.store(out_r_ptr + even, tl.where(_nonfinite(re), 0.0, re), mask=mask)
        tl.store(out_r_ptr + even + 1, tl.where(_nonfinite(ro), 0.0, ro), mask=mask)


@triton.jit
def _quantize_block(payload_ptr, row, blk, row_bytes, nblocks, width, i, mask,
                    LEVELS: tl.constexpr, BITS: tl.constexpr):
    """(even values, odd values) of one block of one payload row."""
    row_at = payload_ptr + row * row_bytes
    bits = tl.load(row_at + 4 * blk).to(tl.int32)
    for k in tl.static_range(1, 4):
        bits = bits | (tl.load(row_at + 4 * blk + k).to(tl.int32) << (8 * k))
    scale = bits.to(tl.float32, bitcast=True)
    codes_at = row_at + 4 * nblocks
    if BITS == 8:
        ce = tl.load(codes_at + blk * width + 2 * i, mask=mask, other=0).to(tl.float32)
        co = tl.load(codes_at + blk * width + 2 * i + 1, mask=mask, other=0).to(tl.float32)
    else:
        packed = tl.load(codes_at + blk * (width // 2) + i, mask=mask, other=0).to(tl.int32)
        ce = (packed & 15).to(tl.float32)
        co = (packed >> 4).to(tl.float32)
    de = tl.math.div_rn(ce - (LEVELS + 1), LEVELS * 1.0) * scale
    do = tl.math.div_rn(co - (LEVELS + 1), LEVELS * 1.0) * scale
    return de, do


@triton.jit
def _quantize_decode_kernel(payload_ptr, out_ptr, cols, row_bytes, nblocks, width, LEVELS: tl.constexpr,
                            BITS: tl.constexpr, HALF: tl.constexpr):
    pid = tl.program_id(0)
    row = pid // nblocks
    blk = pid % nblocks
    i = tl.arange(0, HALF)
    mask = i < width // 2
    de, do = _quantize_block(payload_ptr, row, blk, row_bytes, nblocks, width, i, mask, LEVELS, BITS)
    even = row * cols + blk * width + 2 * i
    tl.store(out_ptr + even, de, mask=mask)
    tl.store(out_ptr + even + 1, do, mask=mask)


@triton.jit
def _quantize_decode_sum_kernel(payload_ptr, out_ptr, nrows, row_bytes, nblocks, width, factor,
                                LEVELS: tl.constexpr, BITS: tl.constexpr, HALF: tl.constexpr,
                                SCALED: tl.constexpr):
    blk = tl.program_id(0)
    i = tl.arange(0, HALF)
    mask = i < width // 2
    se = tl.zeros((HALF,), dtype=tl.float32)  # +0, then rows in rank order: the reference's sum
    so = tl.zeros((HALF,), dtype=tl.float32)
    for row in range(nrows):
        de, do = _quantize_block(payload_ptr, row, blk, row_bytes, nblocks, width, i, mask, LEVELS, BITS)
        se = se + de
        so = so + do
    if SCALED:
        se = se * factor
        so = so * factor
    tl.store(out_ptr + blk * width + 2 * i, se, mask=mask)
    tl.store(out_ptr + blk * width + 2 * i + 1, so, mask=mask)


@triton.jit
def _cast_encode_kernel(x_ptr, out_ptr, n, KIND: tl.constexpr, TILE: tl.constexpr):
    """float32 -> the 16 bits of the layout: float16 or bfloat16 (round to nearest even), or the
    upper half of the float32 (truncation). bfloat16 rounds in integer arithmetic, as the CPU
    reference does, rather than trusting a conversion instruction. A NaN becomes a quiet NaN
    (sign kept for the two floats; truncation keeps none, as the reference), never an inf."""
    j = tl.program_id(0) * TILE + tl.arange(0, TILE)
    mask = j < n
    x = tl.load(x_ptr + j, mask=mask, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    upper = bits >> 16  # arithmetic shift: the low 16 bits of `upper` are the float's upper half
    sign = upper & 0x8000
    if KIND == 0:
        half = tl.where(x != x, sign | 0x7E00, x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32))
    elif KIND == 1:
        half = tl.where(x != x, sign | 0x7FC0, (bits + (0x7FFF + (upper & 1))) >> 16)
    else:
        half = tl.where(x != x, 0x7FC0, upper)
    tl.store(out_ptr + j, half.to(tl.int16), mask=mask)


@triton.jit
def _half_to_float(raw, BF16: tl.constexpr):
    """16 payload bits -> float32: a float16 widened, or a bfloat16 / truncated float32 put back
    as the upper half of a float32 (integer shift: exact by construction)."""
    if BF16:
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return raw.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _cast_decode_kernel(halves_ptr, out_ptr, n, BF16: tl.constexpr, TILE: tl.constexpr):
    j = tl.program_id(0) * TILE + tl.arange(0, TILE)
    mask = j < n
    tl.store(out_ptr + j, _half_to_float(tl.load(halves_ptr + j, mask=mask, other=0), BF16), mask=mask)


@triton.jit
def _cast_decode_sum_kernel(halves_ptr, out_ptr, nrows, cols, factor, BF16: tl.constexpr,
                            TILE: tl.constexpr, SCALED: tl.constexpr):
    j = tl.program_id(0) * TILE + tl.arange(0, TILE)
    mask = j < cols
    total = tl.zeros((TILE,), dtype=tl.float32)
    for row in range(nrows):
        total = total + _half_to_float(tl.load(halves_ptr + row * cols + j, mask=mask, other=0), BF16)
    if SCALED:
        total = total * factor
    tl.store(out_ptr + j, total, mask=mask)


# --------------------------------------------------------------------------- entry points
def _row_bytes(cols: int, width: int, bits: int) -> int:
    return 4 * (cols // width) + (cols if bits == 8 else cols // 2)


def quantize_encode(x: torch.Tensor, *, width: int, bits: int, noise: Optional[torch.Tensor] = None,
                    residual: Optional[torch.Tensor] = None, error_feedback: bool = False
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The contract of ``kernels.quantize_encode`` for contiguous float32 CUDA rows."""
    rows, cols = x.shape
    x = x.contiguous()
    nblocks = cols // width
    payload = torch.empty((rows, _row_bytes(cols, width, bits)), dtype=torch.uint8, device=x.device)
    new_residual = None
    if error_feedback:
        new_residual = residual if residual is not None and residual.is_contiguous() else torch.empty_like(x)
    r = residual.contiguous() if residual is not None else x
    n = noise.contiguous() if noise is not None else x
    _quantize_encode_kernel[(rows * nblocks,)](
        x, r, n, new_residual if new_residual is not None else x, payload, cols, payload.shape[1], nblocks, width,
        LEVELS=2 ** (bits - 1) - 1, BITS=bits, HALF=_pow2(width // 2), HAS_R=residual is not None,
        HAS_NOISE=noise is not None, EF=error_feedback, enable_fp_fusion=False)
    return payload, new_residual


def quantize_decode(payload: torch.Tensor, *, cols: int, width: int, bits: int) -> torch.Tensor:
    rows = payload.shape[0]
    payload = payload.contiguous()
    out = torch.empty((rows, cols), dtype=torch.float32, device=payload.device)
    nblocks = cols // width
    _quantize_decode_kernel[(rows * nblocks,)](payload, out, cols, payload.shape[1], nblocks, width,
                                               LEVELS=2 ** (bits - 1) - 1, BITS=bits, HALF=_pow2(width // 2),
                                               enable_fp_fusion=False)
    return out


def quantize_decode_sum(payload: torch.Tensor, *, cols: int, width: int, bits: int, scale: float) -> torch.Tensor:
    payload = payload.contiguous()
    out = torch.empty((1, cols), dtype=torch.float32, device=payload.device)
    nblocks = cols // width
    _quantize_decode_sum_kernel[(nblocks,)](payload, out, payload.shape[0], payload.shape[1], nblocks, width,
                                            float(scale), LEVELS=2 ** (bits - 1) - 1, BITS=bits,
                                            HALF=_pow2(width // 2), SCALED=scale != 1.0, enable_fp_fusion=False)
    return out


def cast_decode_sum(payload: torch.Tensor, *, cols: int, bf16: bool, scale: float) -> torch.Tensor:
    halves = payload.contiguous().view(torch.int16)  # [rows, cols] 16-bit values
    out = torch.empty((1, cols), dtype=torch.float32, device=payload.device)
    _cast_decode_sum_kernel[(triton.cdiv(cols, _CAST_TILE),)](halves, out, halves.shape[0], cols, float(scale),
                                                              BF16=bf16, TILE=_CAST_TILE, SCALED=scale != 1.0,
                                                              enable_fp_fusion=False)
    return out


# Layout numbers of ``_cast_encode_kernel`` (``kernels.Kind``'s 16-bit layouts).
CAST_KINDS = {"fp16": 0, "bf16": 1, "truncate16": 2}


def cast_encode(x: torch.Tensor, *, layout: str) -> torch.Tensor:
    """float32 rows -> uint8 rows of 16-bit values (``layout`` in ``CAST_KINDS``), one pass."""
    rows, cols = x.shape
    x = x.contiguous()
    payload = torch.empty((rows, 2 * cols), dtype=torch.uint8, device=x.device)
    n = rows * cols
    _cast_encode_kernel[(triton.cdiv(n, _CAST_TILE),)](x, payload.view(torch.int16), n, KIND=CAST_KINDS[layout],
                                                       TILE=_CAST_TILE)
    return payload


def cast_decode(payload: torch.Tensor, *, cols: int, bf16: bool) -> torch.Tensor:
    """uint8 rows of 16-bit values -> float32 rows; ``bf16`` also reads truncated float32s."""
    halves = payload.contiguous().view(torch.int16)
    out = torch.empty(halves.shape, dtype=torch.float32, device=payload.device)
    n = halves.numel()
    _cast_decode_kernel[(triton.cdiv(n, _CAST_TILE),)](halves, out, n, BF16=bf16, TILE=_CAST_TILE)
    return out
