"""The decoded-sum reference of the compressed all-reduce, in plain numpy calls of the codec:
encode each rank's N chunks, decode, sum in float32 in rank order, average, encode, decode."""
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.ops.numpy import NUMPY_OPS as ops


def decoded_sum_reference(name: str, inputs: List[np.ndarray], residuals: Optional[Dict[str, Any]] = None) -> np.ndarray:
    """``residuals``: a dict kept across steps; error feedback is then done here, by hand, around
    the codec inside ``name`` (add the residual, encode, keep what decoding loses), so a test of
    several steps checks the library's error feedback instead of reusing it."""
    size, n = len(inputs), inputs[0].size
    codec = resolve_compression(name)  # a fresh codec: error feedback starts at zero
    if residuals is not None:
        codec = _HandMadeErrorFeedback(getattr(codec, "codec", codec), residuals)
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


class _HandMadeErrorFeedback:
    def __init__(self, inner: Any, residuals: Dict[str, Any]) -> None:
        self.inner, self.residuals = inner, residuals

    def padded_cols(self, cols: int) -> int:
        return self.inner.padded_cols(cols)

    def encode(self, ops: Any, x: np.ndarray, *, key: str, seed: Any) -> Tuple[np.ndarray, Any]:
        corrected = x + self.residuals.get(key, np.zeros_like(x))
        payload, ctx = self.inner.encode(ops, corrected, key=key, seed=seed)
        error = corrected - self.inner.decode(ops, payload, ctx)
        self.residuals[key] = np.where(np.isfinite(error), error, np.float32(0))
        return payload, ctx

    def decode(self, ops: Any, payload: np.ndarray, ctx: Any) -> np.ndarray:
        return self.inner.decode(ops, payload, ctx)


def hierarchical_reference(name: str, inputs: List[np.ndarray], hosts: int, per_host: int,
                           residuals: Optional[Dict[str, Any]] = None, local_dtype: str = "float32") -> np.ndarray:
    """The hierarchical all-reduce's result, computed here from every rank's input without any
    communicator: rank ``c * per_host + j`` is local rank j on host c. Per host, shard j (rows
    ``j hosts .. j hosts + hosts - 1`` of the flat layout for N ranks) is summed in float32 over
    the host's ranks in local-rank order (each first cast to ``local_dtype`` and back); then, per
    row, each host's sum is encoded and decoded, the decoded rows are summed in float32 in host
    order and averaged over N, and the sum is encoded and decoded once more. ``residuals``: error
    feedback by hand around both encodes, per rank, as in :func:`decoded_sum_reference`."""
    size, n = hosts * per_host, inputs[0].size
    assert len(inputs) == size
    codec = resolve_compression(name)
    if residuals is not None:
        codec = _HandMadeErrorFeedback(getattr(codec, "codec", codec), residuals)
    cols = codec.padded_cols(-(-n // size))
    rows = [np.concatenate([x, np.zeros(size * cols - n, np.float32)]).reshape(size, cols) for x in inputs]
    if local_dtype != "float32":  # what crosses the node: each value cast once, then summed in float32
        cast = resolve_compression({"float16": "fp16", "bfloat16": "bf16"}[local_dtype])
        rows = [cast.decode(ops, *cast.encode(ops, r, key="local", seed=0)) for r in rows]
    out = np.zeros((size, cols), np.float32)
    for j in range(per_host):
        for chunk in range(hosts):
            row = j * hosts + chunk
            parts = []
            for host in range(hosts):
                node_sum = np.zeros(cols, np.float32)
                for local in range(per_host):
                    node_sum = node_sum + rows[host * per_host + local][row]
                rank = host * per_host + j  # the rank that holds this node's shard j
                payload, ctx = codec.encode(ops, node_sum.reshape(1, -1), key=f"cross{rank}.{chunk}", seed=0)
                parts.append(codec.decode(ops, payload, ctx)[0])
            total = parts[0].copy()
            for part in parts[1:]:
                total = total + part
            total = total * np.float32(1.0 / size)
            owner = chunk * per_host + j
            payload, ctx = codec.encode(ops, total.reshape(1, -1), key=f"red{owner}", seed=0)
            out[row] = codec.decode(ops, payload, ctx)[0]
    return out.reshape(-1)[:n]
