"""Bitwise comparison of codec outputs, shared by the kernel tests of every table
(tests/test_codec_kernels.py, tests/test_tf_kernels.py): what must agree bit for bit, and the bytes
that need not (the codes of a block whose scale is NaN, the bits of a NaN value)."""
import numpy as np

from pipesgd_hvd.compression import Codec, Quantize


def assert_same_floats(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.shape == b.shape, what
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    assert np.array_equal(nan_a, nan_b), f"{what}: NaN in different places"
    differ = np.flatnonzero(a[~nan_a].view(np.uint32) != b[~nan_b].view(np.uint32))
    assert differ.size == 0, f"{what}: {differ.size} values differ, first {a[~nan_a][differ[0]]!r} vs {b[~nan_b][differ[0]]!r}"


def comparable_bytes(codec: Codec, payload: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The payload with the bytes that need not agree zeroed: codes of NaN-scale blocks, NaN values."""
    payload = payload.copy()
    rows, cols = x.shape
    if isinstance(codec, Quantize):
        nblocks, width = codec._blocks(cols)
        scales = payload[:, :4 * nblocks].copy().view(np.float32)
        per_byte = width if codec.bits == 8 else width // 2
        for r, b in zip(*np.nonzero(np.isnan(scales))):
            start = 4 * nblocks + b * per_byte
            payload[r, start:start + per_byte] = 0
    else:
        per_value = payload.shape[1] // cols
        for r, c in zip(*np.nonzero(np.isnan(x))):
            payload[r, c * per_value:(c + 1) * per_value] = 0
    return payload
