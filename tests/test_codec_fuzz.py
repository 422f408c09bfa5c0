"""Codec fuzzing (hypothesis): random sizes, chunk counts and values, every codec, N = 1..8 ranks.

The policy for bad values (pipesgd_hvd/compression/codecs.py): casts and truncation are
element-wise; a quantizer turns the whole block (``block`` values of one chunk row) that holds a
non-finite value into NaN; error feedback drops non-finite residuals. Checked here as properties:

* nothing crashes, whatever the values (inf, nan, denormals, zeros, +-max float);
* locality: a run with special values and the same run with those values replaced by 0 give
  bitwise the same output everywhere outside the special values' own element (casts) or block
  (quantizers), also on the next call, whose error-feedback residuals came from the first;
* the policy itself: a non-finite input makes its element (casts) or its whole block (quantizers)
  non-finite in the result on every rank, all ranks get the same bytes, residuals stay finite and
  the next call with ordinary gradients is finite everywhere (nothing poisons later steps).
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipesgd_hvd.comm.base import ReduceOp
from pipesgd_hvd.compression import Codec, Compression, ErrorFeedback, NoneCodec, Quantize, Truncate
from pipesgd_hvd.compression.allreduce import compressed_allreduce
from pipesgd_hvd.ops.numpy import NUMPY_OPS
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.testing import LocalWorld
from threads import run_threads

# Examples per run are sized for CI (the file takes a few seconds); PIPESGD_FUZZ_SCALE=20 digs deeper.
SCALE = float(os.environ.get("PIPESGD_FUZZ_SCALE", "1"))
F32 = np.finfo(np.float32)
# NaNs whose payload sits only in the low mantissa bits (truncation must not turn them into inf),
# and a negative quiet NaN.
ODD_NANS = list(np.array([0x7F800001, 0xFFC00000, 0x7FC0FFFF], np.uint32).view(np.float32))
SPECIAL = [np.inf, -np.inf, np.nan, F32.max, -F32.max, 2.0 ** -149, -(2.0 ** -149), F32.tiny, 0.0, -0.0] + ODD_NANS
SCALES = [0.0, 2.0 ** -140, 1e-30, 1.0, 1e30]  # zeros, denormals, tiny, ordinary, huge (finite) values

# Every codec users can pick, the building blocks, and quantizers with small blocks (so that short
# vectors span many blocks). Factories: each run gets fresh error-feedback state.
CODECS: Dict[str, Callable[[], Codec]] = {
    "none": NoneCodec,
    "fp16": lambda: Compression.cast("float16"),
    "bf16": lambda: Compression.cast("bfloat16"),
    "truncate16": lambda: Truncate(16),
    "truncate24": lambda: Truncate(24),
    "truncate16+ef": lambda: ErrorFeedback(Truncate(16)),
    "int8": lambda: Quantize(8),
    "int4": lambda: Quantize(4),
    "int8-stochastic": lambda: Quantize(8, rounding="stochastic"),
    "int4-stochastic": lambda: Quantize(4, rounding="stochastic"),
    "int8+ef": lambda: ErrorFeedback(Quantize(8)),
    "int4+ef": lambda: ErrorFeedback(Quantize(4)),
    "int8-block8+ef": lambda: ErrorFeedback(Quantize(8, block=8)),
    "int4-block6-stochastic": lambda: Quantize(4, block=6, rounding="stochastic"),
    "int8-block2": lambda: Quantize(8, block=2),
}
assert {"none", "fp16", "bf16", "truncate16", "int8", "int4"} <= set(CODECS) | {n.replace("+ef", "") for n in CODECS}


def _inner(codec: Codec) -> Codec:
    return codec.codec if isinstance(codec, ErrorFeedback) else codec


def block_width(codec: Codec, cols: int) -> int:
    """Values that share a fate with their neighbours: a quantizer's block, 1 for element-wise codecs."""
    inner = _inner(codec)
    return min(cols, inner.block) if isinstance(inner, Quantize) else 1


