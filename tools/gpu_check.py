"""One prepared check of the pipeline on a GPU (or, with ``--device cpu``, the same assertions on the
CPU, which the test suite runs so that the script cannot rot).

    python tools/gpu_check.py --device cuda            # writes docs/gpu.md
    python tools/gpu_check.py --device cpu [--out F]   # prints the report, or writes F

Sections (each check prints PASS/FAIL/SKIP; the exit status is 1 if any check fails):

(a) the device, and the copy bandwidth of a plain tensor copy: the reference for the codecs.
(b) each codec on the device, bit for bit against the CPU reference ops (nearest rounding:
    payload, decode, decode+sum, error-feedback residual); stochastic rounding unbiased;
    encode+decode GB/s and its share of the copy bandwidth. On CUDA under
    ``torch.cuda.set_sync_debug_mode("error")``: no codec pass may sync the host.
(c) the engine on two in-process ranks (threads) with heavy matmuls and allocation churn on the
    default stream while reductions run, every codec, width 1 and 2: final weights bitwise equal
    to a run without churn (on CUDA: a child process with ``CUDA_LAUNCH_BLOCKING=1``, every launch
    synchronous). The ranks exchange through host memory (each on its own streams), so this
    checks the pipeline's own stream handling, not a transport's.
(d) one process, a torch.distributed world of one (NCCL on CUDA, Gloo on CPU), through the
    optimizer: width 1 equals plain SGD, width 2 the stale rule, weight prediction its rule,
    GradScaler (CUDA only) equals plain SGD with the same scaler, a state_dict round trip
    resumes exactly; on CUDA the host syncs per step are counted (reported, not asserted).
(e) two ranks through torch.distributed Gloo (spawned processes; on CUDA both on cuda:0): every
    codec, the loss falls, replicas bitwise equal; the auto mode decides.
(f) Horovod with NCCL, if it is importable and built with NCCL (else a printed skip).
(g) the pipeline's own device path in a world of one: tools/gpu_check_channel.py.
(h) peak memory per rank on the model-zoo shapes (two ranks through Gloo sharing the GPU):
    ``torch.cuda.max_memory_allocated`` per configuration, broken down by owner
    (``benchmarks/memory.py``), against the wrapped optimizer alone (tools/gpu_check_ranks.py).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: the repository's packages
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: runs compare bitwise

import torch  # noqa: E402

import pipesgd_hvd.torch as psgd  # noqa: E402
from tools.gpu_check_channel import section_g  # noqa: E402
from tools.gpu_check_ranks import CODECS, batch, make_model, train  # noqa: E402
from pipesgd_hvd.compression import Quantize, resolve_compression  # noqa: E402
from pipesgd_hvd.ops.torch import TORCH_OPS, TorchOps  # noqa: E402
from pipesgd_hvd.testing import LocalWorld  # noqa: E402

REFERENCE = TorchOps(fused=False)  # the codecs' tensor-op composition, on the CPU


class Report:
    def __init__(self) -> None:
        self.rows: List[Tuple[str, str, str]] = []

    def check(self, ok: bool, name: str, detail: str = "") -> bool:
        return self.add("PASS" if ok else "FAIL", name, detail)

    def add(self, status: str, name: str, detail: str = "") -> bool:
        self.rows.append((status, name, detail))
        print(f"{status} {name} {detail}".rstrip(), flush=True)
        return status != "FAIL"

    @property
    def failed(self) -> bool:
        return any(s == "FAIL" for s, _, _ in self.rows)


def timed(device: torch.device, fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU, after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


@contextlib.contextmanager
def no_host_sync(device: torch.device) -> Iterator[None]:
    """On CUDA, any implicit host sync inside raises (``set_sync_debug_mode("error")``)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ---------------------------------------------------------------------------------- (a)
def section_a(report: Report, device: torch.device, mib: int) -> float:
    n = mib * 2 ** 20 // 4
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    seconds = timed(device, lambda: dst.copy_(src), repeats=5)
    gbs = 4 * n / seconds / 1e9
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    extra = f", CUDA {torch.version.cuda}" if device.type == "cuda" else f", {torch.get_num_threads()} thread(s)"
    report.add("INFO", "a.device", f"{name} (torch {torch.__version__}{extra})")
    report.add("INFO", "a.copy-bandwidth", f"{gbs:.1f} GB/s ({mib} MiB float32 copy; bytes of the tensor per second)")
    return gbs


