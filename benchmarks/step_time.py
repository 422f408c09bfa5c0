"""Step time on your own cluster: Horovod's DistributedOptimizer against pipesgd_hvd, side by side.

    horovodrun -np 2 -H localhost:2 python benchmarks/step_time.py --small     # 2 ranks, this machine
    horovodrun -np 8 -H a:4,b:4 python benchmarks/step_time.py --out step_time.json
    horovodrun -np 8 -H a:4,b:4 python benchmarks/step_time.py --model bert-base --device cuda
    python benchmarks/step_time.py --compare before.json after.json           # after / before, no ranks

Every configuration (``--configs``, names: ``options``) trains its own copy of one model (``--model``:
Linear layers, or a model-zoo shape of ``benchmarks/models.py``) on one fixed batch, interleaved with the others in rounds (load on the machine hits all alike); every
speed-up is over Horovod's. What each column means: docs/benchmarks.md, "Step time on your cluster".
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
LINEAR = "linear"  # --model's default: --layers x Linear(--dim, --dim)
#: Per rank, per update, when --batch is not given: a batch a 40-80 GB GPU trains in float32.
MODEL_BATCH = {LINEAR: 256, "resnet50": 64, "bert-base": 32, "gpt2": 8}
CODECS = ("fp16", "bf16", "truncate16", "int8", "int4")
VALID = ("horovod", "w1", "w2", *(f"w2-{c}" for c in CODECS), "w2-split", *(f"w2-split-{c}" for c in CODECS),
         "auto")
DEFAULT = ("horovod", "w1", "w2", "w2-fp16", "w2-int8", "w2-int4", "w2-split", "w2-split-int8", "auto")


def select(names: Sequence[str], valid: Sequence[str] = VALID, extra: Sequence[str] = ()) -> List[str]:
    """The configurations to run (``names``, each may be a comma list; with ``extra``), in ``valid``'s
    order, Horovod's among them; an unknown name raises, naming the valid ones."""
    names = [n for part in names for n in part.split(",") if n]
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return [k for k in valid if k in {"horovod", *names, *extra}]


def options(key: str, layer_mb: float = 0.0) -> Dict[str, Any]:
    """pipesgd's arguments for a configuration key (not ``horovod``): ``auto``, or ``w<width>`` then,
    each optional: ``-split`` (split_batch), ``-flat``/``-hier`` (hierarchical off/on; neither: the
    default, on where it helps), ``-layer`` (buckets of ``layer_mb``, one layer) or a codec."""
    if key == "auto":
        return {"width": "auto", "compression": "auto", "auto_recheck_every": 0}
    width, *rest = key[1:].split("-")
    extra: Dict[str, Any] = {"width": int(width), "compression": "none"}
    for part in rest:
        if part == "split":
            extra["staleness_correction"] = "split_batch"
        elif part in ("flat", "hier"):
            extra["hierarchical"] = part == "hier"
        elif part == "layer":
            extra["fusion_threshold_mb"] = layer_mb
        else:
            extra["compression"] = part
    return extra


def calls_per_update(key: str) -> int:
    return 2 if "-split" in key else 1


def new_model(args: argparse.Namespace, device: Any = "cpu") -> Any:
    """The model every configuration copies (the same initial weights for all): ``args.model`` from
    ``benchmarks/models.py``, or ``args.layers`` x Linear(dim, dim)."""
    import torch

    name = getattr(args, "model", None) or LINEAR
    if name != LINEAR:
        from benchmarks import models

        return models.build(name).to(device)
    torch.manual_seed(1)
    return torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim) for _ in range(args.layers)]).to(device)


def wrap(key: str, model: Any, args: argparse.Namespace, hvd: Any, inner: Any = None) -> Any:
    """``key``'s optimizer on ``model``: ``inner`` (default SGD) alone for ``compute*``, wrapped by
    Horovod or pipesgd otherwise."""
    import torch

    import pipesgd_hvd.torch as psgd

    inner = inner if inner is not None else torch.optim.SGD(model.parameters(), lr=1e-6)
    if key == "horovod":
        return hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    if key.startswith("compute"):
        return inner
    # "-layer" rows: buckets of the largest layer's bytes (Linear layers: one layer each)
    one_layer_mb = max(sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
                       for m in model.modules()) / 2**20
    return psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                     auto_measure_steps=args.auto_measure_steps, **options(key, one_layer_mb))


def build(key: str, args: argparse.Namespace, hvd: Any, device: Any = "cpu") -> Tuple[Any, Any]:
    """A configuration's own copy of the model (``new_model``) and its optimizer (``wrap``)."""
    model = new_model(args, device)
    return model, wrap(key, model, args, hvd)


