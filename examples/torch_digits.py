"""Digits (sklearn's 8x8 handwritten digits) on an MLP, trained data-parallel with horovodrun,
synchronous and pipelined side by side.

    horovodrun -np 2 -H localhost:2 python examples/torch_digits.py
    horovodrun -np 2 -H localhost:2 python examples/torch_digits.py --configs 1:none 2:none 2:int8 2:int4

Each configuration ``WIDTH:COMPRESSION`` trains its own copy of the same initial model on the
same data order. Rank 0 alone prints: one line per epoch (test accuracy of each configuration),
then a table of the final accuracy, training time and bytes on the wire.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import List

import horovod.torch as hvd
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import pipesgd_hvd.torch as psgd


@dataclass
class Run:
    width: int
    compression: str
    model: torch.nn.Module
    optimizer: psgd.DistributedOptimizer
    accuracy: List[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return f"width={self.width} {self.compression}"


def load_data(rank: int, size: int):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return x_train[rank::size], y_train[rank::size], x_test, y_test  # each rank its own shard


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def test_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, name: str) -> float:
    with torch.no_grad():
        correct = (model(x).argmax(dim=1) == y).float().mean()
    return float(hvd.allreduce(correct, name=name))  # averaged over ranks, as Horovod's examples do


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["1:none", "2:none"], help="WIDTH:COMPRESSION ...")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by the number of ranks")
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    x_train, y_train, x_test, y_test = load_data(rank, size)

    runs: List[Run] = []
    for config in args.configs:
        width, compression = config.split(":")
        model = make_model(args.seed)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        inner = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
        opt = psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), width=int(width),
                                        compression=compression, warmup_steps=args.warmup_steps)
        runs.append(Run(int(width), compression, model, opt))

    steps = len(x_train) // args.batch_size

    def say(text: str) -> None:
        """Rank 0 alone speaks, one write per line: horovodrun tags each write with the rank, and
        print() writes a line's text and its newline apart."""
        if rank == 0:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    say(f"digits: {len(x_train) * size} training images on {size} ranks, {len(x_test)} test images; "
        f"{args.epochs} epochs of {steps} steps, configurations {' | '.join(r.label for r in runs)}")
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(1000 * epoch + rank))
        for run in runs:
            start = time.perf_counter()
            run.model.train()
            for s in range(steps):
                batch = order[s * args.batch_size:(s + 1) * args.batch_size]
                run.optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(run.model(x_train[batch]), y_train[batch])
                loss.backward()
                run.optimizer.step()
            if epoch == args.epochs - 1:
                run.optimizer.flush()  # apply the gradient still in flight
            run.seconds += time.perf_counter() - start
            run.accuracy.append(test_accuracy(run.model, x_test, y_test, f"acc.{run.label}"))
        say(f"epoch {epoch + 1:2d}/{args.epochs}  test accuracy  "
            + " | ".join(f"{r.label}: {r.accuracy[-1]:.4f}" for r in runs))
    rows = [(r.label, f"{r.accuracy[-1]:.4f}", f"{r.seconds:.1f}", f"{r.optimizer.stats.ratio:.3f}") for r in runs]
    header = ("configuration", "test accuracy", "training s", "wire bytes vs float32")
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        say("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


if __name__ == "__main__":
    main()
