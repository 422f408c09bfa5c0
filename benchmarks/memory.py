"""Peak memory per rank of each configuration beside Horovod's, on model-zoo shapes, broken down.

    python -m benchmarks.memory                                   # every model and configuration, 2 ranks here
    python -m benchmarks.memory --models bert-base --configs horovod w2-int8 --no-doc
    horovodrun -np 2 -H a:1,b:1 python -m benchmarks.memory --rank-run bert-base w2-int8   # one, your ranks
    python -m benchmarks.memory --render build/memory.json                                # tables from a record

Each configuration runs in processes of its own (a rank's peak is the process's: nothing another
configuration left behind may count), ``--ranks`` ranks under ``horovodrun --gloo`` on this
machine: the model (``benchmarks/models.py``) with random weights, the configuration's optimizer
over ``--optimizer`` (AdamW by default), and ``--steps`` updates whose forward and backward passes
are the offloaded compute's with no wait (``benchmarks/offloaded_compute.py``: each parameter's
gradient handed in by autograd, no activations: they are the same in every configuration and
depend on the batch). What is measured, per rank:

* *peak*: the largest number of heap bytes live at any moment from the model's construction to the
  last update, less those live before it (``malloc_count.c``, loaded with ``LD_PRELOAD``, counts
  every malloc-family block by its usable size, in every thread: PyTorch's CPU tensors, numpy's,
  Horovod's own buffers). Exact for the heap; a GPU's counterpart is
  ``torch.cuda.max_memory_allocated`` (``tools/gpu_check.py``, section h).
* *held* at the end of the last update, by owner: each tensor reachable from the model and the
  optimizer counted once per storage (views share it), in this order: the weights, ``.grad``, the
  wrapped optimizer's state, then pipesgd's objects walked attribute by attribute, named by where
  the walk found them (``classify``): the pipeline's fusion buffers (one set per slot of the width),
  reduced gradients in flight or waiting to be applied, error-feedback residuals, the accurate
  mode's copies (``split_batch``: the real weights, the first half's gradient, the optimizer state's
  save buffers), a transport's buffers, anything else of pipesgd's.
* *within a step*: peak less everything held at the end of an update: what lives only during a step
  (a codec's encoded and decoded bucket, autograd's new ``.grad`` before the pipeline's replaces
  it, Horovod's fusion buffer, which no Python object holds).
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import ctypes
import dataclasses
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
MARKER = "MEMORY_RESULT "
SHIM_SOURCE = Path(__file__).with_name("malloc_count.c")
#: The configurations measured by default: Horovod's, width 2 with none / int8 / int4, and the
#: accurate mode (split_batch) without and with int8.
CONFIGS = ("horovod", "w2", "w2-int8", "w2-int4", "w2-split", "w2-split-int8")
CATEGORIES = ("weights", "gradients", "optimizer state", "pipeline buffers", "reduced in flight",
              "error-feedback residuals", "accurate mode's copies", "transport's buffers", "other pipesgd state")
#: Words of a walk's path that name an owner (``classify``): the last in the path wins.
OWNERS = (("_residuals", "error-feedback residuals"),
          ("split", "accurate mode's copies"), ("snapshot", "accurate mode's copies"),
          ("_saved", "accurate mode's copies"), ("correction", "accurate mode's copies"), ("acco", "accurate mode's copies"),
          ("prediction", "accurate mode's copies"),
          ("buffers", "pipeline buffers"),  # the engine's per slot, and a queued step's own (the same)
          ("_queue", "reduced in flight"), ("future", "reduced in flight"), ("reductions", "reduced in flight"),
          ("comm.", "transport's buffers"), ("channel", "transport's buffers"))
#: The issue's memory targets (issue 42), in gradients above Horovod's peak per rank.
TARGETS = {"w2-int8": 1.0, "w2-split-int8": 2.0}


# ------------------------------------------------------------------------------ the counter
class HeapCounter:
    """The LD_PRELOADed counter (``malloc_count.c``) of this process: live bytes, peak, reset."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(None)
        if not hasattr(lib, "psgd_heap_live"):
            raise RuntimeError("the heap counter is not loaded: run under benchmarks/memory.py (it sets "
                               f"LD_PRELOAD={shim_path()})")
        for name in ("psgd_heap_live", "psgd_heap_peak"):
            getattr(lib, name).restype = ctypes.c_longlong
        self._lib = lib

    def live(self) -> int:
        return int(self._lib.psgd_heap_live())

    def peak(self) -> int:
        return int(self._lib.psgd_heap_peak())

    def reset_peak(self) -> None:
        self._lib.psgd_heap_reset_peak()


