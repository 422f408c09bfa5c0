"""The optimizer recipes, as PyTorch has them (no optimizer of our own).

* ``sgd``: SGD with momentum, the rate per rank times the ranks (Horovod's convention).
* ``adamw``: AdamW with the task's betas and weight decay.
* ``nadamw``: ``torch.optim.NAdam`` with decoupled weight decay, betas (0.99, 0.999): the recipe
  said to tolerate a delay (AsyncPP, ICML 2025). PyTorch's NAdam ramps its momentum,
  mu_t = beta1 (1 - 0.5 * 0.96^(momentum_decay * t)); at the default 0.004 it is 0.60 after 1500
  steps, far from beta1, so ``momentum_decay`` is set to end the ramp with the warm-up
  (:func:`nadam_momentum_decay`).
* ``muon``: ``torch.optim.Muon`` (momentum 0.95, Nesterov) for the transformer blocks' 2-D weights,
  AdamW for the embeddings, the head, norms and biases (Muon takes matrices only, and embeddings
  and heads are not hidden layers). ``adjust_lr_fn="match_rms_adamw"`` scales Muon's update to
  AdamW's RMS, so both take the rate and weight decay tuned for AdamW. The fused QKV projection
  (``in_proj_weight``, 3d x d) is orthogonalised as one matrix. Two optimizers, so two
  ``DistributedOptimizer``s, each with its own pipeline.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

Named = List[Tuple[str, torch.nn.Parameter]]
RAMP_LEFT = 0.02   # NAdam: 0.96^(momentum_decay * warm-up) -> mu = beta1 (1 - RAMP_LEFT / 2) when warm-up ends


def nadam_momentum_decay(warmup_updates: int) -> float:
    """The ``momentum_decay`` whose ramp leaves RAMP_LEFT of it at the end of the warm-up."""
    return math.log(RAMP_LEFT) / math.log(0.96) / max(1, warmup_updates)


def nadam_mu(beta1: float, momentum_decay: float, t: int) -> float:
    """PyTorch NAdam's momentum coefficient at step t (1-based)."""
    return beta1 * (1.0 - 0.5 * 0.96 ** (momentum_decay * t))


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """Muon's share: 2-D weights inside the transformer blocks."""
    return p.ndim == 2 and name.startswith("blocks.")


def build(kind: str, named: Named, lr: float, ranks: int, momentum: float, betas: Sequence[float],
          weight_decay: float, warmup_updates: int) -> List[Tuple[torch.optim.Optimizer, Named]]:
    """The wrapped optimizer(s) of recipe ``kind``, each with the model's named parameters it updates."""
    params = [p for _, p in named]
    if kind == "sgd":
        return [(torch.optim.SGD(params, lr=lr * ranks, momentum=momentum), named)]
    if kind == "adamw":
        return [(torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay), named)]
    if kind == "nadamw":
        return [(torch.optim.NAdam(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                                   decoupled_weight_decay=True,
                                   momentum_decay=nadam_momentum_decay(warmup_updates)), named)]
    if kind == "muon":
        hidden = [(n, p) for n, p in named if is_hidden_matrix(n, p)]
        rest = [(n, p) for n, p in named if not is_hidden_matrix(n, p)]
        muon = torch.optim.Muon([p for _, p in hidden], lr=lr, weight_decay=weight_decay, momentum=0.95,
                                nesterov=True, adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW([p for _, p in rest], lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        return [(muon, hidden), (adamw, rest)]
    raise ValueError(f"unknown optimizer recipe {kind!r}")
