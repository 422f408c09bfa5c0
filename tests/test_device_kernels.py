"""Dispatch of the fused codec kernels on device tensors (ops' kernel_device, compression/device_kernels.py).

The Triton kernels themselves cannot run here (no GPU; tools/gpu_check.py compares them bit
for bit with the CPU reference on one). What this checks on the CPU, with a fake CUDA table: a
device tensor goes to the device kernels when they load, to the tensor-op reference when Triton
is not importable (never to the host C kernels, which would read device memory), and each codec
pass reaches the kernel meant for it."""
import importlib

import pytest
import torch

from fake_cuda import FakeCuda
from pipesgd_hvd.compression import Quantize, Truncate, device_kernels, host_kernels, kernels, resolve_compression
from pipesgd_hvd.compression.allreduce import compressed_allreduce
from pipesgd_hvd.ops.torch import TorchOps
from pipesgd_hvd.testing import LocalWorld
from threads import run_threads

REFERENCE = TorchOps(fused=False)


class StubKernels:
    """Stands in for triton_kernels: records each call and answers with the reference ops."""

    def __init__(self):
        self.calls = []

    def quantize_encode(self, x, *, width, bits, noise=None, residual=None, error_feedback=False):
        self.calls.append("quantize_encode")
        codec = Quantize(bits, block=width)
        y = x + residual if residual is not None else x
        payload, cols = codec.encode(REFERENCE, y, key="k", seed=0)
        new = REFERENCE.finite_or_zero(y - codec.decode(REFERENCE, payload, cols)) if error_feedback else None
        return payload, new

    def quantize_decode(self, payload, *, cols, width, bits):
        self.calls.append("quantize_decode")
        return Quantize(bits, block=width)._decode_ops(REFERENCE, payload, cols)

    def quantize_decode_sum(self, payload, *, cols, width, bits, scale):
        self.calls.append("quantize_decode_sum")
        total = Quantize(bits, block=width)._decode_ops(REFERENCE, payload, cols).sum(0, keepdim=True)
        return total * scale if scale != 1.0 else total

    def cast_encode(self, x, *, layout):
        self.calls.append("cast_encode")
        return resolve_compression(layout).encode(REFERENCE, x, key="k", seed=0)[0]

    def cast_decode(self, payload, *, cols, bf16):
        self.calls.append("cast_decode")
        halves = payload.view(torch.int16).to(torch.int32)  # bf16 / truncation: the upper half
        return (halves << 16).view(torch.float32) if bf16 else payload.view(torch.float16).float()

    def cast_decode_sum(self, payload, *, cols, bf16, scale):
        self.calls.append("cast_decode_sum")
        total = self.cast_decode(payload, cols=cols, bf16=bf16).sum(0, keepdim=True)
        self.calls.pop()  # the decode above is this kernel's own
        return total * scale if scale != 1.0 else total


def _reduce(ops, name, size=2):
    inputs = [torch.randn(3000, generator=torch.Generator().manual_seed(r)) for r in range(size)]

    def rank_fn(rank, comm):
        codec = resolve_compression(Truncate(24) if name == "truncate24" else name)
        return [compressed_allreduce(ops, comm, codec, inputs[rank].clone(), name="t", key="k", seed=step)[0]
                for step in range(2)]  # two steps: the second uses the error-feedback residual

    return run_threads(LocalWorld(size, REFERENCE), rank_fn)


@pytest.mark.parametrize("name,expected", [
    ("int8", {"quantize_encode", "quantize_decode_sum", "quantize_decode"}),
    ("int4", {"quantize_encode", "quantize_decode_sum", "quantize_decode"}),
    ("fp16", {"cast_encode", "cast_decode_sum", "cast_decode"}),
    ("bf16", {"cast_encode", "cast_decode_sum", "cast_decode"}),
    ("truncate16", {"cast_encode", "cast_decode_sum", "cast_decode"}),
    ("truncate24", set()),  # no device kernel for 3-byte values: the reference ops
])
def test_device_tensors_reach_the_device_kernels_and_get_the_reference_result(monkeypatch, name, expected):
    stub = StubKernels()
    monkeypatch.setattr(device_kernels, "load", lambda device: stub)
    got = _reduce(TorchOps(cuda=FakeCuda()), name)
    assert set(stub.calls) == expected
    for mine, ref in zip(got, _reduce(REFERENCE, name)):
        assert all(torch.equal(a, b) for a, b in zip(mine, ref))


def test_without_triton_device_tensors_run_the_reference_not_the_host_kernels(monkeypatch):
    real_import = importlib.import_module

    def no_triton(name, *args):
        if name == "triton":
            raise ImportError("No module named 'triton'")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_triton)
    device_kernels.load.cache_clear()
    class NoHostKernels:  # the C kernels read host memory: a device tensor must never reach them
        def __getattr__(self, name):
            raise AssertionError(f"host kernel {name} called for a device tensor")

    monkeypatch.setattr(host_kernels, "_native", NoHostKernels())
    try:
        assert device_kernels.load("cuda") is None
        ops = TorchOps(cuda=FakeCuda())
        for name in ("int8", "int4", "fp16"):
            for mine, ref in zip(_reduce(ops, name), _reduce(REFERENCE, name)):
                assert all(torch.equal(a, b) for a, b in zip(mine, ref))
    finally:
        device_kernels.load.cache_clear()


def test_host_tensors_never_load_the_device_kernels(monkeypatch):
    monkeypatch.setattr(device_kernels, "load", lambda device: pytest.fail("device kernels loaded for a host tensor"))
    _reduce(TorchOps(), "int8")
    assert kernels.accepts(TorchOps(), torch.zeros(2, 4))