# ---------------------------------------------------------------------------------- (b)
BYTE_CODECS = ("fp16", "bf16", "truncate16", "int8", "int4")


def section_b(report: Report, device: torch.device, copy_gbs: float, mib: int) -> None:
    ops = TORCH_OPS
    gen = torch.Generator().manual_seed(7)
    rows_cpu = torch.randn(8, 4096, generator=gen) * torch.logspace(-3, 2, 8).reshape(8, 1)
    for name in BYTE_CODECS:
        codec, ref = resolve_compression(name), resolve_compression(name)
        rows = rows_cpu.to(device)
        same = []
        for step in range(2):  # the second step adds the error-feedback residual
            with no_host_sync(device):
                payload, cols = codec.encode(ops, rows, key="k", seed=step)
                decoded = codec.decode(ops, payload, cols)
                total = codec.decode_sum(ops, payload, cols, 0.125)
            rp, rc = ref.encode(REFERENCE, rows_cpu, key="k", seed=step)
            same += [torch.equal(payload.cpu(), rp), torch.equal(decoded.cpu(), ref.decode(REFERENCE, rp, rc)),
                     torch.equal(total.cpu(), ref.decode_sum(REFERENCE, rp, rc, 0.125))]
            residual = getattr(codec, "residual", None)
            if residual is not None:
                same.append(torch.equal(residual("k").cpu(), ref.residual("k")))
        report.check(all(same), f"b.bitwise.{name}", f"{sum(same)}/{len(same)} outputs equal to the CPU reference"
                     + (" (no host sync)" if device.type == "cuda" else ""))
    for bits in (8, 4):
        codec = Quantize(bits, rounding="stochastic")
        x = torch.randn(1, 4096, generator=gen).to(device)
        draws = 200
        with no_host_sync(device):
            total = torch.zeros_like(x)
            for seed in range(draws):
                payload, cols = codec.encode(ops, x, key="k", seed=seed)
                total += codec.decode(ops, payload, cols)
        error = (total / draws - x).cpu()
        step = float(x.abs().max().cpu()) / codec.levels  # one quantization step (one block here)
        bound = 4 * 0.5 * step / (draws * x.numel()) ** 0.5  # 4 sigma of the mean of draws*n roundings
        report.check(abs(float(error.mean())) < bound, f"b.stochastic-unbiased.int{bits}",
                     f"mean error {float(error.mean()):.2e} (4-sigma bound {bound:.2e}) over {draws} draws")
    n = mib * 2 ** 20 // 4
    big = torch.randn(8, n // 8, device=device)
    for name in BYTE_CODECS:
        codec = resolve_compression(name)
        state: Dict[str, Any] = {}

        def encode_decode() -> None:
            payload, cols = codec.encode(ops, big, key="speed", seed=0)
            state["out"] = codec.decode(ops, payload, cols)

        seconds = timed(device, encode_decode, repeats=5)
        gbs = 4 * n / seconds / 1e9
        report.add("INFO", f"b.speed.{name}", f"encode+decode {gbs:.1f} GB/s = {gbs / copy_gbs:.0%} of the copy "
                   f"bandwidth ({mib} MiB float32)")


# ---------------------------------------------------------------------------------- (c)
class HostExchange:
    """A LocalWorld rank that exchanges through host memory: a device tensor is copied to the host
    on the calling thread's current stream (a blocking copy, so it is complete) and results are
    copied back on that stream. Each rank thread touches only its own streams."""

    def __init__(self, comm: Any, device: torch.device) -> None:
        self._comm, self._device = comm, device
        self.rank, self.size = comm.rank, comm.size

    def _back(self, handle: Any, into: Optional[torch.Tensor] = None) -> Any:
        class Back:
            def wait(inner) -> torch.Tensor:
                out = handle.wait()
                return into.copy_(out) if into is not None else out.to(self._device)

            def done(inner) -> bool:
                return handle.done()

        return Back()

    def allreduce_async_(self, x: torch.Tensor, name: str, *args: Any) -> Any:
        return self._back(self._comm.allreduce_async_(x.cpu(), name, *args), into=x)

    def alltoall_async(self, x: torch.Tensor, name: str) -> Any:
        return self._back(self._comm.alltoall_async(x.cpu(), name))

    def allgather_async(self, x: torch.Tensor, name: str) -> Any:
        return self._back(self._comm.allgather_async(x.cpu(), name))

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        return self._comm.allgather_object(obj, name)


def churn(device: torch.device, size: int, garbage: List[torch.Tensor]) -> None:
    """Heavy matmuls and allocation churn on the current (default) stream: memory freed by the
    pipeline's side stream is handed out again at once if it was not recorded properly."""
    a = torch.randn(size, size, device=device)
    for _ in range(3):
        a = torch.tanh(a @ a * (1.0 / size))
    garbage.append(a)
    for k in range(8):
        garbage.append(torch.empty(2 ** (12 + k % 6), device=device).fill_(float(k)))
    del garbage[:-4]


def engine_weights(device: torch.device, name: str, width: int, churn_size: int, steps: int = 6) -> List[torch.Tensor]:
    """Final weights of both ranks (host copies, rank after rank) of a small training run."""
    world = LocalWorld(2, TORCH_OPS)
    results: List[List[torch.Tensor]] = [[], []]
    errors: List[BaseException] = []

    def rank_fn(rank: int) -> None:
        try:
            comm = world.communicator(rank)
            comm = HostExchange(comm, device) if device.type == "cuda" else comm
            model = make_model(str(device))
            opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                            named_parameters=model.named_parameters(), compression=name,
                                            width=width, communicator=comm)
            garbage: List[torch.Tensor] = []
            for t in range(steps):
                x, y = batch(str(device), rank, t)
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()  # reductions start from the hooks
                if churn_size:
                    churn(device, churn_size, garbage)
                opt.step()
                if churn_size:
                    churn(device, churn_size, garbage)
            opt.flush()
            results[rank] = [p.detach().cpu() for p in model.parameters()]
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    import threading

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if errors:
        raise errors[0]
    return results[0] + results[1]


