"""Gradient codecs, written once for every framework against :class:`~pipesgd_hvd.tensor_ops.TensorOps`.

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
"""
from __future__ import annotations

import abc
import sys
from typing import Any, Dict, Tuple

from ..tensor_ops import Tensor, TensorOps

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

    @abc.abstractmethod
    def encode(self, ops: TensorOps, x: Tensor, *, key: str, seed: Any) -> Tuple[Tensor, Any]: ...

    @abc.abstractmethod
    def decode(self, ops: TensorOps, payload: Tensor, ctx: Any) -> Tensor: ...

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


class Cast(Codec):
    """Cast to a 16-bit float on the wire (``float16`` or ``bfloat16``, round to nearest even);
    the compressed all-reduce sums in float32. float16 overflows beyond 65504: prefer bfloat16
    for gradients with a large range."""

    def __init__(self, dtype: str = "float16") -> None:
        if dtype not in ("float16", "bfloat16"):
            raise ValueError(f"Cast supports dtype 'float16' or 'bfloat16', got {dtype!r}")
        self.dtype = dtype
        self.name = {"float16": "fp16", "bfloat16": "bf16"}[dtype]

    def encode(self, ops: TensorOps, x: Tensor, *, key: str, seed: Any) -> Tuple[Tensor, Any]:
        return ops.bitcast(ops.cast(x, self.dtype), "uint8"), ops.shape(x)[-1]

    def decode(self, ops: TensorOps, payload: Tensor, ctx: Any) -> Tensor:
        return ops.cast(ops.bitcast(payload, self.dtype), "float32")


class Truncate(Codec):
    """The paper's truncation: keep the upper ``bits`` bits of each float32 (16: sign, exponent and
    7 mantissa bits, i.e. bfloat16 rounded toward zero; 24: 15 mantissa bits)."""

    def __init__(self, bits: int = 16) -> None:
        if bits not in (16, 24):
            raise ValueError(f"Truncate keeps 16 or 24 bits of a float32, got bits={bits!r}")
        self.bits = bits
        self.kept = bits // 8
        self.name = f"truncate{bits}"

    def encode(self, ops: TensorOps, x: Tensor, *, key: str, seed: Any) -> Tuple[Tensor, Any]:
        rows, cols = ops.shape(x)
        # A nan whose payload sits only in the low mantissa bits would truncate to inf: make it
        # the canonical quiet nan first, whose high bits mark it as nan.
        x = ops.where(ops.isnan(x), NAN, x)
        raw = ops.reshape(ops.bitcast(x, "uint8"), (rows, cols, 4))
        return ops.reshape(raw[:, :, 4 - self.kept:], (rows, cols * self.kept)), cols

    def decode(self, ops: TensorOps, payload: Tensor, ctx: Any) -> Tensor:
        cols = ctx
        rows = ops.shape(payload)[0]
        kept = ops.reshape(payload, (rows, cols, self.kept))
        low = ops.zeros((rows, cols, 4 - self.kept), "uint8", like=payload)
        return ops.bitcast(ops.reshape(ops.concat([low, kept], 2), (rows, cols * 4)), "float32")


class Quantize(Codec):
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

    def encode(self, ops: TensorOps, x: Tensor, *, key: str, seed: Any) -> Tuple[Tensor, Any]:
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
        noise = ops.uniform((rows, nblocks, width), seed, like=x) if self.rounding == "stochastic" else None
        # Codes 1..2L+1 (0 unused); a non-finite block's codes are whatever the cast makes of NaN:
        # its scale is NaN, so it decodes to NaN on every rank regardless.
        codes = ops.reshape(ops.to_levels(blocks, ops.reshape(safe, (rows, nblocks, 1)), float(self.levels),
                                          float(self.levels + 1), noise), (rows, cols))
        if self.bits == 4:
            codes = codes[:, 0::2] + codes[:, 1::2] * 16.0
        payload = ops.concat([ops.bitcast(scale, "uint8"), ops.cast(codes, "uint8")], 1)
        return payload, cols

    def decode(self, ops: TensorOps, payload: Tensor, ctx: Any) -> Tensor:
        cols = ctx
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
