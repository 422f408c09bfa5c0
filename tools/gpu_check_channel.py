"""Section (g) of tools/gpu_check.py: the pipeline's own device path (issue 34).

A one-GPU machine cannot run the channel with two ranks (NCCL refuses two ranks on one device),
so a world of one drives the same code: the channel's device group (``comm/device_group.py``,
NCCL's works waited by their status) behind the shared communicator's issue thread
(``comm/ordered.py``), with the calls the channel's device branch makes.

(g.1) ``g.device-group``: the NCCL group in a world of one, made and used from the issue thread
      while that thread's side stream is busy (a chain of matmuls writes the input just before the
      collective): the result must be what the side stream wrote (NCCL waited for it), read on
      another stream after the wait (the wait ordered it), and the group made once, on that thread.
(g.2) ``g.host-syncs``: the optimizer (int8, width 2) over that path, host syncs per step counted
      with ``torch.cuda.set_sync_debug_mode("warn")``, with the first places that sync.
(g.3) ``g.overlap``: a width-2 step against compute alone and the reduction alone, sized so that
      they take about as long; a step must take at most 1.15 x max(compute, reduction); a profiler
      trace is written and the side streams' kernel time that overlaps other streams is reported.
(g.4) ``g.ef-kernels``: encode (with error feedback) and decode of int8 and int4, each against its
      byte-count ceiling (the bytes it must move at the copy bandwidth); target 85% of it.
(g.5) ``g.keras-codecs``: the Keras codecs on TensorFlow's GPU, bits and speed
      (tools/gpu_check_keras.py; skipped where TensorFlow sees no GPU).

``--device cpu`` runs (g.1) with a Gloo group in place of NCCL and a busy compute thread in place
of the side stream, (g.3) and (g.4) as figures only (the bounds are for an idle GPU); (g.2) is
CUDA only. Not run alone: ``gpu_check.py`` calls :func:`section_g`. The profiler trace goes to
``$PIPESGD_GPU_CHECK_TRACE_DIR`` (default: the temporary directory).
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.comm.base import ReduceOp, postscale_factor
from pipesgd_hvd.comm.device_group import DeviceGroup, nccl_group, watchdog_timeout
from pipesgd_hvd.comm.ordered import OrderedCommunicator
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.ops.torch import TORCH_OPS

from tools.gpu_check_keras import keras_codecs

TIMEOUT = 60.0
TARGET_OF_CEILING = 0.85   # issue 34: the error-feedback kernels' goal, as a share of their ceiling
OVERLAP_BOUND = 1.15       # a width-2 step against max(compute, reduction)


def _gloo_world_of_one(store: Any, rank: int, size: int, timeout: Optional[float]) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = watchdog_timeout(timeout)
    return dist.ProcessGroupGloo(store, rank, size, opts)


class _Handle:
    def __init__(self, work: Any, finish: Callable[[], Any]) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> Any:
        self._work.wait()
        return self._finish()

    def done(self) -> bool:
        return bool(self._work.is_completed())


class DeviceWorldOfOne:
    """A world of one whose device tensors take the channel's device branch (the same group
    calls, on a :class:`DeviceGroup`); host tensors (the flags) a Gloo group. The device group is
    made at the first device collective, on the thread that issues it, as the channel makes it."""

    rank, size = 0, 1

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._store = dist.HashStore()
        self._host = _gloo_world_of_one(dist.PrefixStore("host", self._store), 0, 1, TIMEOUT)
        self.group: Optional[DeviceGroup] = None
        self.made_on: Optional[int] = None

    def _group(self, x: torch.Tensor) -> Any:
        if TORCH_OPS.streams.cuda.device_of(x) is None and self._device.type == "cuda":
            return self._host
        if self.group is None:
            factory = nccl_group if self._device.type == "cuda" else _gloo_world_of_one
            self.group = DeviceGroup(factory(dist.PrefixStore("device", self._store), 0, 1, TIMEOUT), TIMEOUT)
            self.made_on = threading.get_ident()
        return self.group

    def allreduce_async_(self, x: torch.Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> _Handle:
        after = prescale * postscale_factor(op, postscale, 1)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return _Handle(self._group(x).allreduce([x], opts), lambda: x.mul_(after) if after != 1.0 else x)

    def alltoall_async(self, x: torch.Tensor, name: str) -> _Handle:
        x = x.contiguous()
        out = torch.empty_like(x)
        return _Handle(self._group(x).alltoall_base(out, x, [], [], dist.AllToAllOptions()), lambda: out)

    def allgather_async(self, x: torch.Tensor, name: str) -> _Handle:
        x = x.contiguous()
        out = torch.empty_like(x)
        return _Handle(self._group(x)._allgather_base(out, x), lambda: out)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        return [obj]

    def close(self) -> None:
        if self.group is not None:
            self.group.abort()


# ------------------------------------------------------------------------------------ (g.1)
def device_group_world_of_one(report: Any, device: torch.device) -> None:
    world = DeviceWorldOfOne(device)
    comm = OrderedCommunicator(world, TORCH_OPS, name="gpu-check-issue")
    n = 1 << 22 if device.type == "cuda" else 1 << 14
    busy_size = 4096 if device.type == "cuda" else 256
    x = torch.zeros(1, n, device=device)

    def job() -> Tuple[torch.Tensor, torch.Tensor, Any, float]:
        with TORCH_OPS.stream_guard(x):  # the issue thread's side stream, as a comm job runs
            a = torch.randn(busy_size, busy_size, device=device)
            b = torch.randn(busy_size, busy_size, device=device) * busy_size ** -0.5
            for _ in range(20):  # keeps the side stream busy well past the collective's issue
                a = torch.sin(a @ b) * 2.0  # values stay of order 1
            x.copy_(a.reshape(-1)[:n].reshape(1, n))  # busy_size ** 2 >= n
            started = time.perf_counter()
            out = comm.alltoall_async(x, "g.a2a").wait()
            gathered = comm.allgather_async(x, "g.ag").wait()
            issue_s = time.perf_counter() - started
            return out, gathered, TORCH_OPS.ready_marker(out), issue_s

    busy = threading.Event()
    if device.type == "cpu":  # a compute thread in place of the busy side stream
        def spin() -> None:
            a = torch.randn(256, 256)
            while not busy.is_set():
                a = torch.tanh(a @ a * (1.0 / 256))
        threading.Thread(target=spin, daemon=True).start()
    try:
        out, gathered, marker, issue_s = comm.issue_thread.submit(job).result(timeout=300)
    finally:
        busy.set()
    TORCH_OPS.wait_marker(marker)  # this thread's stream after the side stream's
    same = torch.equal(out.cpu(), x.cpu()) and torch.equal(gathered.cpu(), x.cpu()) and bool(x.abs().sum() > 0)
    on_thread = world.made_on == comm.issue_thread.ident
    what = "NCCL" if device.type == "cuda" else "Gloo in place of NCCL"
    report.check(same and on_thread, "g.device-group.world1",
                 f"{what}: alltoall+allgather of {n} values issued from the issue thread behind a busy side stream "
                 f"{'equal what it wrote' if same else 'DIFFER from what it wrote'}; group made "
                 f"{'on the issue thread' if on_thread else 'ON ANOTHER THREAD'}; first issue+wait {issue_s * 1e3:.0f} ms "
                 "(includes making the communicator)")
    comm.close()


# ------------------------------------------------------------------------------------ models
def _model(device: torch.device, width: int, layers: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * width ** -0.5)
    return model.to(device)


def _steps(model: torch.nn.Module, opt: Any, x: torch.Tensor, steps: int, device: torch.device) -> float:
    """Seconds per step of ``steps`` steps (host clock, the device drained before and after)."""
    def drain() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    drain()
    started = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()
    if hasattr(opt, "flush"):
        opt.flush()
    drain()
    return (time.perf_counter() - started) / steps


def _pipelined(model: torch.nn.Module, comm: Any, width: int = 2, **kw: Any) -> Any:
    return psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4), named_parameters=model.named_parameters(),
                                     compression="int8", width=width, communicator=comm, **kw)


# ------------------------------------------------------------------------------------ (g.2)
def host_syncs(report: Any, device: torch.device) -> None:
    if device.type != "cuda":
        report.add("SKIP", "g.host-syncs", "CUDA only (torch.cuda.set_sync_debug_mode)")
        return
    world = DeviceWorldOfOne(device)
    comm = OrderedCommunicator(world, TORCH_OPS, name="gpu-check-issue")
    model = _model(device, 1024, 4)
    opt = _pipelined(model, comm)
    x = torch.randn(256, 1024, device=device)
    _steps(model, opt, x, 3, device)  # warm-up: the first step's checks and allocations
    steps = 8
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                opt.zero_grad()
                (model(x) ** 2).mean().backward()
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    places = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})[:3]
    opt.flush()
    report.add("INFO", "g.host-syncs", f"{len(syncs) / steps:.2f} per step (int8, width 2, the channel's device path "
               f"in a world of one; {steps} steps counted){'; at ' + ', '.join(places) if places else ''}")
    comm.close()


# ------------------------------------------------------------------------------------ (g.3)
def overlap(report: Any, device: torch.device, trace_dir: Path) -> None:
    cuda = device.type == "cuda"
    width, layers = (4096, 4) if cuda else (256, 3)
    world = DeviceWorldOfOne(device)
    comm = OrderedCommunicator(world, TORCH_OPS, name="gpu-check-issue")
    model = _model(device, width, layers)
    steps = 10 if cuda else 4
    reduction = _reduction_alone(comm, sum(p.numel() for p in model.parameters()), device, steps)
    plain = torch.optim.SGD(model.parameters(), lr=1e-4)
    batch, compute = 16, 0.0
    for _ in range(12):  # the batch that makes compute take about as long as the reduction: the hard case
        x = torch.randn(batch, width, device=device)
        compute = _steps(model, plain, x, steps, device)
        if compute >= 0.8 * reduction or batch >= 16384:
            break
        batch *= 2
    pipelined = _steps(model, _pipelined(model, comm), x, steps, device)
    bound = OVERLAP_BOUND * max(compute, reduction)
    trace = _trace(model, _pipelined(model, comm), x, device, trace_dir)
    detail = (f"width-2 step {pipelined * 1e3:.2f} ms; compute {compute * 1e3:.2f} ms, reduction {reduction * 1e3:.2f} ms "
              f"(batch {batch}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M values, int8); bound "
              f"{OVERLAP_BOUND} x max = {bound * 1e3:.2f} ms; {trace}")
    if cuda:
        report.check(pipelined <= bound, "g.overlap.width2", detail)
    else:
        report.add("INFO", "g.overlap.width2", detail + " (figures only on the CPU: the bound is for an idle GPU)")
    comm.close()


def _reduction_alone(comm: Any, numel: int, device: torch.device, steps: int) -> float:
    """Seconds per reduction of ``numel`` values (int8 + error feedback, one bucket) on the issue
    thread's side stream, as the engine runs it, with nothing else to do."""
    from pipesgd_hvd.compression.allreduce import padded_numel, reduce_bucket
    from pipesgd_hvd.ops.seeds import Seed

    codec = resolve_compression("int8")
    flat = torch.zeros(padded_numel(codec, numel, 1), device=device)
    flat[:numel] = torch.randn(numel, device=device)

    def job() -> None:
        with TORCH_OPS.stream_guard(flat):
            out, _ = reduce_bucket(TORCH_OPS, comm, codec, flat, name="g.reduction", key="g", seed=Seed(0),
                                   numel=numel).wait()
            TORCH_OPS.wait_ready(out)  # drained: the next timing starts from an idle device

    comm.issue_thread.submit(job).result()  # warm-up (the residual, the kernels)
    started = time.perf_counter()
    for _ in range(steps):
        comm.issue_thread.submit(job).result()
    return (time.perf_counter() - started) / steps


