"""The fused codec kernels (pipesgd_hvd/compression/_kernels.c) against the tensor-op reference.

The reference is the same codec run through a table built with ``fused=False`` (the unfused
compositions in codecs.py and error_feedback.py). Nearest rounding must give the same bits:
payload bytes, decoded floats, error-feedback residuals, decode+sum. Stochastic rounding too, as
both paths add the same noise tensor. Two things are not compared: the codes inside a block whose
scale is NaN (unspecified: the block decodes as NaN whatever they are) and the bits of a NaN
(casts keep it a NaN; PyTorch and numpy do not agree on its payload either).
"""
from __future__ import annotations

from typing import Callable, Dict, List

import numpy as np
import pytest
import torch

from pipesgd_hvd.compression import Cast, Codec, ErrorFeedback, Quantize, Truncate, host_kernels, kernels
from pipesgd_hvd.compression.allreduce import compressed_allreduce
from pipesgd_hvd.ops.numpy import NumpyOps
from pipesgd_hvd.ops.torch import TorchOps
from pipesgd_hvd.testing import LocalWorld
from codec_checks import assert_same_floats, comparable_bytes
from threads import run_threads

# the numpy reference warns about the overflows and NaNs these tests feed it on purpose
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TABLES = {  # name: (fused table, reference table, array -> table's tensor)
    "torch": (TorchOps(), TorchOps(fused=False), lambda a: torch.from_numpy(a.copy())),
    "numpy": (NumpyOps(), NumpyOps(fused=False), lambda a: a.copy()),
}
CODECS: Dict[str, Callable[[], Codec]] = {
    "int8": lambda: Quantize(8), "int4": lambda: Quantize(4),
    "int8-block6": lambda: Quantize(8, block=6), "int4-block2": lambda: Quantize(4, block=2),
    "int8-stochastic": lambda: Quantize(8, rounding="stochastic"),
    "int4-stochastic": lambda: Quantize(4, rounding="stochastic"),
    "fp16": lambda: Cast("float16"), "bf16": lambda: Cast("bfloat16"),
    "truncate16": lambda: Truncate(16), "truncate24": lambda: Truncate(24),
}
F32 = np.finfo(np.float32)


def test_kernels_are_built():
    assert kernels.available(), kernels.UNAVAILABLE


