"""Gradient codecs, written once for every framework against :class:`~pipesgd_hvd.ops.base.TensorOps`.

The contract: ``encode(ops, x, key=, seed=) -> (payload, ctx)`` and ``decode(ops, payload, ctx)``.

* *Summable* codecs (``none``, Horovod's compressors) produce a payload that a plain all-reduce
  can sum in its own dtype; ``x`` is a flat bucket in any float dtype.
* *Byte* codecs (casts, truncation, quantization) take float32 rows ``[r, cols]`` (``cols`` from
  :meth:`Codec.padded_cols`) and produce ``uint8`` rows ``[r, nbytes]``; each row carries its own
  scales, so rows can be split across ranks. They go through the compressed all-reduce
  (``compression/allreduce.py``), which sums in float32.

Non-finite values: casts and truncation keep them element-wise. The quantizers keep them within
their block: a block holding inf or nan decodes as all-nan (its scale is nan), and no other block
changes. That is enough for AMP's overflow check to see it and skip the step on every rank.
(The codes inside such a block are unspecified.)

Speed: on host tensors (PyTorch CPU, numpy, TensorFlow CPU eager or traced) the byte codecs run
fused kernels (``compression/kernels.py``): encode with error feedback in one pass, decode+sum in
one pass; CUDA tensors run their Triton twins. The tensor-op compositions below are the reference
they equal bit for bit (nearest rounding), and what runs elsewhere (CUDA without Triton, TensorFlow
GPU tensors, a table built with ``fused=False``).
"""
from __future__ import annotations

import abc
import sys
from typing import Any, Dict, Optional, Tuple

from ..ops.base import Tensor, TensorOps
from . import kernels
from .kernels import Kind

if sys.byteorder != "little":  # truncation slices bytes; every supported platform is little-endian
    raise ImportError("pipesgd_hvd's codecs assume a little-endian machine")

NAN = float("nan")


class Codec(abc.ABC):
    """A gradient codec. Instances passed by users are templates: the engine works on a deep copy,
    so state (error-feedback residuals) is never shared between optimizers."""

    name: str = "codec"
    summable: bool = False   # payload can be summed by a plain all-reduce in its own dtype
    lossless: bool = False

    def padded_cols(self, cols: int) -> int:
        """The row length (>= cols) this codec encodes; rows are zero-padded up to it."""
        return cols

    def block_width(self, cols: int) -> int:
        """How many consecutive values of a row of ``cols`` (a :meth:`padded_cols` length) are
        encoded together: a value's encoding depends only on the values of its block (a
        quantizer's scale); 1 for element-wise codecs."""
        return 1

    @abc.abstractmethod
    def encode(self, ops: TensorOps, x: Tensor, *, key: str, seed: Any) -> Tuple[Tensor, Any]: ...

    @abc.abstractmethod
    def decode(self, ops: TensorOps, payload: Tensor, ctx: Any) -> Tensor:
        """The values of ``payload``. A byte codec (not summable) returns a new tensor, never a
        view of the payload or of its state: the engine hands it over as the gradient."""

    def encode_ef(self, ops: TensorOps, x: Tensor, residual: Optional[Tensor], *, key: str,
                  seed: Any) -> Tuple[Tensor, Any, Tensor]:
        """Encode ``y = x + residual`` (``x`` when None) for error feedback: returns the payload,
        its context and the new residual ``y - decode(encode(y))`` with non-finite values set to 0.
        A codec with a fused kernel may write the new residual into ``residual`` and return it."""
        corrected = x + residual if residual is not None else x
        payload, ctx = self.encode(ops, corrected, key=key, seed=seed)
        return payload, ctx, ops.finite_or_zero(corrected - self.decode(ops, payload, ctx))

    def decode_sum(self, ops: TensorOps, payload: Tensor, ctx: Any, scale: float = 1.0) -> Tensor:
        """Decode byte rows ``[N, nbytes]`` and sum them in float32 -> ``[1, cols]``, times
        ``scale`` unless it is 1: the reduce step of the compressed all-reduce. The fused kernels
        add in rank order starting from +0; so does this reference, row by row, because a
        framework's own sum picks its order by device and size (PyTorch's CUDA sum gave other
        bits than the CPU kernels on an H200). Every rank gets the same bits either way, since
        each chunk is summed by its owner alone and then sent to all."""
        rows = self.decode(ops, payload, ctx)
        total = rows[0:1] + 0.0  # +0 + row0: a -0 becomes +0, as in the kernels
        for r in range(1, ops.shape(rows)[0]):
            total = total + rows[r:r + 1]
        return total * scale if scale != 1.0 else total

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any], ops: TensorOps) -> None:
        if state:
            raise ValueError(f"codec {self.name} keeps no state, but the checkpoint has {sorted(state)}")

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class NoneCodec(Codec):
    """No compression: a plain all-reduce in the gradient's own dtype."""

    name = "none"
    summable = True
    lossless = True

    def encode(self, ops: TensorOps, x: Tensor, *, key: str, seed: Any) -> Tuple[Tensor, Any]:
        return x, None

    def decode(self, ops: TensorOps, payload: Tensor, ctx: Any) -> Tensor:
        return payload


