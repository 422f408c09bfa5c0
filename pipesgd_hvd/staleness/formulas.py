"""Gradient-side staleness corrections, written once over :class:`TensorOps` (issue 18).

Width 2 applies at step t+1 the averaged gradient of step t, computed at weights w_t. These pure
functions compute the corrected gradient or prediction direction; they hold no state, so the
PyTorch and Keras adapters can call them eagerly or inside a traced step. Selected with
``staleness_correction=`` ("delay_compensation", "eager", "adam_prediction"): the per-step state
and sequencing are :mod:`pipesgd_hvd.staleness.corrections`' and :class:`pipesgd_hvd.staleness.prediction.AdamPrediction`'s.

- :func:`delay_compensated` (DC-ASGD, SAPipe's DC): the first-order Taylor step of the gradient
  from w_then to w_now, with the Hessian approximated by lam * g ⊙ g:
  ``g + lam * g * g * (w_now - w_then)``. One temporary per tensor; three element-wise passes.
- :func:`eager_mix` (eager updates, arXiv 2502.12996): swap this rank's stale share of the average
  for its fresh local gradient: ``avg_{t-1} + (local_t - local_{t-1}) / world_size``. Needs the
  previous local gradient kept (one copy of the gradients); two element-wise passes.
- :func:`adam_direction`: the update Adam/AdamW would apply with its current moments,
  ``lr * m_hat / (sqrt(v_hat) + eps)`` (+ ``lr * wd * w`` for AdamW), for optimizer-aware weight
  prediction (predicted = w - direction) instead of extrapolating the last raw step.
"""
from __future__ import annotations

from typing import Optional

from ..ops.base import Tensor, TensorOps

#: Default DC strength; DC-ASGD reports 0.04 to 2 across tasks; small keeps the term a correction.
DEFAULT_DC_LAMBDA = 0.1


def check_dc_lambda(lam: float) -> float:
    """``dc_lambda`` must be a finite float >= 0 (0 turns the correction into a no-op)."""
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not lam >= 0 or lam == float("inf"):
        raise ValueError(f"dc_lambda must be a finite number >= 0 (e.g. {DEFAULT_DC_LAMBDA}), got {lam!r}")
    return float(lam)


def delay_compensated(ops: TensorOps, grad: Tensor, w_now: Tensor, w_then: Tensor, lam: float) -> Tensor:
    """``grad`` was computed at ``w_then``; returns its first-order estimate at ``w_now``."""
    return grad + (grad * grad * (w_now - w_then)) * check_dc_lambda(lam)


def eager_mix(avg_stale: Tensor, local_fresh: Tensor, local_stale: Tensor, world_size: int) -> Tensor:
    """The average of step t-1 with this rank's term replaced by its step-t gradient."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (hvd.size()), got {world_size!r}")
    return avg_stale + (local_fresh - local_stale) * (1.0 / world_size)


def adam_direction(ops: TensorOps, m: Tensor, v: Tensor, step: int, lr: float, beta1: float,
                   beta2: float, eps: float, weight: Optional[Tensor] = None,
                   weight_decay: float = 0.0) -> Tensor:
    """The step Adam (or AdamW when ``weight`` and ``weight_decay`` are given) subtracts next,
    from its first and second moments after ``step`` (>= 1) updates, bias-corrected. ``step``
    may be a traced float tensor (Keras's iteration count); the caller then keeps it >= 1."""
    if isinstance(step, int) and step < 1:
        raise ValueError(f"step must be >= 1 (the moments exist after the first update), got {step}")
    m_hat = m * (1.0 / (1.0 - beta1 ** step))
    v_hat = v * (1.0 / (1.0 - beta2 ** step))
    direction = m_hat * lr / (v_hat ** 0.5 + eps)
    if weight is not None and weight_decay:
        direction = direction + weight * (lr * weight_decay)
    return direction