def regions(codec: Codec, n: int, size: int, positions: List[int]) -> np.ndarray:
    """Mask over the n outputs: the element or block of each position. The compressed all-reduce
    puts flat position p in chunk row p // cols, column p % cols, on both phases."""
    cols = codec.padded_cols(max(1, -(-n // size))) if not codec.summable else n
    width = block_width(codec, cols)
    mask = np.zeros(n, bool)
    for p in positions:
        row, col = divmod(p, cols)
        start = row * cols + (col // width) * width
        mask[start:min(start + width, n)] = True
    return mask


def reduce_all(world: LocalWorld, ops, make_codec, inputs: List[List[np.ndarray]]) -> List[List[np.ndarray]]:
    """Each rank reduces its inputs[rank] one after the other with one codec (state carries over);
    returns outputs[rank][call] and checks every residual is finite after every call."""

    def rank_fn(rank, comm):
        codec, outs = make_codec(), []
        for call, x in enumerate(inputs[rank]):
            t = torch.from_numpy(x.copy()) if ops is TORCH_OPS else x.copy()
            if codec.summable:
                payload, ctx = codec.encode(ops, t, key="b", seed=call)
                out = codec.decode(ops, comm.allreduce_async_(payload, f"ar{call}", ReduceOp.AVERAGE).wait(), ctx)
            else:
                out, _ = compressed_allreduce(ops, comm, codec, t, name=f"car{call}", key="b", seed=call,
                                              op=ReduceOp.AVERAGE)
            outs.append(np.asarray(out.numpy() if ops is TORCH_OPS else out, dtype=np.float32).copy())
            if isinstance(codec, ErrorFeedback):
                for key, residual in codec.state_dict()["residuals"].items():
                    held = residual.numpy() if ops is TORCH_OPS else residual
                    assert np.isfinite(held).all(), f"residual {key} holds a non-finite value after call {call}"
        return outs

    return run_threads(world, rank_fn)


specials = st.lists(st.tuples(st.integers(0, 7), st.integers(0, 10 ** 6), st.sampled_from(SPECIAL)),
                    min_size=1, max_size=5)


# report_multiple_bugs=False: a failure shrinks once, not once per distinct error (ranks are threads).
@settings(max_examples=int(150 * SCALE), deadline=None, report_multiple_bugs=False,
          suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(CODECS)), size=st.integers(1, 8), n=st.integers(1, 2100),
       scale=st.sampled_from(SCALES), bad=specials, seed=st.integers(0, 2 ** 32 - 1),
       use_torch=st.booleans())
def test_compressed_allreduce_keeps_bad_values_in_their_own_chunk(name, size, n, scale, bad, seed, use_torch):
    ops = TORCH_OPS if use_torch else NUMPY_OPS
    rng = np.random.default_rng(seed)
    clean = [(rng.standard_normal(n) * scale).astype(np.float32) for _ in range(size)]
    follow_up = [rng.standard_normal(n).astype(np.float32) for _ in range(size)]  # an ordinary next step
    placed = {(rank % size, pos % n): value for rank, pos, value in bad}  # the last value at a place wins
    dirty = [x.copy() for x in clean]
    for (rank, pos), value in placed.items():
        dirty[rank][pos] = value
        clean[rank][pos] = 0.0  # compare against zeros there, so the clean run holds no special value
    hit = sorted({pos for _, pos in placed})

    world = LocalWorld(size, ops)
    got = reduce_all(world, ops, CODECS[name], [[dirty[r], follow_up[r]] for r in range(size)])
    ref = reduce_all(world, ops, CODECS[name], [[clean[r], follow_up[r]] for r in range(size)])

    codec = CODECS[name]()
    outside = ~regions(codec, n, size, hit)
    for call in range(2):
        for rank in range(size):
            assert got[rank][call].tobytes() == got[0][call].tobytes(), f"rank {rank} got other bytes (call {call})"
        a, b = got[0][call], ref[0][call]
        changed = np.flatnonzero(outside & (a.view(np.uint32) != b.view(np.uint32)))
        assert changed.size == 0, (f"{name}, N={size}, n={n}: value {changed[0]} outside the special values' "
                                   f"chunks changed on call {call}: {b[changed[0]]!r} -> {a[changed[0]]!r}")

    first = got[0][0]
    nonfinite = sorted({pos for (_, pos), value in placed.items() if not np.isfinite(value)})
    for p in nonfinite:
        where = regions(codec, n, size, [p])
        if block_width(codec, n if codec.summable else codec.padded_cols(max(1, -(-n // size)))) > 1:
            assert np.isnan(first[where]).all(), f"{name}: the block of non-finite input {p} is not all NaN"
        elif any(np.isnan(value) for (_, q), value in placed.items() if q == p):
            assert np.isnan(first[p]), f"{name}: NaN input {p} came out as {first[p]!r}"
        else:
            assert not np.isfinite(first[p]), f"{name}: non-finite input {p} came out finite ({first[p]!r})"
    assert np.isfinite(got[0][1]).all(), f"{name}: the step after a bad value is not finite everywhere"


@settings(max_examples=int(300 * SCALE), deadline=None, report_multiple_bugs=False)
@given(name=st.sampled_from(sorted(n for n in CODECS if n != "none")), rows=st.integers(1, 8),
       cols=st.integers(1, 1100), scale=st.sampled_from(SCALES),
       bad=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 10 ** 6), st.sampled_from(SPECIAL)),
                    min_size=1, max_size=4), seed=st.integers(0, 2 ** 32 - 1))
def test_codec_roundtrip_keeps_bad_values_in_their_own_block(name, rows, cols, scale, bad, seed):
    """encode/decode of [rows, cols] chunks directly (the shapes the all-reduce hands codecs)."""
    make = CODECS[name]
    cols = make().padded_cols(cols)
    rng = np.random.default_rng(seed)
    clean = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    placed = {(r % rows, c % cols): value for r, c, value in bad}  # the last value at a place wins
    dirty = clean.copy()
    for (r, c), value in placed.items():
        dirty[r, c] = value
        clean[r, c] = 0.0

    def roundtrip(x: np.ndarray) -> Tuple[np.ndarray, Codec]:
        codec = make()
        payload, ctx = codec.encode(NUMPY_OPS, x, key="k", seed=seed)
        assert payload.dtype == np.uint8 and payload.shape[0] == rows
        return np.asarray(codec.decode(NUMPY_OPS, payload, ctx), np.float32), codec

    got, codec = roundtrip(dirty)
    ref, _ = roundtrip(clean)
    width = block_width(codec, cols)
    outside = np.ones((rows, cols), bool)
    for (r, c), value in placed.items():
        start = c // width * width
        outside[r, start:start + width] = False
        if not np.isfinite(value):
            if width > 1:
                assert np.isnan(got[r, start:start + width]).all(), f"{name}: block of a non-finite value not all NaN"
            elif np.isnan(value):
                assert np.isnan(got[r, c]), f"{name}: NaN came out as {got[r, c]!r}"
            else:
                assert got[r, c] == value, f"{name}: {value!r} came out as {got[r, c]!r}"
    assert (got.view(np.uint32) == ref.view(np.uint32))[outside].all(), f"{name}: a value outside its block changed"
    if isinstance(codec, ErrorFeedback):
        assert np.isfinite(codec.residual("k")).all()
