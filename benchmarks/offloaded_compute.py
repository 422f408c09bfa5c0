"""Compute off the host's cores: a training step's forward and backward passes as an accelerator
runs them, seen from the host (docs/benchmarks.md, *Compute off the cores*: why).

The forward pass is a wait of its measured time; the backward pass waits its time in one slice per
layer, last layer first, each layer's gradients (fixed tensors that autograd copies into ``.grad``,
the step's one write on the host) arriving after its slice, so hooks fire layer by layer. The
waits sleep: they hold neither a core nor the GIL, as a host thread blocked on its device.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence

import torch


class _DeviceWait(torch.autograd.Function):
    """Identity whose backward first waits ``seconds``: one layer's share of the backward pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


class _LayerGradients(torch.autograd.Function):
    """A zero scalar whose backward hands each parameter its fixed gradient (autograd copies it
    into ``.grad``: the tensors are held here, so it cannot take them)."""

    @staticmethod
    def forward(ctx: Any, grads: Sequence[torch.Tensor], *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.grads = grads
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> Any:  # type: ignore[override]
        return (None, *ctx.grads)


class OffloadedCompute:
    """Forward and backward of ``layers`` (a model's layers, in forward order) taking
    ``forward_s`` and ``backward_s`` of wall time and next to no host CPU."""

    def __init__(self, layers: Sequence[torch.nn.Module], forward_s: float, backward_s: float, seed: int = 0) -> None:
        if forward_s < 0 or backward_s < 0:
            raise ValueError(f"device times must be >= 0, got forward {forward_s} s, backward {backward_s} s")
        if not layers:
            raise ValueError("no layers: an offloaded step needs at least one layer with parameters")
        generator = torch.Generator().manual_seed(seed)
        self.forward_s, self.backward_s = forward_s, backward_s
        # the fixed gradient of each layer's parameters, by position (every model of the launch has
        # the same shapes): views of one random pool as long as the largest tensor, per dtype, so that
        # the emulated device holds one tensor's worth, not a second copy of a model-zoo gradient
        params = [list(layer.parameters()) for layer in layers]
        longest: Dict[torch.dtype, int] = {}
        for p in (p for ps in params for p in ps):
            longest[p.dtype] = max(longest.get(p.dtype, 0), p.numel())
        self.pools = {dtype: torch.randn(n, generator=generator, dtype=dtype) for dtype, n in longest.items()}
        self.grads: List[List[torch.Tensor]] = [[self.pools[p.dtype][:p.numel()].view(p.shape) for p in ps]
                                                for ps in params]

    def loss(self, layers: Sequence[torch.nn.Module], share: float = 1.0) -> torch.Tensor:
        """The step's "loss": waits the forward time, then builds the chain whose backward waits
        a slice per layer and gives each layer its gradients, the last layer's first. ``share``:
        the part of the batch this call computes (split_batch: half), of the measured times."""
        if len(layers) != len(self.grads):
            raise ValueError(f"built for {len(self.grads)} layers, given {len(layers)}")
        time.sleep(self.forward_s * share)
        share = self.backward_s * share / len(layers)
        total: Any = None
        for layer, grads in zip(layers, self.grads):
            term = _LayerGradients.apply(grads, *layer.parameters())
            total = _DeviceWait.apply(term if total is None else total + term, share)
        return total