class HorovodCompressor(Codec):
    """Horovod's own compressors (``hvd.Compression.none``, ``.fp16`` or a user's subclass),
    used exactly as Horovod uses them: compress, all-reduce in the compressed dtype, decompress."""

    summable = True

    def __init__(self, compressor: Any) -> None:
        self.compressor = compressor
        self.name = f"horovod:{getattr(compressor, '__name__', type(compressor).__name__)}"
        self.lossless = self.name.endswith("NoneCompressor")

    def encode(self, ops: TensorOps, x: Tensor, *, key: str, seed: Any) -> Tuple[Tensor, Any]:
        return self.compressor.compress(x)

    def decode(self, ops: TensorOps, payload: Tensor, ctx: Any) -> Tensor:
        return self.compressor.decompress(payload, ctx)


class KernelCodec(Codec):
    """A byte codec whose payload rows the fused kernels decode: :meth:`decode` and
    :meth:`decode_sum` run the kernel when the table allows it, else the tensor-op reference
    :meth:`_decode_ops`. ``ctx`` is the row length."""

    @abc.abstractmethod
    def _layout(self, cols: int) -> Tuple[Kind, int, int]:
        """(kernel layout, values per block, bits) of rows of ``cols`` values."""

    @abc.abstractmethod
    def _decode_ops(self, ops: TensorOps, payload: Tensor, cols: int) -> Tensor: ...

    def decode(self, ops: TensorOps, payload: Tensor, ctx: Any) -> Tensor:
        kind, width, bits = self._layout(ctx)
        out = kernels.decode(ops, payload, kind, cols=ctx, width=width, bits=bits)
        return out if out is not None else self._decode_ops(ops, payload, ctx)

    def decode_sum(self, ops: TensorOps, payload: Tensor, ctx: Any, scale: float = 1.0) -> Tensor:
        kind, width, bits = self._layout(ctx)
        out = kernels.decode_sum(ops, payload, kind, cols=ctx, scale=scale, width=width, bits=bits)
        return out if out is not None else super().decode_sum(ops, payload, ctx, scale)


class Cast(KernelCodec):
    """Cast to a 16-bit float on the wire (``float16`` or ``bfloat16``, round to nearest even);
    the compressed all-reduce sums in float32. float16 overflows beyond 65504: prefer bfloat16
    for gradients with a large range."""

    def __init__(self, dtype: str = "float16") -> None:
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"Cast supports dtype 'float16' or 'bfloat16', got {dtype!r}")
        self.dtype = dtype
        self.name = {"float16": "fp16", "bfloat16": "bf16"}[dtype]

    def _layout(self, cols: int) -> Tuple[Kind, int, int]:
        return (Kind.FP16 if self.dtype == "float16" else Kind.BF16), 0, 0

    def encode(self, ops: TensorOps, x: Tensor, *, key: str, seed: Any) -> Tuple[Tensor, Any]:
        fused = kernels.cast_encode(ops, x, self._layout(0)[0])
        if fused is not None:
            return fused, ops.shape(x)[-1]
        return ops.bitcast(ops.cast(x, self.dtype), "uint8"), ops.shape(x)[-1]

    def _decode_ops(self, ops: TensorOps, payload: Tensor, cols: int) -> Tensor:
        return ops.cast(ops.bitcast(payload, self.dtype), "float32")