class Configurations:
    """Each configuration's model copy and optimizer. ``one_at_a_time``: built when its segment
    starts and dropped when it ends (copies of one template), so that one copy lives at a time: a
    model-zoo copy per configuration, with its optimizer's buffers, would not fit in a GPU's memory
    (11 copies of BERT-base). ``kept`` configurations (``auto``, which keeps what it decided) live
    throughout either way. ``alias_weights`` (one at a time): a copy's parameters are new tensors
    over the template's storage, not a copy of it, for runs whose forward pass never reads the
    weights (compute off the cores): every update still writes them, each configuration in turn."""

    def __init__(self, keys: Sequence[str], args: argparse.Namespace, hvd: Any, device: Any = "cpu",
                 one_at_a_time: bool = False, kept: Sequence[str] = (), alias_weights: bool = False) -> None:
        self.args, self.hvd, self.device, self.one_at_a_time = args, hvd, device, one_at_a_time
        self.alias_weights = alias_weights
        self.template = new_model(args, device) if one_at_a_time else None
        self.runs: Dict[str, Tuple[Any, Any]] = {key: build(key, args, hvd, device) for key in keys
                                                 if key in kept or not one_at_a_time}

    def get(self, key: str) -> Tuple[Any, Any]:
        if key not in self.runs:
            import copy

            memo = ({id(p): torch_parameter(p) for p in self.template.parameters()} if self.alias_weights else {})
            model = copy.deepcopy(self.template, memo)
            self.runs[key] = (model, wrap(key, model, self.args, self.hvd))
        return self.runs[key]

    @property
    def fresh(self) -> bool:
        """Segments start on a new copy (their buffers not yet touched)."""
        return self.one_at_a_time

    def release(self, key: str, kept: Sequence[str] = ()) -> None:
        """Drops ``key``'s copy (one at a time; not the ``kept``): its model, optimizer and buffers,
        Horovod's hooks on them included (collected with them)."""
        if self.one_at_a_time and key not in kept and key in self.runs:
            import gc

            del self.runs[key]
            gc.collect()

    def model(self) -> Any:
        """A model of the run (the template, or the compute-alone copy)."""
        return self.template if self.template is not None else self.runs["compute"][0]


def torch_parameter(p: Any) -> Any:
    """A new parameter over ``p``'s storage (see ``Configurations``)."""
    import torch

    return torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad)


def batch_of(args: argparse.Namespace, generator: Any, device: Any = "cpu") -> Any:
    """The fixed input batch, ``args.batch`` samples: random features for Linear layers, images or
    token ids of ``args.size`` for a model-zoo shape."""
    import torch

    name = getattr(args, "model", None) or LINEAR
    if name == LINEAR:
        return torch.randn(args.batch, args.dim, generator=generator).to(device)
    from benchmarks import models

    return models.zoo(name).inputs(args.batch, generator, args.size).to(device)


def describe_model(args: Dict[str, Any], grad_bytes: int) -> str:
    """The model and batch of a run, in words (its ``args`` as recorded)."""
    name = args.get("model") or LINEAR
    if name == LINEAR:
        return (f"{args['layers']} x Linear({args['dim']}, {args['dim']}) ({grad_bytes / 1e6:.2f} MB of float32 "
                f"gradient), batch {args['batch']} per rank")
    from benchmarks import models

    spec = models.zoo(name)
    unit = f"images of {args['size']}x{args['size']}" if name == "resnet50" else f"sequences of {args['size']} tokens"
    return (f"{name} ({spec.parameters / 1e6:.1f}M parameters in {spec.tensors} tensors, {grad_bytes / 1e6:.1f} MB "
            f"of float32 gradient), {args['batch']} {unit} per rank")


