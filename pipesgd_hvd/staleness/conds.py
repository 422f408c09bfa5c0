"""Conditions that are Python bools on the host (PyTorch's core decides there) or traced boolean
tensors (Keras's step), combined so that a condition known on the host builds no op at all."""
from __future__ import annotations

from typing import Any

from ..ops.base import Tensor, TensorOps

Cond = Any


def maybe(cond: Cond) -> bool:
    """False only for a condition known on the host to be false (no op is built for it then)."""
    return not (isinstance(cond, bool) and not cond)


def select(ops: TensorOps, cond: Cond, a: Tensor, b: Tensor) -> Tensor:
    """``a`` where ``cond``, else ``b``."""
    if isinstance(cond, bool):
        return a if cond else b
    return ops.where(cond, a, b)


def not_(ops: TensorOps, cond: Cond) -> Cond:
    return (not cond) if isinstance(cond, bool) else ops.logical_not(cond)


def and_(ops: TensorOps, a: Cond, b: Cond) -> Cond:
    if isinstance(a, bool):
        return b if a else False
    if isinstance(b, bool):
        return a if b else False
    return ops.logical_and(a, b)


def or_(ops: TensorOps, a: Cond, b: Cond) -> Cond:
    if isinstance(a, bool):
        return True if a else b
    if isinstance(b, bool):
        return True if b else a
    return ops.logical_not(ops.logical_and(ops.logical_not(a), ops.logical_not(b)))


def zeros_like(ops: TensorOps, x: Tensor) -> Tensor:
    return ops.zeros(ops.shape(x), ops.dtype_name(x), like=x)


class Flag:
    """A boolean the correction keeps between calls: a Python bool (``eager``) or a float32
    variable read as ``> 0.5`` (a traced step; the variable is part of the checkpoint)."""

    def __init__(self, ops: TensorOps, eager: bool, value: bool = False) -> None:
        self.ops, self.eager = ops, eager
        self._host = value
        self.variable = None if eager else ops.new_state(ops.full((), 1.0 if value else 0.0, "float32"))

    def get(self) -> Cond:
        return self._host if self.variable is None else self.ops.read(self.variable) > 0.5

    def is_set(self) -> bool:
        """:meth:`get`, read on the host."""
        if self.variable is None:
            return self._host
        return bool(self.ops.to_numpy(self.ops.read(self.variable)) > 0.5)

    def set(self, value: Cond) -> None:
        if self.variable is None:
            self._host = bool(value)
            return
        ops = self.ops
        ops.assign(self.variable, ops.full((), 1.0 if value else 0.0, "float32") if isinstance(value, bool)
                   else ops.cast(value, "float32"))

    def state(self) -> list:
        return [] if self.variable is None else [self.variable]