def ties(levels: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """Values x with amax 1 whose scaled value fl(fl(x / 1) * L) is exactly k + 1/2: the
    rounding ties, where round-half-to-even and round-half-away differ."""
    out = [np.float32(1.0)]
    for _ in range(100 * count):
        if len(out) == count:
            break
        x = np.float32((rng.integers(-levels, levels) + 0.5) / levels)
        for _ in range(8):  # walk x by ulps until the product lands on the tie
            y = np.float32(x / np.float32(1.0)) * np.float32(levels)
            frac = y - np.floor(y)
            if frac == 0.5:
                out.append(x)
                break
            x = np.nextafter(x, np.float32(np.inf) if frac < 0.5 else np.float32(-np.inf))
    assert len(out) == count, "no rounding ties found: the test would not test them"
    return np.array(out, np.float32)


def cast_ties(rng: np.random.Generator, count: int) -> np.ndarray:
    """float32 values exactly halfway between two bfloat16 (low 16 bits 0x8000) or two float16
    values (low 13 bits 0x1000, normal and subnormal float16 range), and float16's edges."""
    bits = (rng.standard_normal(count) * 10.0 ** rng.uniform(-7, 4.8, count)).astype(np.float32).view(np.uint32)
    bits = np.where(np.arange(count) % 2 == 0, (bits & ~np.uint32(0xFFFF)) | 0x8000, (bits & ~np.uint32(0x1FFF)) | 0x1000)
    edges = np.array([65504.0, 65519.996, 65520.0, -65520.0, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -24, 2.0 ** -14], np.float32)
    return np.concatenate([edges, bits.astype(np.uint32).view(np.float32)])


def make_rows(rows: int, cols: int, width: int, seed: int, special: bool, levels: int = 127) -> np.ndarray:
    """Rows whose blocks each have their own magnitude: denormal, tiny, ordinary, huge, max float,
    zero, constant, rounding ties; with ``special``, some blocks also hold inf, -inf or NaN."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    flat = x.reshape(-1)
    magnitudes = [2.0 ** -140, 1e-30, 1.0, 1e30, 3e38]
    for start in range(0, flat.size, width):
        kind = rng.integers(0, len(magnitudes) + 5)
        block = flat[start:start + width]
        if kind < len(magnitudes):
            block *= np.float32(magnitudes[kind])
        elif kind == len(magnitudes):
            block[:] = 0.0
            block[::3] = -0.0
        elif kind == len(magnitudes) + 1:
            block[:] = np.float32(-0.3)
        elif kind == len(magnitudes) + 2:
            block[:] = np.resize(ties(levels, min(width, 16), rng), block.size)
        elif kind == len(magnitudes) + 3:
            block[rng.integers(0, block.size)] = F32.max * np.sign(rng.standard_normal())
        else:
            block[:] = np.resize(cast_ties(rng, block.size), block.size)
    if special:
        for value in (np.inf, -np.inf, np.nan):
            flat[rng.integers(0, flat.size)] = value
    return x


def as_numpy(ops, t) -> np.ndarray:
    return np.asarray(ops.to_numpy(t))


def encode_both(name: str, table: str, x: np.ndarray, error_feedback: bool, steps: int = 1):
    """Encode ``x`` (and ``steps - 1`` more gradients) with fresh codecs on both paths."""
    fused, ref, tensor = TABLES[table]
    results = []
    for ops in (fused, ref):
        codec = ErrorFeedback(CODECS[name]()) if error_feedback else CODECS[name]()
        out = []
        for step in range(steps):
            xs = x if step == 0 else np.roll(x, step, axis=1) * np.float32(0.5)  # another gradient
            payload, ctx = codec.encode(ops, tensor(xs), key="k", seed=11 + step)
            residual = codec.residual("k") if error_feedback else None
            out.append((xs, as_numpy(ops, payload), ctx, None if residual is None else as_numpy(ops, residual).copy()))
        results.append((codec, out))
    return results


SHAPES = [(1, 2), (1, 6), (2, 512), (3, 1024), (2, 1536), (1, 4096 + 512)]


@pytest.mark.parametrize("special", [False, True], ids=["finite", "inf-nan"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "ef"])
@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("table", list(TABLES))
def test_encode_equals_reference(table, name, error_feedback, shape, special):
    codec = CODECS[name]()
    rows, cols = shape[0], codec.padded_cols(shape[1])
    width = codec._blocks(cols)[1] if isinstance(codec, Quantize) else 512
    x = make_rows(rows, cols, width, seed=rows * 7919 + cols, special=special, levels=getattr(codec, "levels", 127))
    (codec_f, fused), (_, ref) = encode_both(name, table, x, error_feedback, steps=3 if error_feedback else 1)
    for step, ((xs, p_f, ctx_f, r_f), (_, p_r, ctx_r, r_r)) in enumerate(zip(fused, ref)):
        what = f"{name} step {step}"
        assert ctx_f == ctx_r
        assert np.array_equal(comparable_bytes(codec, p_f, xs), comparable_bytes(codec, p_r, xs)), f"{what}: payload"
        _, ref_ops, tensor = TABLES[table]
        decoded_f = as_numpy(ref_ops, codec_f.decode(TABLES[table][0], tensor(p_f), ctx_f))
        decoded_r = as_numpy(ref_ops, codec.decode(ref_ops, tensor(p_r), ctx_r))
        assert_same_floats(decoded_f, decoded_r, f"{what}: decode")
        if error_feedback:
            assert_same_floats(r_f, r_r, f"{what}: residual")
            assert np.all(np.isfinite(r_f))


@pytest.mark.parametrize("scale", [1.0, 1.0 / 3.0])
@pytest.mark.parametrize("nrows", range(1, 9))
@pytest.mark.parametrize("name", [n for n in CODECS if "stochastic" not in n])
@pytest.mark.parametrize("table", list(TABLES))
def test_decode_sum_is_the_rank_order_sum_of_reference_decodes(table, name, nrows, scale):
    fused, ref, tensor = TABLES[table]
    codec = CODECS[name]()
    cols = codec.padded_cols(1000 + 37 * nrows)
    width = codec._blocks(cols)[1] if isinstance(codec, Quantize) else 512
    x = make_rows(nrows, cols, width, seed=nrows, special=nrows % 3 == 0, levels=getattr(codec, "levels", 127))
    x[1 % nrows] *= np.float32(-1.0)  # rows that cancel: the order of additions shows in the bits
    payload, ctx = codec.encode(ref, tensor(x), key="k", seed=0)
    decoded = as_numpy(ref, codec.decode(ref, payload, ctx))
    expected = np.zeros(cols, np.float32)
    for row in decoded:  # ((0 + row0) + row1) + ... in float32
        expected = expected + row
    if scale != 1.0:
        expected = expected * np.float32(scale)
    got = as_numpy(fused, codec.decode_sum(fused, tensor(as_numpy(ref, payload)), ctx, scale))
    assert got.shape == (1, cols)
    assert_same_floats(got[0], expected, f"{name} decode_sum of {nrows} rows")


@pytest.mark.parametrize("name", ["int8", "int4", "fp16", "truncate16"])
def test_compressed_allreduce_fused_equals_reference_on_every_rank(name):
    size, n = 3, 70001
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(n).astype(np.float32) * (r + 1) for r in range(size)]
    outputs = {}
    for label, ops in (("fused", TorchOps()), ("reference", TorchOps(fused=False))):
        codecs = [ErrorFeedback(CODECS[name]()) if name.startswith("int") else CODECS[name]() for _ in range(size)]
        world = LocalWorld(size, ops)
        steps: List[List[np.ndarray]] = []
        for step in range(2):  # the second step runs on the residuals of the first
            results = run_threads(world, lambda rank, comm: compressed_allreduce(
                ops, comm, codecs[rank], torch.from_numpy(inputs[rank] * np.float32(step + 1)), name=f"t{step}",
                key="b0", seed=rank))
            steps.append([out.numpy() for out, _ in results])
        outputs[label] = steps
    for step in range(2):
        for rank in range(size):
            assert_same_floats(outputs["fused"][step][rank], outputs["reference"][step][rank], f"step {step} rank {rank}")
            assert_same_floats(outputs["fused"][step][rank], outputs["fused"][step][0], "ranks agree")


def test_compressed_allreduce_on_torch_cpu_runs_the_kernels(monkeypatch):
    calls: Dict[str, int] = {}
    native = host_kernels._native

    class Counting:
        def __getattr__(self, attr):
            calls[attr] = calls.get(attr, 0) + 1
            return getattr(native, attr)

    monkeypatch.setattr(host_kernels, "_native", Counting())
    ops = TorchOps()
    world = LocalWorld(1, ops)
    x = torch.randn(5000)
    run_threads(world, lambda rank, comm: compressed_allreduce(
        ops, comm, ErrorFeedback(Quantize(8)), x, name="t", key="b0", seed=0))
    # encode (with error feedback) twice, decode+sum once, decode once; nothing else
    assert calls == {"quantize_encode": 2, "decode_sum": 1, "decode": 1}


def test_tensors_the_kernels_cannot_take_run_the_reference():
    ops, ref = TorchOps(), TorchOps(fused=False)
    base = torch.from_numpy(make_rows(2, 2048, 512, seed=3, special=False))
    strided = base[:, ::2]  # not contiguous: no kernel address
    assert ops.kernel_address(strided) is None and ops.kernel_address(base) is not None
    for codec in (Quantize(8), Cast("float16"), Truncate(16)):
        p_f, ctx = codec.encode(ops, strided, key="k", seed=0)
        p_r, _ = codec.encode(ref, strided, key="k", seed=0)
        assert torch.equal(p_f, p_r)
    # a fp16 payload starting on an odd address cannot be read as uint16: decoded unfused (numpy's
    # reference reads it; PyTorch's cannot view odd offsets as float16 at all)
    np_ops, np_ref = NumpyOps(), NumpyOps(fused=False)
    payload, ctx = Cast("float16").encode(np_ops, base.numpy(), key="k", seed=0)
    odd = np.empty(payload.size + 1, np.uint8)[1:].reshape(payload.shape)
    odd[...] = payload
    assert np_ops.kernel_address(odd) % 2 == 1
    assert np.array_equal(Cast("float16").decode(np_ops, odd, ctx), Cast("float16").decode(np_ref, payload, ctx))


def test_error_feedback_updates_the_residual_in_place():
    ops = TorchOps()
    codec = ErrorFeedback(Quantize(8))
    x = torch.randn(2, 1024)
    codec.encode(ops, x, key="k", seed=0)
    held = codec.residual("k")
    before = held.clone()
    codec.encode(ops, x, key="k", seed=1)
    assert codec.residual("k") is held and not torch.equal(held, before)


def float16_inputs() -> np.ndarray:
    """Every float16 value, the float32 midpoints between neighbours (rounding ties) and one
    float32 ulp either side of them, past-the-maximum values, and random float32 bits."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = np.sort(np.unique(halves[np.isfinite(halves)].astype(np.float32)))
    mids = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    big = np.array([65504.0, 65519.99, 65520.0, 65536.0, 1e9, F32.max], np.float32)
    rand = np.random.default_rng(1).integers(0, 1 << 32, 50000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([halves.astype(np.float32), mids, near, big, -big, rand])


def test_float16_portable_conversion_equals_f16c_and_the_reference():
    """Kind.FP16 uses F16C where the CPU has it; Kind.FP16_SOFT is the bit manipulation used
    where it does not. Both must round like the reference cast, NaNs aside."""
    ops, ref = NumpyOps(), NumpyOps(fused=False)
    x = float16_inputs().reshape(1, -1)
    expected = as_numpy(ref, Cast("float16").encode(ref, x, key="k", seed=0)[0])
    for kind in (kernels.Kind.FP16, kernels.Kind.FP16_SOFT):
        payload = kernels.cast_encode(ops, x, kind)
        assert np.array_equal(comparable_bytes(Cast("float16"), payload, x), comparable_bytes(Cast("float16"), expected, x)), kind
        assert np.all(np.isnan(payload.view(np.float16)[np.isnan(x)])), kind
    every_half = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint8).reshape(1, -1)
    decoded_ref = as_numpy(ref, Cast("float16").decode(ref, every_half, 1 << 16))
    for kind in (kernels.Kind.FP16, kernels.Kind.FP16_SOFT):
        assert_same_floats(kernels.decode(ops, every_half, kind, cols=1 << 16), decoded_ref, f"{kind} decode")
        two = np.concatenate([every_half, every_half[:, ::-1]])
        expected_sum = (np.float32(0) + as_numpy(ref, Cast("float16").decode(ref, two, 1 << 16))).sum(axis=0, dtype=np.float32)
        assert_same_floats(kernels.decode_sum(ops, two, kind, cols=1 << 16, scale=1.0)[0], expected_sum, f"{kind} sum")


def test_without_the_kernels_codecs_warn_and_run_the_reference(monkeypatch):
    monkeypatch.setattr(host_kernels, "_native", None)
    x = torch.from_numpy(make_rows(2, 1024, 512, seed=4, special=False))
    with pytest.warns(RuntimeWarning, match="fused codec kernels are not"):
        payload, ctx = Quantize(8).encode(TorchOps(), x, key="k", seed=0)
    reference, _ = Quantize(8).encode(TorchOps(fused=False), x, key="k", seed=0)
    assert torch.equal(payload, reference)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_reference_decode_sum_adds_rows_in_rank_order(name):
    # 2**24 then 63 ones: in rank order every +1 is lost (float32), as in the kernels; a
    # framework's own sum (torch's vectorised CPU sum, CUDA's tree) adds the ones first.
    # Without the row-by-row reference, torch's table gave 16777278 here (and CUDA other bits).
    _, reference, tensor = TABLES[name]
    codec = Truncate(16)
    rows = np.array([[2.0 ** 24]] + [[1.0]] * 63, np.float32)
    payload, cols = codec.encode(reference, tensor(rows), key="k", seed=0)
    total = Codec.decode_sum(codec, reference, payload, cols)
    assert np.asarray(total).tolist() == [[2.0 ** 24]]
