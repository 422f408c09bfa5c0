"""The decoded-sum reference of the compressed all-reduce, in plain numpy calls of the codec:
encode each rank's N chunks, decode, sum in float32 in rank order, average, encode, decode."""
from typing import List

import numpy as np

from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.frameworks.numpy_ops import NUMPY_OPS as ops


def decoded_sum_reference(name: str, inputs: List[np.ndarray]) -> np.ndarray:
    size, n = len(inputs), inputs[0].size
    codec = resolve_compression(name)  # a fresh codec: error feedback starts at zero
    cols = codec.padded_cols(-(-n // size))
    rows = [np.concatenate([x, np.zeros(size * cols - n, np.float32)]).reshape(size, cols) for x in inputs]
    out = []
    for owner in range(size):
        parts = []
        for r in range(size):
            payload, ctx = codec.encode(ops, rows[r][owner:owner + 1], key=f"ref{r}.{owner}", seed=0)
            parts.append(codec.decode(ops, payload, ctx)[0])
        total = parts[0].copy()
        for part in parts[1:]:
            total = total + part
        total = total * np.float32(1.0 / size)
        payload, ctx = codec.encode(ops, total.reshape(1, -1), key=f"red{owner}", seed=0)
        out.append(codec.decode(ops, payload, ctx)[0])
    return np.concatenate(out)[:n]