class Truncate(KernelCodec):
    """The paper's truncation: keep the upper ``bits`` bits of each float32 (16: sign, exponent and
    7 mantissa bits, i.e. bfloat16 rounded toward zero; 24: 15 mantissa bits)."""

    def __init__(self, bits: int = 16) -> None:
        if bits not in (16, 24):
            raise ValueError(f"Truncate keeps 16 or 24 bits of a float32, got bits={bits!r}")
        self.bits = bits
        self.kept = bits // 8
        self.name = f"truncate{bits}"

    def _layout(self, cols: int) -> Tuple[Kind, int, int]:
        return (Kind.TRUNC16 if self.bits == 16 else Kind.TRUNC24), 0, 0

    def encode(self, ops: TensorOps, x: Tensor, *, key: str, seed: Any) -> Tuple[Tensor, Any]:
        rows, cols = ops.shape(x)
        fused = kernels.cast_encode(ops, x, self._layout(cols)[0])
        if fused is not None:
            return fused, cols
        # A nan whose payload sits only in the low mantissa bits would truncate to inf: make it
        # the canonical quiet nan first, whose high bits mark it as nan.
        x = ops.where(ops.isnan(x), NAN, x)
        raw = ops.reshape(ops.bitcast(x, "uint8"), (rows, cols, 4))
        return ops.reshape(raw[:, :, 4 - self.kept:], (rows, cols * self.kept)), cols

    def _decode_ops(self, ops: TensorOps, payload: Tensor, cols: int) -> Tensor:
        rows = ops.shape(payload)[0]
        kept = ops.reshape(payload, (rows, cols, self.kept))
        low = ops.zeros((rows, cols, 4 - self.kept), "uint8", like=payload)
        return ops.bitcast(ops.reshape(ops.concat([low, kept], 2), (rows, cols * 4)), "float32")