class CudaCounter:
    """The same readings from PyTorch's CUDA caching allocator (allocated bytes, not reserved)."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch, self.device = torch, device

    def live(self) -> int:
        return int(self.torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(self.torch.cuda.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.reset_peak_memory_stats(self.device)


def shim_path() -> Path:
    """Where the counter's shared object is built, named after its source's hash."""
    digest = hashlib.blake2b(SHIM_SOURCE.read_bytes(), digest_size=6).hexdigest()
    return ROOT / "build" / f"malloc_count-{digest}.so"


def build_shim() -> Path:
    """Compiles ``malloc_count.c`` once (``cc``; concurrent ranks each write their own file and the
    last rename wins, the same bytes)."""
    path = shim_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    cc = os.environ.get("CC", "cc")
    proc = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SHIM_SOURCE)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"could not build the heap counter with {cc} (a C compiler is needed; set CC): "
                           f"{proc.stderr.strip()[-800:]}")
    os.replace(tmp, path)
    return path


def under_counter(argv: Sequence[str]) -> None:
    """Re-executes this rank with the counter preloaded, unless it is (same process id: the launcher's
    environment, Horovod's included, carries over)."""
    if hasattr(ctypes.CDLL(None), "psgd_heap_live"):
        return
    shim = str(build_shim())
    env = dict(os.environ, LD_PRELOAD=" ".join(filter(None, [shim, os.environ.get("LD_PRELOAD", "")])))
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.memory", *argv], env)


# -------------------------------------------------------------------------------- the walk
def storage_of(t: Any) -> Tuple[Tuple[str, int], int]:
    """(a key of ``t``'s storage, its bytes): views of one storage share both."""
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr()), s.nbytes()


def walk(root: Any, path: str, max_depth: int = 14) -> Iterator[Tuple[str, Any]]:
    """(path, tensor) for every tensor reachable from ``root`` through pipesgd's objects: containers,
    the attributes of pipesgd's own objects and dataclasses, a finished future's result, a wrapped
    optimizer's state. Each object once; other libraries' objects are not entered."""
    import torch

    seen, stack = set(), [(root, path, 0)]
    while stack:
        obj, where, depth = stack.pop()
        if id(obj) in seen or depth > max_depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield where, obj
            continue
        if isinstance(obj, (str, bytes, int, float, bool, type(None))):
            continue
        if isinstance(obj, dict):
            items = [(f"{where}[{k!r}]" if isinstance(k, (str, int)) else f"{where}[*]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            items = [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, concurrent.futures.Future):
            done = obj.done() and not obj.cancelled() and obj.exception() is None
            items = [(f"{where}.future", obj.result())] if done else []
        elif isinstance(obj, torch.optim.Optimizer) and not _ours(obj):
            items = [(f"{where}.state", dict(obj.state))]
        elif _ours(obj) or dataclasses.is_dataclass(obj):
            fields = dict(getattr(obj, "__dict__", {}))
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        fields[name] = getattr(obj, name)
            items = [(f"{where}.{k}", v) for k, v in fields.items()]
        else:
            continue
        stack.extend((v, p, depth + 1) for p, v in items)


def _ours(obj: Any) -> bool:
    return type(obj).__module__.startswith("pipesgd_hvd")


def classify(path: str) -> str:
    """The owner a walk's path names (``OWNERS``): the word of it nearest the tensor (a correction
    that holds the pipeline's context reaches the transport's rows through it: those are the
    transport's), else "other pipesgd state"."""
    low = path.lower()
    found = [(low.rfind(word), -i, owner) for i, (word, owner) in enumerate(OWNERS) if word in low]
    return max(found)[2] if found else "other pipesgd state"


def held(model: Any, opt: Any, inner: Any) -> Dict[str, int]:
    """Bytes held now by owner (``CATEGORIES``), each storage once, the first owner in order."""
    counted: Dict[Tuple[str, int], str] = {}
    out = dict.fromkeys(CATEGORIES, 0)

    def add(t: Any, owner: str) -> None:
        key, nbytes = storage_of(t)
        if key not in counted:
            counted[key] = owner
            out[owner] += nbytes

    params = list(model.parameters())
    for p in params:
        add(p, "weights")
    for p in params:
        if p.grad is not None:
            add(p.grad, "gradients")
    for _, t in walk(inner.state, "state"):
        add(t, "optimizer state")
    if opt is not inner:
        for where, t in walk(opt, "opt"):
            add(t, classify(where))
    return out


# ---------------------------------------------------------------------------- one config
def make_optimizer(kind: str, params: Any) -> Any:
    import torch

    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-6)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-6, momentum=0.9)
    raise ValueError(f"unknown optimizer {kind!r}; use adamw or sgd")


