"""Rank processes of tools/gpu_check.py, sections (e), (f) and (h). Not run by hand.

(e) ``--section e --rank R --world 2 --port P``: two ranks through torch.distributed Gloo (on CUDA
    both use cuda:0: NCCL refuses two ranks on one device, Gloo moves CUDA tensors through the
    host). Every codec trains a few steps: the loss must fall and the replicas stay bitwise equal;
    then width/compression="auto" must decide, the same on both ranks.
(f) ``--section f``: one Horovod rank with NCCL on cuda:0 (``communicator="horovod"``), every
    codec, with and without HOROVOD_ENABLE_ASYNC_COMPLETION (the parent runs it twice): the
    result must equal the plain SGD rule of a world of one, bit for bit.

(h) ``--section h --rank R --world 2 --port P``: two ranks through torch.distributed Gloo as (e);
    per model-zoo shape and configuration (``benchmarks/memory.py``'s, with the wrapped optimizer
    alone in place of Horovod's), AdamW, six updates with compute off the device's time (gradients
    handed in, no activations): the peak of ``torch.cuda.max_memory_allocated`` over the run less what
    was allocated before, and what is held at the end by owner. Checked: the owners add up to at most
    the peak, the weights are the model's bytes, width 2 holds two slots of fusion buffers and
    error feedback its residuals. Reported (INFO): the peak above the optimizer alone, in gradients.
    On the CPU (the test suite) resnet50 only and no peak (the host's is benchmarks/memory.py's).

Each check prints one ``PASS name detail`` or ``FAIL name detail`` line (rank 0 only for (e), (h)).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import sys
from pathlib import Path
from typing import Any, Callable, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository's packages

import torch  # noqa: E402

CODECS = ("none", "fp16", "bf16", "truncate16", "int8", "int4")


def report(ok: bool, name: str, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}".rstrip(), flush=True)


def make_model(device: str, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.to(device)


def batch(device: str, rank: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(64, 32, generator=gen)
    return x.to(device), (x[:, :8] * 0.5).to(device)  # a learnable target: the loss must fall


def train(opt_for: Callable[[torch.nn.Module], Any], device: str, rank: int, steps: int) -> Tuple[torch.nn.Module, List[float]]:
    model = make_model(device)
    opt = opt_for(model)
    losses = []
    for t in range(steps):
        x, y = batch(device, rank, t % 4)  # a few batches seen again: a clear fall in few steps
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    opt.flush()
    return model, losses


def digest(model: torch.nn.Module) -> str:
    h = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def section_e(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import pipesgd_hvd.torch as psgd

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=120))
    device = "cuda:0" if args.device == "cuda" else "cpu"
    lead = args.rank == 0
    for name in CODECS:
        make = lambda m, name=name: psgd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),  # noqa: E731
                                                               named_parameters=m.named_parameters(),
                                                               compression=name, width=2)
        model, losses = train(make, device, args.rank, steps=24)
        everyone = [None] * args.world
        dist.all_gather_object(everyone, (digest(model), losses[0], losses[-1]))
        if lead:
            equal = len({d for d, _, _ in everyone}) == 1
            falls = all(last < 0.7 * first for _, first, last in everyone)
            report(equal and falls, f"e.gloo-2ranks.{name}",
                   f"replicas {'bitwise equal' if equal else 'DIFFER'}; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    opt_holder: List[Any] = []

    def auto(m: torch.nn.Module) -> Any:
        opt = psgd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), named_parameters=m.named_parameters(),
                                        width="auto", compression="auto", auto_measure_steps=3, auto_recheck_every=0)
        opt_holder.append(opt)
        return opt

    train(auto, device, args.rank, steps=6)
    decision = opt_holder[0].auto_decision
    described = None if decision is None else (decision.width, decision.compression)
    everyone = [None] * args.world
    dist.all_gather_object(everyone, described)
    if lead:
        report(described is not None and all(d == described for d in everyone), "e.gloo-2ranks.auto-decides",
               "none" if decision is None else decision.describe())
    dist.destroy_process_group()


def section_f(args: argparse.Namespace) -> None:
    import horovod.torch as hvd

    import pipesgd_hvd.torch as psgd

    hvd.init()
    device = f"cuda:{hvd.local_rank()}"
    plain, _ = train(lambda m: _Plain(torch.optim.SGD(m.parameters(), lr=0.05)), device, 0, steps=8)
    for name in CODECS:
        model, losses = train(lambda m: psgd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05),
                                                                  named_parameters=m.named_parameters(),
                                                                  compression=name, width=1, communicator="horovod"),
                              device, 0, steps=8)
        lossless = name == "none"
        same = digest(model) == digest(plain)
        report(same if lossless else losses[-1] < losses[0], f"f.horovod-nccl.{name}{args.tag}",
               f"{'bitwise equal to plain SGD' if same else 'differs from plain SGD'}; loss {losses[0]:.4f} -> "
               f"{losses[-1]:.4f}")


class _Plain:
    """Plain SGD with the pipelined optimizer's flush(), for train()."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        self.opt.step()

    def flush(self) -> None:
        pass


class _HeldOnly:
    """No peak on the CPU here (``benchmarks/memory.py`` preloads a heap counter for that): zeros."""

    def live(self) -> int:
        return 0

    def peak(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass


def section_h(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from benchmarks import memory

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=300))
    cuda = args.device == "cuda"
    device = "cuda:0" if cuda else "cpu"
    counter = memory.CudaCounter(device) if cuda else _HeldOnly()
    names = ("resnet50", "bert-base", "gpt2") if cuda else ("resnet50",)
    configs = ("alone", "w2", "w2-int8", "w2-int4", "w2-split", "w2-split-int8") if cuda else ("alone", "w2-int8")
    lead = args.rank == 0
    for name in names:
        results = {}
        for key in configs:
            r = memory.measure_config(key, name, "adamw", 6, counter, None, device)
            everyone = [None] * args.world
            dist.all_gather_object(everyone, r)
            results[key] = r = max(everyone, key=lambda x: x["peak"])
            grad, held = r["grad_bytes"], r["held"]
            parts = ", ".join(f"{c} {held[c] / 1e6:.0f}" for c in memory.CATEGORIES if held[c])
            ok = held["weights"] == grad and held["gradients"] >= grad
            if cuda:
                ok = ok and sum(held.values()) <= r["peak"]
            if key.startswith("w2"):
                ok = ok and held["pipeline buffers"] >= 2 * grad
            if key.endswith(("int8", "int4")):
                ok = ok and held["error-feedback residuals"] >= grad
            if lead:
                peak = f"peak {r['peak'] / 1e6:.0f} MB per rank; " if cuda else ""
                report(ok, f"h.memory.{name}.{key}", f"{peak}held MB: {parts}")
        if lead and cuda:
            for key in configs[1:]:
                above = (results[key]["peak"] - results["alone"]["peak"]) / results[key]["grad_bytes"]
                print(f"INFO h.memory.{name}.{key}.above-alone {above:+.2f} x the gradient "
                      f"({results[key]['grad_bytes'] / 1e6:.0f} MB) above the optimizer alone", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--section", choices=("e", "f", "h"), required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    {"e": section_e, "f": section_f, "h": section_h}[args.section](args)


if __name__ == "__main__":
    main()