class Bench:
    """This rank's side: one model copy and optimizer per configuration, the timed updates."""

    def __init__(self, args: argparse.Namespace) -> None:
        import horovod.torch as hvd
        import torch

        from benchmarks.thread_cpu import ThreadClock

        hvd.init()
        torch.set_num_threads(args.threads)
        self.hvd, self.torch, self.args = hvd, torch, args
        self.device = torch.device(f"cuda:{hvd.local_rank()}" if args.device == "cuda" else "cpu")
        self.x = batch_of(args, torch.Generator().manual_seed(hvd.rank()), self.device)
        self.halves = (self.x[: args.batch // 2], self.x[args.batch // 2:])
        self.keys = args.configs
        # compute alone: the same model and inner optimizer, no communication (host time's baseline)
        self.segments = ["compute", *(["compute-split"] if any("-split" in k for k in self.keys) else []), *self.keys]
        self.runs = Configurations(self.segments, args, hvd, self.device, one_at_a_time=args.one_at_a_time,
                                   kept=("auto",))
        self.grad_bytes = sum(p.numel() * 4 for p in self.runs.model().parameters())
        self.samples: Dict[str, Dict[str, List[float]]] = {k: {"wall": [], "main": [], "other": []}
                                                           for k in self.segments}
        self.wire: Dict[str, List[int]] = {k: [0, 0] for k in self.keys}  # bytes sent, a float32 ring's bytes
        self.clock = ThreadClock()

    def update(self, key: str) -> None:
        """One update: one call on the batch, or (split_batch, and its compute-alone) two on its halves."""
        model, opt = self.runs.get(key)
        halves = self.halves if calls_per_update(key) == 2 else (self.x,)
        for i, x in enumerate(halves):
            opt.zero_grad()
            model(x).float().square().mean().backward()
            if key != "compute-split" or i == 1:  # compute alone steps its optimizer once per update
                opt.step()
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.hvd.allreduce(self.torch.zeros(1), name="step_time.barrier")

    def segment(self, key: str) -> None:
        model, opt = self.runs.get(key)
        # untimed: refills the pipeline flushed at the end of the last segment; on a new copy, twice
        # (both of a width-2 pipeline's buffers are touched before the timed updates)
        for _ in range(2 if self.runs.fresh and key != "auto" else 1):
            self.update(key)
        stats = getattr(opt, "stats", None)
        before = (stats.bytes_sent, stats.fp32_bytes) if stats is not None else None
        record = self.samples[key]
        for _ in range(self.args.steps):
            (main, other), wall = self.clock.read(), time.perf_counter()
            self.update(key)
            wall, (main1, other1) = time.perf_counter() - wall, self.clock.read()
            record["wall"].append(wall)
            record["main"].append(main1 - main)
            record["other"].append(max(0.0, other1 - other))
        if stats is not None:
            for i, now in enumerate((stats.bytes_sent, stats.fp32_bytes)):
                self.wire[key][i] += now - before[i]
        if hasattr(opt, "flush"):
            opt.flush()
        self.barrier()
        self.runs.release(key, kept=("auto",))

    def decide_auto(self) -> Optional[str]:
        """Steps the auto optimizer until it has decided (untimed); returns its choice in words."""
        if "auto" not in self.segments:
            return None
        model, opt = self.runs.get("auto")
        while opt.auto_decision is None:
            self.update("auto")
        opt.flush()
        self.barrier()
        return opt.auto_decision.describe()

    def run(self) -> Optional[Dict[str, Any]]:
        start = time.perf_counter()
        choice = self.decide_auto()
        for r in range(self.args.rounds):
            # a different configuration goes first each round
            for key in self.segments[r % len(self.segments):] + self.segments[: r % len(self.segments)]:
                self.segment(key)
            if self.hvd.rank() == 0:
                print(f"[step_time] round {r + 1}/{self.args.rounds}, {time.perf_counter() - start:.0f} s in",
                      file=sys.stderr, flush=True)
        everyone = self.hvd.allgather_object({"samples": self.samples, "wire": self.wire}, name="step_time.result")
        if self.hvd.rank() != 0:
            return None
        return {"machine": f"{platform.node()}, {platform.machine()}, Python {platform.python_version()}",
                "ranks": self.hvd.size(), "grad_bytes": self.grad_bytes, "args": vars(self.args),
                "auto_choice": choice, "per_rank": everyone, "rows": summarize(everyone, self.args.configs, choice)}


def summarize(per_rank: List[Dict[str, Any]], keys: Sequence[str], choice: Optional[str]) -> List[Dict[str, Any]]:
    """One row per configuration from every rank's samples (columns: docs/benchmarks.md)."""
    def slowest_median(key: str) -> float:
        return statistics.median(max(v) for v in zip(*(r["samples"][key]["wall"] for r in per_rank)))

    def cpu(key: str, thread: str) -> float:
        return statistics.mean(statistics.median(r["samples"][key][thread]) for r in per_rank)

    horovod = slowest_median("horovod")
    rows = []
    for key in keys:
        base = "compute-split" if calls_per_update(key) == 2 else "compute"
        sent, fp32 = (sum(r["wire"][key][i] for r in per_rank) for i in range(2)) if key != "horovod" else (0, 0)
        step = slowest_median(key)
        rows.append({"config": key, "step_s": step, "speedup": horovod / step, "main_cpu_s": cpu(key, "main"),
                     "host_s": cpu(key, "main") - cpu(base, "main"), "other_cpu_s": cpu(key, "other"),
                     "compute_s": slowest_median(base),
                     # the engine counts both per pipeline step (an update, split_batch's too)
                     "wire": sent / fp32 if fp32 else None,
                     "choice": choice if key == "auto" else None})
    return rows


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 0.01 else f"{seconds * 1e3:.1f}"


def render(result: Dict[str, Any]) -> str:
    from benchmarks.report import table

    args = result["args"]
    head = (f"{result['machine']}; {result['ranks']} ranks, {describe_model(args, result['grad_bytes'])}, "
            f"{args['rounds']} rounds of {args['steps']} updates per configuration")
    rows = [[r["config"], ms(r["step_s"]), f"{r['speedup']:.2f}x", ms(r["host_s"]), ms(r["main_cpu_s"]),
             ms(r["other_cpu_s"]), "-" if r["wire"] is None else f"{r['wire']:.3f}"] for r in result["rows"]]
    text = [head, "", table(["config", "step ms", "speed-up vs horovod", "host ms (training thread beyond compute)",
                             "training thread CPU ms", "other threads CPU ms", "wire / fp32 all-reduce"], rows)]
    compute = {calls_per_update(r["config"]): r["compute_s"] for r in result["rows"]}
    text.append("\ncompute alone per update: " + ", ".join(
        f"{ms(t)} ms ({'two half-batch calls' if n == 2 else 'one call'})" for n, t in sorted(compute.items())))
    if result.get("auto_choice"):
        text.append(f"auto chose: {result['auto_choice']}")
    return "\n".join(text)


def compare(before: Dict[str, Any], after: Dict[str, Any]) -> str:
    """After over before, per configuration both ran: step and host time (e.g. two commits)."""
    from benchmarks.report import table

    old = {r["config"]: r for r in before["rows"]}
    rows = [[r["config"], ms(old[r["config"]]["step_s"]), ms(r["step_s"]), f"{r['step_s'] / old[r['config']]['step_s']:.3f}",
             ms(old[r["config"]]["host_s"]), ms(r["host_s"]),
             f"{r['host_s'] / old[r['config']]['host_s']:.3f}" if old[r["config"]]["host_s"] > 0 else "-"]
            for r in after["rows"] if r["config"] in old]
    return table(["config", "step ms before", "step ms after", "step after / before", "host ms before",
                  "host ms after", "host after / before"], rows)


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT), metavar="NAME",
                        help=f"valid: {', '.join(VALID)} (default: {' '.join(DEFAULT)})")
    parser.add_argument("--model", default=LINEAR, metavar="NAME",
                        help=f"{LINEAR} (--layers x Linear(--dim, --dim)) or a model-zoo shape of benchmarks/models.py: "
                             f"{', '.join(MODEL_BATCH)[len(LINEAR) + 2:]}")
    parser.add_argument("--small", action="store_true", help="8 x Linear(256, 256), batch 64: the step path shows")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, help="per rank, per update (even); default: 256 for Linear layers, "
                        + ", ".join(f"{n} {b}" for n, b in MODEL_BATCH.items() if n != LINEAR))
    parser.add_argument("--size", type=int, help="a model-zoo input's size: the image side (resnet50, default 224) "
                        "or the sequence length (bert-base 128, gpt2 1024)")
    parser.add_argument("--one-at-a-time", action=argparse.BooleanOptionalAction,
                        help="build each configuration's model copy and optimizer for its segment only (default "
                             "with a model-zoo --model: a copy per configuration would not fit)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed updates per configuration per round")
    parser.add_argument("--auto-measure-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank (local rank)")
    parser.add_argument("--out", default="step_time.json", help="rank 0 writes the rows and samples here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print after / before; no ranks")
    args = parser.parse_args(argv)
    if args.model not in MODEL_BATCH:
        parser.error(f"unknown --model {args.model!r}; valid: {', '.join(MODEL_BATCH)}")
    if args.small and args.model != LINEAR:
        parser.error("--small sets Linear layers: leave it out with --model, or use --batch / --size")
    if args.small:
        args.dim, args.layers, args.batch = 256, 8, 64
    if args.batch is None:
        args.batch = MODEL_BATCH[args.model]
    if args.one_at_a_time is None:
        args.one_at_a_time = args.model != LINEAR
    if args.model != LINEAR:
        from benchmarks import models

        args.size = args.size if args.size is not None else models.zoo(args.model).default_size
        low, high = models.zoo(args.model).sizes
        if not low <= args.size <= high:
            parser.error(f"--size must be within {low}..{high} for {args.model}, got {args.size}")
    elif args.size is not None:
        parser.error("--size is a model-zoo input's size: add --model")
    try:
        args.configs = select(args.configs)
    except ValueError as e:
        parser.error(str(e))
    if args.batch < 2 or args.batch % 2:
        parser.error(f"--batch must be even (split_batch takes half per call), got {args.batch}")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse(argv)
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        print(compare(before, after))
        return
    result = Bench(args).run()
    if result is not None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result))
        print(render(result))
        print(f"rows and samples in {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a file: the repository's packages
    main()
