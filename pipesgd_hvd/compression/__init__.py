"""Gradient compression: codecs, error feedback, and the compressed all-reduce.

``Compression`` reads like Horovod's: pass ``compression=psgd.Compression.int8`` to the
optimizer. Horovod's own ``hvd.Compression.none`` / ``.fp16`` are accepted too and behave exactly
as in Horovod (all-reduce in the compressed dtype).
"""
from __future__ import annotations

import copy
from typing import Any

from .codecs import Cast, Codec, HorovodCompressor, NoneCodec, Quantize, Truncate
from .error_feedback import ErrorFeedback


class Compression:
    """Ready-made codecs and the building blocks to make others.

    ============== ====================================================== ===============
    name           on the wire                                            vs float32
    ============== ====================================================== ===============
    ``none``       the gradient as is (plain all-reduce)                  1
    ``fp16``       float16, summed in float32                             0.5
    ``bf16``       bfloat16, summed in float32                            0.5
    ``truncate16`` upper 16 bits of each float32 (the paper's truncation) 0.5
    ``int8``       8-bit codes + a scale per 512 values, error feedback   0.252
    ``int4``       4-bit codes + a scale per 512 values, error feedback   0.127
    ============== ====================================================== ===============

    Building blocks: ``Compression.cast(dtype)``, ``.truncate(bits)``,
    ``.quantize(bits, block, rounding)``, ``.error_feedback(codec)``; e.g.
    ``Compression.quantize(8, rounding="stochastic")`` is int8 without error feedback.
    """

    none: Codec = NoneCodec()
    fp16: Codec = Cast("float16")
    bf16: Codec = Cast("bfloat16")
    truncate16: Codec = Truncate(16)
    int8: Codec = ErrorFeedback(Quantize(8))
    int4: Codec = ErrorFeedback(Quantize(4))

    cast = Cast
    truncate = Truncate
    quantize = Quantize
    error_feedback = ErrorFeedback

    NAMES = ("none", "fp16", "bf16", "truncate16", "int8", "int4")


def resolve_compression(compression: Any) -> Codec:
    """A fresh, private codec for one optimizer from whatever the user passed."""
    if isinstance(compression, str):
        if compression not in Compression.NAMES:
            raise ValueError(f"unknown compression {compression!r}; use one of {', '.join(Compression.NAMES)} "
                             "or a codec from pipesgd_hvd's Compression")
        compression = getattr(Compression, compression)
    if isinstance(compression, Codec):
        return copy.deepcopy(compression)
    if callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None)):
        return HorovodCompressor(compression)
    raise ValueError(
        f"unknown compression {compression!r}: pass a codec such as psgd.Compression.int8, one of the "
        f"names {', '.join(Compression.NAMES)}, or a Horovod compressor such as hvd.Compression.fp16")


__all__ = ["Cast", "Codec", "Compression", "ErrorFeedback", "HorovodCompressor", "NoneCodec",
           "Quantize", "Truncate", "resolve_compression"]
