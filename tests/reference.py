"""A plain reference of the pipelined update rule, written without any engine code:

    w_{t+1} = w_t - lr * mean_i g_i(t - K + 1)    (nothing applied while the pipeline fills)

Used by both the in-process and the multi-process tests.
"""
from __future__ import annotations

from typing import Callable, List, Sequence

import torch


def make_model(seed: int = 0) -> torch.nn.Module:
    """A small MLP whose weights depend only on ``seed`` (its own generator: ranks may be threads)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def make_batches(steps: int, ranks: int, seed: int = 1) -> List[List[tuple]]:
    """batches[t][r] = (x, y): every rank gets a different batch at every step."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(ranks)]
            for _ in range(steps)]


def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def mean_gradient(model: torch.nn.Module, batches: Sequence, passes: int = 1) -> List[torch.Tensor]:
    """The average over ranks of each rank's gradient at the current weights. With ``passes`` > 1,
    ``batches[r]`` is a list of micro-batches whose gradients rank r accumulates."""
    per_rank = []
    for batch in batches:
        model.zero_grad()
        for micro in (batch if passes > 1 else [batch]):
            loss_fn(model, micro).backward()
        per_rank.append([p.grad.clone() for p in model.parameters()])
    out = []
    for i in range(len(per_rank[0])):
        acc = per_rank[0][i].clone()
        for grads in per_rank[1:]:
            acc = acc + grads[i]  # rank order, then 1/N: what an averaging all-reduce computes
        out.append(acc * (1.0 / len(per_rank)))
    return out


def reference_sgd(steps: int, ranks: int, width: int, lr: float = 0.1, warmup: int = 0,
                  passes: int = 1, seed: int = 0,
                  batches: Callable[[int], Sequence[tuple]] = None, predict: bool = False,
                  flush: bool = False) -> List[torch.Tensor]:
    """Final weights of plain SGD under the pipelined rule with width K after ``steps`` steps.

    ``predict``: weight prediction, each gradient computed at w_t + (w_t - w_{t-1}), except at
    steps 0 and 1, computed at w_t (no update to extrapolate with yet); the real weights are
    returned. ``flush``: then apply what is still in flight."""
    model = make_model(seed)
    params = list(model.parameters())
    pending: List[List[torch.Tensor]] = []
    previous = None

    def apply(grads: List[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.add_(g, alpha=-lr)  # what torch.optim.SGD does without momentum

    for t in range(steps):
        real = [p.detach().clone() for p in params]
        if predict and previous is not None:
            with torch.no_grad():
                for p, w, w_prev in zip(params, real, previous):
                    p.copy_(w * 2.0 - w_prev)
        grads = mean_gradient(model, batches(t), passes)
        if predict:
            with torch.no_grad():
                for p, w in zip(params, real):
                    p.copy_(w)
        pending.append(grads)
        k = 1 if t < warmup else width
        while len(pending) >= k:
            apply(pending.pop(0))
        previous = real if t > 0 else [p.detach().clone() for p in params]
    while flush and pending:
        apply(pending.pop(0))
    return [p.detach().clone() for p in params]