def _trace(model: torch.nn.Module, opt: Any, x: torch.Tensor, device: torch.device, trace_dir: Path) -> str:
    """Five pipelined steps under the profiler; the chrome trace goes to ``trace_dir``. Returns a
    summary: where the trace is and, on CUDA, how much of the side streams' kernel time ran while
    a kernel of another stream ran."""
    from torch.profiler import ProfilerActivity, profile

    _steps(model, opt, x, 2, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        _steps(model, opt, x, 5, device)
    trace_dir.mkdir(parents=True, exist_ok=True)
    path = trace_dir / f"gpu_check_overlap_{device.type}.json"
    prof.export_chrome_trace(str(path))
    if device.type != "cuda":
        return f"trace {path}"
    kernels = [e for e in json.loads(path.read_text()).get("traceEvents", []) if e.get("cat") == "kernel"]
    return f"trace {path}; {_overlap_share(kernels)}"


def _overlap_share(kernels: List[Dict[str, Any]]) -> str:
    by_stream: Dict[Any, List[Tuple[float, float]]] = {}
    for e in kernels:
        by_stream.setdefault(e.get("args", {}).get("stream"), []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    if len(by_stream) < 2:
        return f"kernels on {len(by_stream)} stream(s): no overlap to measure"
    busiest = max(by_stream, key=lambda s: sum(b - a for a, b in by_stream[s]))  # the compute stream
    others = [iv for s, ivs in by_stream.items() if s != busiest for iv in ivs]
    compute = sorted(by_stream[busiest])
    total = sum(b - a for a, b in others)
    covered = sum(max(0.0, min(b, d) - max(a, c)) for a, b in others for c, d in compute if c < b and a < d)
    return f"side-stream kernel time {total / 1e3:.2f} ms, {covered / max(total, 1e-9):.0%} of it beside compute kernels"


# ------------------------------------------------------------------------------------ (g.4)
# Bytes per value each pass must move: encode with error feedback reads the gradient and the
# residual (4 + 4) and writes the code, the residual (4) and a 4-byte scale per 512 values;
# decode reads the code and the scale and writes 4. A float32 copy moves 8.
CODE_BYTES = {"int8": 1.0, "int4": 0.5}


def ef_kernels(report: Any, device: torch.device, copy_gbs: float, timed: Callable[..., float]) -> None:
    n = (64 << 20) // 4 if device.type == "cuda" else (8 << 20) // 4
    rows = torch.randn(8, n // 8, device=device)
    for name, code in CODE_BYTES.items():
        codec = resolve_compression(name)
        held: Dict[str, Any] = {}

        def encode() -> None:
            held["payload"], held["ctx"] = codec.encode(TORCH_OPS, rows, key="speed", seed=0)

        encode_s = timed(device, encode, 5)
        decode_s = timed(device, lambda: codec.decode(TORCH_OPS, held["payload"], held["ctx"]), 5)
        scale = 4.0 / 512
        phases = {"encode+ef": (8 + code + 4 + scale, encode_s), "decode": (code + scale + 4, decode_s)}
        moved = sum(per_value for per_value, _ in phases.values()) * n / (encode_s + decode_s) / 1e9
        parts = [f"{phase} {per_value * n / seconds / 1e9:.1f} GB/s moved ({per_value:.2f} B/value, {seconds * 1e3:.2f} ms)"
                 for phase, (per_value, seconds) in phases.items()]
        if device.type != "cuda":  # a loaded host's copy bandwidth is no ceiling to compare with
            report.add("INFO", f"g.ef-kernels.{name}", f"{'; '.join(parts)} (host kernels; the target is the GPU's)")
            continue
        # copy_gbs counts the copied tensor's bytes (4 per value) while the copy moves 8.
        share = moved / (2 * copy_gbs)
        report.check(share >= TARGET_OF_CEILING, f"g.ef-kernels.{name}",
                     f"encode+decode {share:.0%} of the byte-count ceiling (target {TARGET_OF_CEILING:.0%}); "
                     f"{'; '.join(parts)}; {n >> 18} M values")


# ------------------------------------------------------------------------------------ entry
def section_g(report: Any, device: torch.device, copy_gbs: float, timed: Callable[..., float],
              trace_dir: Optional[Path] = None) -> None:
    """Every check of section (g); one that crashes is a FAIL line and the others still run."""
    trace_dir = trace_dir or Path(os.environ.get("PIPESGD_GPU_CHECK_TRACE_DIR") or tempfile.gettempdir())
    for name, run in (("g.device-group", lambda: device_group_world_of_one(report, device)),
                      ("g.host-syncs", lambda: host_syncs(report, device)),
                      ("g.overlap", lambda: overlap(report, device, trace_dir)),
                      ("g.ef-kernels", lambda: ef_kernels(report, device, copy_gbs, timed)),
                      ("g.keras-codecs", lambda: keras_codecs(report))):
        try:
            run()
        except Exception:  # noqa: BLE001 - reported; the exit status says FAILED
            report.add("FAIL", f"{name}.crashed", traceback.format_exc().replace("\n", " / ")[-1500:])