class Quantize(KernelCodec):
    """Symmetric scalar quantization to ``bits`` (8 or 4) with one float32 scale per ``block``
    values: ``q = round(x / max|block| * L)``, ``L = 2**(bits-1) - 1`` (127 or 7), sent as unsigned
    codes ``q + L + 1`` (two per byte at 4 bits). ``rounding='stochastic'`` uses ``floor(y + u)``,
    unbiased in expectation. Per value: |error| <= max|block| / (2L) (nearest) or / L (stochastic).
    """

    def __init__(self, bits: int = 8, block: int = 512, rounding: str = "nearest") -> None:
        if bits not in (8, 4):
            raise ValueError(f"Quantize supports bits=8 or bits=4, got {bits!r}")
        if not isinstance(block, int) or block < 2 or block % 2:
            raise ValueError(f"block must be an even int >= 2, got {block!r}")
        if rounding not in ("nearest", "stochastic"):
            raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
        self.bits, self.block, self.rounding = bits, block, rounding
        self.levels = 2 ** (bits - 1) - 1
        self.name = f"int{bits}" + ("-stochastic" if rounding == "stochastic" else "")

    def padded_cols(self, cols: int) -> int:
        if cols <= self.block:  # a short row is one block
            return cols + (cols % 2)
        return -(-cols // self.block) * self.block

    def _blocks(self, cols: int) -> Tuple[int, int]:
        width = min(cols, self.block)
        return cols // width, width

    def block_width(self, cols: int) -> int:
        return self._blocks(cols)[1]

    def _layout(self, cols: int) -> Tuple[Kind, int, int]:
        return Kind.QUANTIZE, self._blocks(cols)[1], self.bits

    def _noise(self, ops: TensorOps, x: Tensor, seed: Any) -> Optional[Tensor]:
        rows, cols = ops.shape(x)
        nblocks, width = self._blocks(cols)
        return ops.uniform((rows, nblocks, width), seed, like=x) if self.rounding == "stochastic" else None

    def _encode_fused(self, ops: TensorOps, x: Tensor, residual: Optional[Tensor], seed: Any,
                      error_feedback: bool) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
        if not kernels.accepts(ops, x):  # checked before drawing noise: the reference draws its own
            return None
        rows, cols = ops.shape(x)
        noise = self._noise(ops, x, seed)
        return kernels.quantize_encode(ops, x, width=self._blocks(cols)[1], bits=self.bits,
                                       noise=None if noise is None else ops.reshape(noise, (rows, cols)),
                                       residual=residual, error_feedback=error_feedback)

    def encode_ef(self, ops: TensorOps, x: Tensor, residual: Optional[Tensor], *, key: str,
                  seed: Any) -> Tuple[Tensor, Any, Tensor]:
        fused = self._encode_fused(ops, x, residual, seed, error_feedback=True)
        if fused is None:
            return super().encode_ef(ops, x, residual, key=key, seed=seed)
        return fused[0], ops.shape(x)[1], fused[1]

    def encode(self, ops: TensorOps, x: Tensor, *, key: str, seed: Any) -> Tuple[Tensor, Any]:
        fused = self._encode_fused(ops, x, None, seed, error_feedback=False)
        if fused is not None:
            return fused[0], ops.shape(x)[1]
        # Each full-size pass over the bucket costs about as much as the wire at 10 Gbit, so the
        # work per value is kept to abs, max, one division, round, clip and the cast; everything
        # else is per block.
        rows, cols = ops.shape(x)
        nblocks, width = self._blocks(cols)
        blocks = ops.reshape(x, (rows, nblocks, width))
        amax = ops.amax_abs(blocks, axis=2)  # NaN if the block holds a NaN, inf if an inf
        finite = ops.isfinite(amax)
        usable = ops.logical_and(finite, amax > 0)
        safe = ops.where(usable, amax, ops.full((rows, nblocks), 1.0, "float32", like=x))
        scale = ops.where(finite, amax, NAN)
        # x / max|x| is in [-1, 1] even for denormal or huge scales (no overflow, no underflow).
        noise = self._noise(ops, x, seed)
        # Codes 1..2L+1 (0 unused); a non-finite block's codes are whatever the cast makes of NaN:
        # its scale is NaN, so it decodes to NaN on every rank regardless.
        codes = ops.reshape(ops.to_levels(blocks, ops.reshape(safe, (rows, nblocks, 1)), float(self.levels),
                                          float(self.levels + 1), noise), (rows, cols))
        if self.bits == 4:
            codes = codes[:, 0::2] + codes[:, 1::2] * 16.0
        payload = ops.concat([ops.bitcast(scale, "uint8"), ops.cast(codes, "uint8")], 1)
        return payload, cols

    def _decode_ops(self, ops: TensorOps, payload: Tensor, cols: int) -> Tensor:
        rows = ops.shape(payload)[0]
        nblocks, width = self._blocks(cols)
        scale = ops.reshape(ops.bitcast(payload[:, :4 * nblocks], "float32"), (rows, nblocks, 1))
        codes = payload[:, 4 * nblocks:]
        if self.bits == 4:
            codes = ops.cast(codes, "float32")
            high = ops.floor(codes / 16.0)
            codes = ops.reshape(ops.stack([codes - high * 16.0, high], 2), (rows, cols))
        codes = ops.reshape(codes, (rows, nblocks, width))
        # (q / L) * scale, not q * (scale / L): the latter overflows for scales near float32's max.
        return ops.reshape(ops.from_levels(codes, scale, float(self.levels), float(self.levels + 1)), (rows, cols))