def measure_config(key: str, name: str, optimizer: str, steps: int, counter: Any, hvd: Any,
                   device: Any = "cpu") -> Dict[str, Any]:
    """One configuration's peak and what it holds, in this process (see the module docstring).
    ``key``: a configuration of ``benchmarks/step_time.py`` (``horovod``, ``w2-int8``, ...), or
    ``alone`` (the optimizer without communication)."""
    import torch

    from . import models
    from .offloaded_compute import OffloadedCompute
    from .step_time import calls_per_update, options

    with torch.device("meta"):  # the shapes, for the offloaded gradients' pool (before the baseline)
        shapes = models.zoo(name).build()
    compute = OffloadedCompute(models.layers(shapes), forward_s=0.0, backward_s=0.0)
    if device != "cpu":
        compute.pools = {d: p.to(device) for d, p in compute.pools.items()}
        compute.grads = [[g.to(device) for g in grads] for grads in compute.grads]
    del shapes
    gc.collect()
    base = counter.live()
    counter.reset_peak()
    model = models.build(name).to(device)
    inner = make_optimizer(optimizer, model.parameters())
    if key == "alone":
        opt = inner
    elif key == "horovod":  # Horovod's is a new optimizer of a subclass, holding its own state
        opt = inner = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    else:
        import pipesgd_hvd.torch as psgd

        opt = psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), **options(key))
    built = counter.live() - base
    calls, after, peaks = calls_per_update(key), [], []
    for _ in range(steps):
        for _ in range(calls):
            opt.zero_grad()
            compute.loss(models.layers(model), share=1 / calls).backward()
            opt.step()
        if device != "cpu":
            torch.cuda.synchronize(device)
        after.append(held(model, opt, inner))
        peaks.append(counter.peak() - base)  # the running peak: which update set it
    peak = counter.peak() - base
    if hasattr(opt, "flush"):
        opt.flush()
    last = after[-1]
    return {"config": key, "model": name, "optimizer": optimizer, "grad_bytes": models.gradient_bytes(model),
            "peak": peak, "built": built, "held": last, "within_step": peak - sum(last.values()),
            "held_total_max": max(sum(h.values()) for h in after), "peak_by_update": peaks}


def rank_run(name: str, key: str, optimizer: str, steps: int) -> None:
    """This rank's part of one configuration under Horovod (``--rank-run``): rank 0 prints every
    rank's result after ``MARKER``."""
    import horovod.torch as hvd
    import torch

    counter = HeapCounter()
    hvd.init()
    torch.set_num_threads(1)
    hvd.allreduce(torch.zeros(1), name="memory.barrier")  # Horovod's own start-up before the baseline
    result = measure_config(key, name, optimizer, steps, counter, hvd)
    everyone = hvd.allgather_object(result, name="memory.result")
    if hvd.rank() == 0:
        print(MARKER + json.dumps({"ranks": hvd.size(), "per_rank": everyone}), flush=True)


