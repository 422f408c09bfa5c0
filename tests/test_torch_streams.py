"""The CUDA stream rules (pipesgd_hvd/ops/torch_cuda.py), checked on a CPU-only machine.

A fake CUDA table (tests/fake_cuda.py) reports every tensor on a GPU other than cuda:0 and logs
the stream calls. These tests prove that the pipeline makes the calls the rules require; they
cannot prove that the calls suffice on real hardware (that is tools/gpu_check.py --device
cuda's job: bitwise equality with a CUDA_LAUNCH_BLOCKING=1 run under allocation churn).
"""
import threading

import torch

from fake_cuda import FakeCuda
from pipesgd_hvd.auto.controller import TimingProbe
from pipesgd_hvd.compression import Compression, resolve_compression
from pipesgd_hvd.ops.torch import TORCH_OPS, TorchOps
from pipesgd_hvd.pipeline.config import PipelineConfig
from pipesgd_hvd.pipeline.engine import PipelineEngine
from pipesgd_hvd.pipeline.fusion import TensorSpec
from pipesgd_hvd.testing import LocalWorld
from threads import run_threads


def test_side_streams_are_made_per_device_and_thread_on_the_tensors_device():
    fake = FakeCuda(default=1)
    ops = TorchOps(cuda=fake)
    on_1, on_2 = torch.zeros(4), fake.place(torch.zeros(4), 2)
    seen = {}

    def use(tag):
        with ops.stream_guard(on_1):
            first = fake.current_stream(torch.device("cuda", 1))
        with ops.stream_guard(on_1):  # the same stream again in the same thread
            again = fake.current_stream(torch.device("cuda", 1))
        with ops.stream_guard(on_2):
            other = fake.current_stream(torch.device("cuda", 2))
        seen[tag] = (first, again, other)

    threads = [threading.Thread(target=use, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    made = [(stream.device.index) for _, stream in fake.streams]
    assert sorted(made) == [1, 1, 2, 2], made  # one per (device, thread), none on cuda:0
    for first, again, other in seen.values():
        assert first is again and first.device.index == 1 and other.device.index == 2
        assert first.name.startswith("side") and other.name.startswith("side")
    assert seen[0][0] is not seen[1][0]  # threads do not share a side stream
    assert {d.index for _, d in fake.devices_entered} == {1, 2}  # the job's device is made current


def test_markers_are_waited_for_on_their_own_device():
    fake = FakeCuda(default=1)
    ops = TorchOps(cuda=fake)
    marker = ops.ready_marker(fake.place(torch.zeros(2), 3))
    ops.wait_marker(marker)
    waits = [e for e in fake.events if e[1] == "wait"]
    assert len(waits) == 1 and waits[0][2].device.index == 3 and waits[0][3] is marker.event


class _Capturing:
    """A rank's communicator that keeps every collective output (alive, so storage addresses stay unique)."""

    def __init__(self, comm, outputs):
        self._comm, self.outputs = comm, outputs
        self.rank, self.size = comm.rank, comm.size

    def _kept(self, handle):
        outer = self

        class Kept:
            def wait(self):
                out = handle.wait()
                outer.outputs.append(out)
                return out

            def done(self):
                return handle.done()

        return Kept()

    def allreduce_async_(self, *args, **kw):
        return self._comm.allreduce_async_(*args, **kw)

    def alltoall_async(self, x, name):
        return self._kept(self._comm.alltoall_async(x, name))

    def allgather_async(self, x, name):
        return self._kept(self._comm.allgather_async(x, name))

    def allgather_object(self, obj, name):
        return self._comm.allgather_object(obj, name)


def test_every_tensor_that_crosses_streams_is_recorded_on_the_stream_that_reads_it():
    """int8 with error feedback, width 2, two in-process ranks, every tensor "on cuda:1": the
    transport's outputs are recorded on the comm thread's side stream (they are decoded there),
    the bucket on the side stream (read there), each reduced result on the training thread's
    stream (read there); the side stream waits for the bucket's marker, the training stream for
    the result's, both on cuda:1; the job runs with cuda:1 current."""
    fake = FakeCuda(default=1)
    ops = TorchOps(cuda=fake)
    world = LocalWorld(2, TORCH_OPS)
    specs = [TensorSpec("w", (300,), "float32", "cuda:1"), TensorSpec("b", (40,), "float32", "cuda:1")]
    outputs = {0: [], 1: []}
    results = {0: [], 1: []}
    training_thread = {}

    def rank_fn(rank, comm):
        training_thread[rank] = threading.get_ident()
        engine = PipelineEngine(specs, ops=ops, comm=_Capturing(comm, outputs[rank]),
                                codec=resolve_compression(Compression.int8),
                                config=PipelineConfig(width=2, name="streams"))
        for step in range(3):
            engine.begin_step([0, 1])
            engine.add_gradient_(0, torch.full((300,), float(step + rank)))
            engine.add_gradient_(1, torch.full((40,), 1.0))
            for applied in engine.end_step():
                results[rank].extend(applied.grads.values())
        for applied in engine.flush(check_steps=False):
            results[rank].extend(applied.grads.values())
        engine.close()
        return engine

    engines = run_threads(world, rank_fn)
    side_streams = {s for _, s in fake.streams}
    assert side_streams and all(s.device.index == 1 for s in side_streams)
    for rank in (0, 1):
        assert len(outputs[rank]) == 2 * 3  # an alltoall and an allgather per step (one bucket), 3 steps
        for out in outputs[rank]:
            recorded = fake.recorded_on(out)
            assert recorded and all(s in side_streams for s in recorded), (out.shape, recorded)
        for buffers in engines[rank]._buffers.values():
            for flat in buffers:
                assert any(s in side_streams for s in fake.recorded_on(flat))
        for grad in results[rank]:
            assert fake.default_stream(torch.device("cuda", 1)) in fake.recorded_on(grad)
    waits = [e for e in fake.events if e[1] == "wait"]
    side_waits = [e for e in waits if e[2] in side_streams]
    training_waits = [e for e in waits if e[0] in training_thread.values()]
    assert side_waits and all(e[3].stream.name.startswith("default") for e in side_waits)  # the bucket's marker
    assert training_waits and all(e[3].stream in side_streams for e in training_waits)     # the result's marker
    assert {d.index for _, d in fake.devices_entered} == {1}


def test_auto_mode_times_a_gpu_codec_with_events_not_process_cpu_time():
    """On a device tensor the cost a codec takes from compute is its GPU time (two timing events
    around its kernels); process CPU time cannot see it. Also: the probe's wait for the result
    uses a host copy that works for device tensors (to_numpy refuses them)."""
    fake = FakeCuda(default=1, elapsed_ms=4.25)
    ops = TorchOps(cuda=fake)
    world = LocalWorld(2, TORCH_OPS)
    cpu_clock = iter(range(0, 10 ** 6, 7)).__next__  # a process clock that moves 7 s per read

    def rank_fn(rank, comm):
        probe = TimingProbe(cpu_clock=lambda: float(cpu_clock()), repeats=1)
        return probe.reduction(comm, ops, resolve_compression(Compression.int8), torch.randn(2048))

    for seconds, cost in run_threads(world, rank_fn):
        assert cost == 4.25e-3