def c_runs(device: torch.device, churn_size: int) -> Dict[str, List[torch.Tensor]]:
    return {f"{name}.width{width}": engine_weights(device, name, width, churn_size)
            for name in CODECS for width in (1, 2)}


def section_c(report: Report, device: torch.device, churn_size: int) -> None:
    churned = c_runs(device, churn_size)
    if device.type == "cuda":
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "blocking.pt"
            env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
            subprocess.run([sys.executable, __file__, "--device", "cuda", "--c-reference", str(out)], env=env,
                           check=True, timeout=600)
            reference = torch.load(out)
        what = "a CUDA_LAUNCH_BLOCKING=1 run"
    else:
        reference = c_runs(device, 0)
        what = "a run without churn"
    for key, weights in churned.items():
        same = all(torch.equal(a, b) for a, b in zip(weights, reference[key]))
        replicas = all(torch.equal(a, b) for a, b in zip(weights[:len(weights) // 2], weights[len(weights) // 2:]))
        report.check(same and replicas, f"c.engine-2ranks.{key}",
                     f"{'bitwise equal to' if same else 'DIFFERS from'} {what}; replicas "
                     f"{'equal' if replicas else 'DIFFER'}")


# ---------------------------------------------------------------------------------- (d)
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rule_weights(device: str, width: int, steps: int, predict: bool = False) -> List[torch.Tensor]:
    """Plain SGD under the pipelined rule (world of one), written without pipeline code: the update
    of step t uses the gradient of step t-width+1; with ``predict`` each gradient is computed at
    w + (w - w_prev), the real weights kept, as weight prediction does."""
    model = make_model(device)
    params = list(model.parameters())
    pending: List[List[torch.Tensor]] = []
    previous: Optional[List[torch.Tensor]] = None
    for t in range(steps):
        real = [p.detach().clone() for p in params]
        with torch.no_grad():
            if predict and previous is not None:
                for p, w, w_prev in zip(params, real, previous):
                    p.copy_(w * 2.0 - w_prev)
        x, y = batch(device, 0, t % 4)
        model.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        pending.append([p.grad.clone() for p in params])
        with torch.no_grad():
            if predict:
                for p, w in zip(params, real):
                    p.copy_(w)
            while len(pending) >= width:
                for p, g in zip(params, pending.pop(0)):
                    p.add_(g, alpha=-0.05)
        previous = real if t > 0 else [p.detach().clone() for p in params]
    with torch.no_grad():
        for grads in pending:  # flush
            for p, g in zip(params, grads):
                p.add_(g, alpha=-0.05)
    return [p.detach().cpu() for p in params]


def section_d(report: Report, device: torch.device) -> None:
    import torch.distributed as dist

    dev = str(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    try:
        def pipelined(width: int, **kw: Any) -> Callable[[torch.nn.Module], Any]:
            return lambda m: psgd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                                       named_parameters=m.named_parameters(), width=width, **kw)

        def weights(model: torch.nn.Module) -> List[torch.Tensor]:
            return [p.detach().cpu() for p in model.parameters()]

        def equal(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
            return all(torch.equal(x, y) for x, y in zip(a, b))

        steps = 8
        report.check(equal(weights(train(pipelined(1), dev, 0, steps)[0]), rule_weights(dev, 1, steps)),
                     "d.world1.width1-equals-plain-sgd")
        report.check(equal(weights(train(pipelined(2), dev, 0, steps)[0]), rule_weights(dev, 2, steps)),
                     "d.world1.width2-equals-stale-rule")
        report.check(equal(weights(train(pipelined(2, staleness_correction=True), dev, 0, steps)[0]),
                           rule_weights(dev, 2, steps, predict=True)), "d.world1.weight-prediction-rule")
        if device.type == "cuda":
            report.check(_scaler_equal(dev, steps), "d.world1.grad-scaler-equals-plain-sgd-with-the-scaler")
        else:
            report.add("SKIP", "d.world1.grad-scaler", "CUDA only (torch's GradScaler scales CUDA autocast losses)")
        report.check(_round_trip(dev), "d.world1.state-dict-round-trip-resumes-exactly", "int8+EF, width 2")
        if device.type == "cuda":
            report.add("INFO", "d.world1.host-syncs-per-step", _host_syncs(dev))
    finally:
        dist.destroy_process_group()


def _scaler_equal(dev: str, steps: int) -> bool:
    def run(pipelined: bool) -> List[torch.Tensor]:
        model = make_model(dev)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 10)
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        opt = psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), width=1,
                                        grad_scaler=scaler) if pipelined else inner
        for t in range(steps):
            x, y = batch(dev, 0, t % 4)
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = ((model(x) - y) ** 2).mean()
            scaler.scale(loss).backward()
            if pipelined:
                opt.synchronize()
                with opt.skip_synchronize():
                    scaler.step(opt)
            else:
                scaler.step(opt)
            scaler.update()
        return [p.detach().cpu() for p in model.parameters()]

    return all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def _round_trip(dev: str) -> bool:
    def make(model: torch.nn.Module) -> Any:
        return psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=model.named_parameters(), compression="int8", width=2)

    def steps(model: torch.nn.Module, opt: Any, ts: range) -> None:
        for t in ts:
            x, y = batch(dev, 0, t)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()

    model = make_model(dev)
    opt = make(model)
    steps(model, opt, range(4))
    saved = {"model": {k: v.cpu() for k, v in model.state_dict().items()}, "opt": opt.state_dict()}
    with tempfile.TemporaryFile() as f:  # through a file, loaded on the CPU, as users restore
        torch.save(saved, f)
        f.seek(0)
        loaded = torch.load(f, map_location="cpu")
    steps(model, opt, range(4, 8))
    opt.flush()
    resumed = make_model(dev)
    resumed.load_state_dict(loaded["model"])
    opt2 = make(resumed)
    opt2.load_state_dict(loaded["opt"])
    steps(resumed, opt2, range(4, 8))
    opt2.flush()
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))


