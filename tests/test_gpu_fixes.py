"""The fixes of the GPU issue that a CPU-only machine can check (the stream rules are in
test_torch_streams.py; Keras's XLA check in test_keras_xla.py). Each test fails without its fix.

"meta" tensors stand in for a second device where only the device matters (state loaded with
``map_location="cpu"`` must go back to the bucket's device); single-process Horovod and mpi4py
run in a subprocess, so that this process's transports stay uninitialised for other tests.
"""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import pipesgd_hvd.torch as psgd
from launcher import rank_env, ROOT
from pipesgd_hvd.compression import Compression, resolve_compression
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.pipeline.config import PipelineConfig
from pipesgd_hvd.pipeline.engine import PipelineEngine
from pipesgd_hvd.pipeline.fusion import TensorSpec
from pipesgd_hvd.testing import LocalWorld
from pipesgd_hvd.torch.tensors import TorchAdapter
from pipesgd_hvd.torch.fingerprint import fingerprint
from reference import loss_fn, make_batches, make_model


def _python(code: str, timeout: float = 120) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=rank_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.multiprocess
def test_horovod_bf16_allreduce_and_async_completion():
    """Horovod's PyTorch ops refuse bfloat16 ("Tensor type torch.BFloat16Tensor is not supported"):
    the communicator sums in float32 and writes back. With HOROVOD_ENABLE_ASYNC_COMPLETION a
    finished handle only means the default stream waits for the collective: the stream that reads
    the result (here a side stream of a fake cuda:1) must wait for the default stream."""
    out = _python("""
        import torch, horovod.torch as hvd
        from fake_cuda import FakeCuda
        from pipesgd_hvd.comm.horovod_torch import HorovodTorchCommunicator
        from pipesgd_hvd.ops.torch import TorchOps
        hvd.init()
        x = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
        out = HorovodTorchCommunicator(async_completion=False).allreduce_async_(x, "bf16").wait()
        assert out is x and x.dtype == torch.bfloat16 and x.tolist() == [1.5, -2.25, 3.0], x
        print("PASS bf16")
        fake = FakeCuda(default=1)
        ops = TorchOps(cuda=fake)
        comm = HorovodTorchCommunicator(ops=ops, async_completion=True)
        with ops.stream_guard(torch.zeros(1)):
            side = fake.current_stream(torch.device("cuda", 1))
            got = comm.alltoall_async(torch.ones(1, 4, dtype=torch.uint8), "a2a").wait()
        waits = [e for e in fake.events if e[1] == "wait"]
        assert len(waits) == 1 and waits[0][2] is side, waits
        assert waits[0][3].stream is fake.default_stream(torch.device("cuda", 1)), waits
        print("PASS async-completion")
    """)
    assert "PASS bf16" in out and "PASS async-completion" in out


@pytest.mark.multiprocess
def test_mpi4py_refuses_device_parameters_at_construction_with_the_fix():
    out = _python("""
        import torch
        import pipesgd_hvd.torch as psgd
        from pipesgd_hvd.comm.mpi4py import Mpi4pyCommunicator
        from pipesgd_hvd.ops.torch import TORCH_OPS
        model = torch.nn.Linear(2, 2, device="meta")
        try:
            psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(),
                                      communicator=Mpi4pyCommunicator(TORCH_OPS))
        except ValueError as exc:
            print("RAISED", exc)
    """)
    assert "RAISED" in out and "'weight' is on meta" in out and "communicator='horovod'" in out, out


def test_error_feedback_residual_loaded_on_the_cpu_moves_to_the_buckets_device():
    codec = resolve_compression(Compression.int8)
    codec.load_state_dict({"residuals": {"k": torch.zeros(2, 512)}}, TORCH_OPS)  # map_location="cpu"
    x = torch.zeros(2, 512, device="meta")
    codec.encode(TORCH_OPS, x, key="k", seed=0)
    assert codec.residual("k").device.type == "meta"


