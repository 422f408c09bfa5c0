"""Time per step of each staleness correction next to none, PyTorch on CPU (docs/accuracy.md).

One rank over the in-process transport (no network: what is left is the step's compute plus the
correction's element-wise passes and copies), width 2, an MLP of about 4.2 M parameters. The
configurations run interleaved, round after round, and each reports its median step time, so a
machine shared with other jobs slows them alike.

    python benchmarks/corrections_cost.py [--rounds 5] [--steps 20] [--threads 1] [--batch 64]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import torch

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.comm.local import LocalWorld
from pipesgd_hvd.ops.torch import TORCH_OPS

WIDTH, LAYERS = 1024, 4


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: List[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


CONFIGS: Dict[str, tuple] = {  # name: (optimizer, staleness_correction)
    "sgd, none": ("sgd", False),
    "sgd, weight_prediction": ("sgd", "weight_prediction"),
    "sgd, delay_compensation": ("sgd", "delay_compensation"),
    "sgd, eager": ("sgd", "eager"),
    "adam, none": ("adam", False),
    "adam, adam_prediction": ("adam", "adam_prediction"),
}


def trainer(kind: str, correction, batch: int) -> Callable[[int], float]:
    """A closure that runs ``steps`` steps and returns seconds per step."""
    net = model()
    inner = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9) if kind == "sgd" else \
        torch.optim.Adam(net.parameters(), lr=1e-3)
    opt = psgd.DistributedOptimizer(inner, named_parameters=net.named_parameters(), width=2,
                                    communicator=LocalWorld(1, TORCH_OPS).communicator(0),
                                    staleness_correction=correction)
    x, y = torch.randn(batch, WIDTH), torch.randint(0, 10, (batch,))

    def run(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        return (time.perf_counter() - start) / steps

    run(3)  # allocations, the pipeline's fill
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = {name: trainer(*cfg, args.batch) for name, cfg in CONFIGS.items()}
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].append(run(args.steps))
    params = sum(p.numel() for p in model().parameters())
    print(f"MLP {LAYERS}x{WIDTH}, {params / 1e6:.1f} M parameters, batch {args.batch}, {args.threads} thread(s), "
          f"{args.rounds} rounds x {args.steps} steps; median ms/step and ratio to the same optimizer without "
          "correction")
    for name, seconds in times.items():
        base = statistics.median(times[name.split(",")[0] + ", none"])
        median = statistics.median(seconds)
        print(f"| {name} | {median * 1e3:.1f} | {median / base:.3f} |")


if __name__ == "__main__":
    main()