# -------------------------------------------------------------------------------- driver
def launch(name: str, key: str, args: argparse.Namespace) -> Dict[str, Any]:
    """One configuration on ``args.ranks`` ranks of this machine (``horovodrun --gloo``)."""
    horovodrun = Path(sys.executable).with_name("horovodrun")
    cmd = [str(horovodrun), "--gloo", "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", sys.executable, "-m",
           "benchmarks.memory", "--rank-run", name, key, "--optimizer", args.optimizer, "--steps", str(args.steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                                         os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.launch_timeout)
    for line in proc.stdout.splitlines():
        if MARKER in line:
            return json.loads(line.split(MARKER, 1)[1])
    raise RuntimeError(f"{name} {key}: no result (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def measure(args: argparse.Namespace, run: Callable[[str, str, argparse.Namespace], Dict[str, Any]] = launch) -> Dict[str, Any]:
    from .report import machine_line

    start, results = time.perf_counter(), []
    build_shim()  # once, before the ranks race for it
    for name in args.models:
        for key in args.configs:
            began = time.perf_counter()
            results.append(run(name, key, args))
            print(f"[memory] {name} {key}: {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    return {"machine": machine_line(), "args": vars(args), "elapsed_s": time.perf_counter() - start,
            "results": results}


# ------------------------------------------------------------------------------- tables
def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.0f}"


def rows_of(record: Dict[str, Any]) -> Dict[str, Dict[str, Dict[str, Any]]]:
    """Per model, per configuration: the rank with the largest peak (its breakdown)."""
    out: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for result in record["results"]:
        top = max(result["per_rank"], key=lambda r: r["peak"])
        out.setdefault(top["model"], {})[top["config"]] = {**top, "ranks": result["ranks"]}
    return out


def above(rows: Dict[str, Dict[str, Any]], key: str) -> Optional[float]:
    """``key``'s peak above Horovod's, in gradients (None without Horovod's row)."""
    if "horovod" not in rows or key not in rows:
        return None
    return (rows[key]["peak"] - rows["horovod"]["peak"]) / rows[key]["grad_bytes"]


def targets(record: Dict[str, Any]) -> List[Tuple[str, bool, str]]:
    """Issue 42's: width 2 + int8+EF at most 1.0 gradient above Horovod's peak per rank, the accurate
    mode (split_batch, int8+EF) at most 2.0, on every model measured (with Adam for the latter)."""
    out = []
    for name, rows in rows_of(record).items():
        for key, limit in TARGETS.items():
            x = above(rows, key)
            if x is not None:
                out.append((f"{name}: {key} at most {limit:g} x the gradient above Horovod's peak per rank",
                            x <= limit, f"{x:.2f} x"))
    return out


def render(record: Dict[str, Any]) -> str:
    from .report import table

    args = record["args"]
    lines = ["## Peak memory per rank (`benchmarks/memory.py`, `make bench-memory`)", "",
             f"{record['machine']}; {record['elapsed_s'] / 60:.1f} min; {args['ranks']} ranks on this machine "
             f"(`horovodrun --gloo`), one launch per configuration; {args['optimizer']} (lr 1e-6) wrapped; "
             f"{args['steps']} updates, compute off the cores with no wait (no activations). Bytes in MB (10^6); "
             "the last column in gradients (float32, the model's parameter bytes). Samples: `build/memory.json` "
             "(`python -m benchmarks.memory --render build/memory.json`)."]
    header = ["configuration", "peak MB", *[f"{c} MB" for c in CATEGORIES], "within a step MB", "above Horovod, x gradient"]
    for name, rows in rows_of(record).items():
        grad = next(iter(rows.values()))["grad_bytes"]
        body = []
        for key in (k for k in (*args["configs"], "alone") if k in rows):
            r = rows[key]
            x = above(rows, key)
            body.append([key, mb(r["peak"]), *[mb(r["held"][c]) for c in CATEGORIES], mb(r["within_step"]),
                         "" if x is None or key == "horovod" else f"{x:+.2f}"])
        lines += ["", f"### {name} ({grad / 1e6:.0f} MB of gradient)", "", table(header, body)]
    found = targets(record)
    lines += ["", "### Targets", "", f"{sum(ok for _, ok, _ in found)} of {len(found)} targets met.", "",
              table(["target", "result", "measured"], [[n, "met" if ok else "**missed**", m] for n, ok, m in found])]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------- main
def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    from . import models
    from .step_time import select

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(models.names()), metavar="NAME")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), metavar="NAME",
                        help=f"configurations of benchmarks/step_time.py (default: {' '.join(CONFIGS)})")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="sgd: with momentum 0.9")
    parser.add_argument("--steps", type=int, default=6, help="updates per configuration (the pipeline's steady state)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--launch-timeout", type=float, default=600)
    parser.add_argument("--rank-run", nargs=2, metavar=("MODEL", "CONFIG"), help="one configuration on this rank")
    parser.add_argument("--no-doc", action="store_true", help="print the tables; leave docs/ alone")
    parser.add_argument("--render", metavar="JSON", help="no launches: the tables from a saved record")
    args = parser.parse_args(argv)
    try:
        args.models = models.sequence(args.models)
        valid = ("alone", "horovod", *_VALID)
        args.configs = select(args.configs, valid)  # Horovod's always: every row is compared with it
        if args.rank_run and args.rank_run[1] not in valid:
            raise ValueError(f"unknown configuration {args.rank_run[1]!r}; valid: {', '.join(valid)}")
    except ValueError as e:
        parser.error(str(e))
    if args.steps < 3 or args.ranks < 2:
        parser.error("--steps must be >= 3 (a width-2 pipeline fills in 2) and --ranks >= 2")
    return args


def _valid() -> Tuple[str, ...]:
    from .step_time import VALID

    return tuple(k for k in VALID if k not in ("horovod", "auto"))


_VALID = _valid()


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.rank_run:
        under_counter(argv)
        rank_run(args.rank_run[0], args.rank_run[1], args.optimizer, args.steps)
        return
    from .report import write_section

    if args.render:
        record = json.loads(Path(args.render).read_text())
    else:
        record = measure(args)
        saved = ROOT / "build" / f"memory{'-nodoc' if args.no_doc else ''}.json"
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(record))
        print(f"samples kept in {saved}")
    text = render(record)
    if not args.no_doc:
        write_section("memory", text)
    print(text)


if __name__ == "__main__":
    main()