def _host_syncs(dev: str) -> str:
    model = make_model(dev)
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                                    compression="int8", width=2, check_replicas_every=4)
    steps = 8
    for t in range(2):  # warm-up: first-step checks and allocations are not per-step costs
        opt.zero_grad()
        ((model(batch(dev, 0, t)[0]) - batch(dev, 0, t)[1]) ** 2).mean().backward()
        opt.step()
    data = [batch(dev, 0, t) for t in range(steps)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for x, y in data:
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    opt.flush()
    return f"{len(syncs) / steps:.2f} per step (int8, width 2, replica check every 4 steps; {steps} steps counted)"


# ------------------------------------------------------------------------------ (e), (f)
def ranks(args: List[str], world: int, timeout: float = 300, env: Optional[Dict[str, str]] = None) -> List[str]:
    script = str(ROOT / "tools" / "gpu_check_ranks.py")
    procs = [subprocess.Popen([sys.executable, script, *args, "--rank", str(r), "--world", str(world)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))) for r in range(world)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    lines = [line for out in outs for line in out.splitlines() if line.split(" ")[0] in ("PASS", "FAIL", "INFO")]
    if any(p.returncode != 0 for p in procs):
        lines.append("FAIL rank-processes " + " | ".join(o.strip().splitlines()[-1] if o.strip() else "" for o in outs))
    return lines


def add_lines(report: Report, lines: List[str]) -> None:
    for line in lines:
        status, name, *rest = line.split(" ", 2) + [""]
        report.add(status, name, rest[0].strip())


def section_e(report: Report, device: torch.device) -> None:
    add_lines(report, ranks(["--section", "e", "--device", device.type, "--port", str(free_port())], world=2))


def section_h(report: Report, device: torch.device) -> None:
    add_lines(report, ranks(["--section", "h", "--device", device.type, "--port", str(free_port())], world=2,
                            timeout=900))


def section_f(report: Report, device: torch.device) -> None:
    reason = None
    try:
        import horovod.torch as hvd

        if device.type != "cuda":
            reason = "CUDA only"
        elif not hvd.nccl_built():
            reason = "this Horovod was built without NCCL (HOROVOD_GPU_OPERATIONS=NCCL)"
    except ImportError as exc:
        reason = f"Horovod is not importable ({exc})"
    if reason is not None:
        report.add("SKIP", "f.horovod-nccl", reason)
        return
    for tag, env in (("", {}), (".async-completion", {"HOROVOD_ENABLE_ASYNC_COMPLETION": "1"})):
        add_lines(report, ranks(["--section", "f", "--device", "cuda", "--tag", tag], world=1, env=env))


# --------------------------------------------------------------------------------- main
def markdown(report: Report, device: torch.device, seconds: float) -> str:
    lines = ["# GPU check", "",
             f"Written by `python tools/gpu_check.py --device {device.type}` in {seconds:.0f} s. "
             "Every line below is one check of that run (docs/gpu_install.md says what each section proves).", "",
             "| status | check | detail |", "|---|---|---|"]
    lines += [f"| {s} | {n} | {d.replace('|', '/')} |" for s, n, d in report.rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--out", help="where to write the report (default: docs/gpu.md on cuda, stdout on cpu)")
    parser.add_argument("--c-reference", help=argparse.SUPPRESS)  # the CUDA_LAUNCH_BLOCKING=1 child of (c)
    args = parser.parse_args()
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("FAIL a.device --device cuda, but torch.cuda.is_available() is False (a CPU build of torch, or no GPU)")
        return 1
    big = device.type == "cuda"
    if args.c_reference:
        torch.save(c_runs(device, 0), args.c_reference)
        return 0
    started, report = time.perf_counter(), Report()
    copy_gbs = section_a(report, device, mib=256 if big else 16)
    # A section that crashes is one FAIL line with its traceback; the next sections still run, so
    # one (scarce) GPU run shows every problem at once.
    for name, run in (("b", lambda: section_b(report, device, copy_gbs, mib=256 if big else 8)),
                      ("c", lambda: section_c(report, device, churn_size=2048 if big else 96)),
                      ("d", lambda: section_d(report, device)),
                      ("e", lambda: section_e(report, device)),
                      ("f", lambda: section_f(report, device)),
                      ("g", lambda: section_g(report, device, copy_gbs, timed)),
                      ("h", lambda: section_h(report, device))):
        try:
            run()
        except Exception:  # noqa: BLE001 - reported, and the exit status says FAILED
            report.add("FAIL", f"{name}.crashed", traceback.format_exc().replace("\n", " / ")[-1500:])
    seconds = time.perf_counter() - started
    report.add("INFO", "total", f"{seconds:.1f} s; {'FAILED' if report.failed else 'all checks passed'}")
    out = args.out or (str(ROOT / "docs" / "gpu.md") if device.type == "cuda" else None)
    if out:
        Path(out).write_text(markdown(report, device, seconds))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
