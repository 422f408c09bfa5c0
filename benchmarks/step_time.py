"""Step time on your own cluster: Horovod's DistributedOptimizer against pipesgd_hvd, side by side.

    horovodrun -np 2 -H localhost:2 python benchmarks/step_time.py --small     # 2 ranks, this machine
    horovodrun -np 8 -H a:4,b:4 python benchmarks/step_time.py --out step_time.json
    python benchmarks/step_time.py --compare before.json after.json           # after / before, no ranks

Every configuration (``--configs``, names: ``options``) trains its own copy of one model on one
fixed batch, interleaved with the others in rounds (load on the machine hits all alike); every
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


def build(key: str, args: argparse.Namespace, hvd: Any, device: Any = "cpu") -> Tuple[Any, Any]:
    """A configuration's own copy of the model (``args.layers`` x Linear(dim, dim), the same initial
    weights for all) and its optimizer: SGD alone for ``compute*``, wrapped by Horovod or pipesgd."""
    import torch

    import pipesgd_hvd.torch as psgd

    torch.manual_seed(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.dim, args.dim) for _ in range(args.layers)]).to(device)
    inner = torch.optim.SGD(model.parameters(), lr=1e-6)
    if key == "horovod":
        return model, hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    if key.startswith("compute"):
        return model, inner
    one_layer_mb = (args.dim * args.dim + args.dim) * 4 / 2**20
    return model, psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                            auto_measure_steps=args.auto_measure_steps, **options(key, one_layer_mb))


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
        torch.manual_seed(hvd.rank())
        self.x = torch.randn(args.batch, args.dim, device=self.device)
        self.halves = (self.x[: args.batch // 2], self.x[args.batch // 2:])
        self.keys = args.configs
        # compute alone: the same model and inner optimizer, no communication (host time's baseline)
        self.segments = ["compute", *(["compute-split"] if any("-split" in k for k in self.keys) else []), *self.keys]
        self.runs = {key: build(key, args, hvd, self.device) for key in self.segments}
        self.grad_bytes = sum(p.numel() * 4 for p in self.runs["compute"][0].parameters())
        self.samples: Dict[str, Dict[str, List[float]]] = {k: {"wall": [], "main": [], "other": []}
                                                           for k in self.segments}
        self.wire: Dict[str, List[int]] = {k: [0, 0] for k in self.keys}  # bytes sent, a float32 ring's bytes
        self.clock = ThreadClock()

    def update(self, key: str) -> None:
        """One update: one call on the batch, or (split_batch, and its compute-alone) two on its halves."""
        model, opt = self.runs[key]
        halves = self.halves if calls_per_update(key) == 2 else (self.x,)
        for i, x in enumerate(halves):
            opt.zero_grad()
            model(x).square().mean().backward()
            if key != "compute-split" or i == 1:  # compute alone steps its optimizer once per update
                opt.step()
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.hvd.allreduce(self.torch.zeros(1), name="step_time.barrier")

    def segment(self, key: str) -> None:
        model, opt = self.runs[key]
        self.update(key)  # untimed: refills the pipeline flushed at the end of the last segment
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

    def decide_auto(self) -> Optional[str]:
        """Steps the auto optimizer until it has decided (untimed); returns its choice in words."""
        if "auto" not in self.runs:
            return None
        model, opt = self.runs["auto"]
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
                     # the engine counts a float32 ring's bytes per call: per update, calls_per_update of them
                     "wire": sent * calls_per_update(key) / fp32 if fp32 else None,
                     "choice": choice if key == "auto" else None})
    return rows


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 0.01 else f"{seconds * 1e3:.1f}"


def render(result: Dict[str, Any]) -> str:
    from benchmarks.report import table

    args = result["args"]
    head = (f"{result['machine']}; {result['ranks']} ranks, {args['layers']} x Linear({args['dim']}, {args['dim']}) "
            f"({result['grad_bytes'] / 1e6:.2f} MB of float32 gradient), batch {args['batch']} per rank, "
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
    parser.add_argument("--small", action="store_true", help="8 x Linear(256, 256), batch 64: the step path shows")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256, help="per rank, per update (even)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed updates per configuration per round")
    parser.add_argument("--auto-measure-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank (local rank)")
    parser.add_argument("--out", default="step_time.json", help="rank 0 writes the rows and samples here")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print after / before; no ranks")
    args = parser.parse_args(argv)
    if args.small:
        args.dim, args.layers, args.batch = 256, 8, 64
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