def test_in_flight_gradients_loaded_on_the_cpu_move_to_their_tensors_device():
    anchor = torch.zeros(3, device="meta")
    engine = PipelineEngine([TensorSpec("w", (3,), "float32", "meta")], ops=TORCH_OPS,
                            comm=LocalWorld(1, TORCH_OPS).communicator(0), codec=resolve_compression("none"),
                            config=PipelineConfig(width=2, name="load"), device_anchors={"meta": anchor},
                            check_ranks=False)
    engine.load_state_dict({"step": 1, "in_flight": [{"step": 0, "meta": None, "grads": {"w": torch.ones(3)}}],
                            "codec": {}})
    (applied,) = engine.flush(check_steps=False)
    assert applied.grads[0].device.type == "meta"


def test_grad_scaler_scale_is_never_read_on_the_host_during_steps():
    """``GradScaler.get_scale()`` is ``.item()``: a host sync on a GPU, twice per step before."""
    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    reads = []
    get_scale = scaler.get_scale
    scaler.get_scale = lambda: reads.append(1) or get_scale()
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), grad_scaler=scaler,
                                    communicator=LocalWorld(1, TORCH_OPS).communicator(0))
    for (batch,) in make_batches(4, 1):
        opt.zero_grad()
        scaler.scale(loss_fn(model, batch)).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    opt.flush()
    assert reads == [] and opt.engine.step == 4


def test_replica_fingerprints_come_to_the_host_in_one_copy_and_see_one_flipped_bit(monkeypatch):
    named = [(f"p{i}", torch.randn(1000 + i)) for i in range(6)] + [("h", torch.randn(7).half()),
                                                                     ("flag", torch.tensor([True, False]))]
    def fingerprints(named):
        return TorchAdapter(torch.optim.SGD([torch.zeros(1)], lr=0.1), named, False, None).replica_fingerprints()

    copies = []
    cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(self.shape) or cpu(self, *a, **k))
    prints = fingerprints(named)
    monkeypatch.undo()
    assert len(copies) == 1 and [n for n, _ in prints] == [n for n, _ in named]
    again = fingerprints([(n, p.clone()) for n, p in named])
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(prints, again))
    x = named[2][1].clone()
    x.view(torch.int32)[517] ^= 1  # one bit of one element
    assert not torch.equal(fingerprint(x), fingerprint(named[2][1]))
    swapped = named[2][1].clone()
    swapped[[3, 4]] = swapped[[4, 3]]  # same values, other places
    assert not torch.equal(fingerprint(swapped), fingerprint(named[2][1]))


def test_finite_and_zero_checks_read_the_host_once(monkeypatch):
    model = torch.nn.Sequential(*[torch.nn.Linear(3, 3) for _ in range(4)])
    loss_fn(torch.nn.Sequential(model, torch.nn.Linear(3, 3)), (torch.randn(2, 3), torch.randn(2, 3))).backward()
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    communicator=LocalWorld(1, TORCH_OPS).communicator(0))
    reads = []
    to_bool = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: reads.append(1) or to_bool(self))
    assert opt.core.adapter.gradients_finite()
    assert not opt.core.adapter.gradients_all_zero()
    monkeypatch.undo()
    assert len(reads) == 2, len(reads)  # one per check, not one per parameter (8)


def test_weight_prediction_keeps_its_flag_on_the_host_in_eager_steps(monkeypatch):
    """Per parameter and step a tensor flag cost a host-to-device copy and where() kernels."""
    model = make_model()
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), staleness_correction=True,
                                    communicator=LocalWorld(1, TORCH_OPS).communicator(0))
    wheres = []
    where = torch.where
    monkeypatch.setattr(torch, "where", lambda *a, **k: wheres.append(1) or where(*a, **k))
    for (batch,) in make_batches(5, 1):
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()
    with opt.real_weights():
        pass
    opt.flush()
    monkeypatch.undo()
    assert wheres == [] and opt.core.correction.started.variable is None  # a host flag
