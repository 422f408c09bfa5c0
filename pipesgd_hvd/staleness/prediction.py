"""Staleness correction by weight prediction, written once for every framework.

With width 2 the gradient computed at step t, at weights w_t, is applied one step later, to
w_{t+1}. Weight prediction (SpecTrain, SAPipe) computes it at a guess of w_{t+1} instead. The
update that will turn w_t into w_{t+1} is still being reduced when step t starts, so we guess it
with the last update applied: predicted = w_t + (w_t - w_{t-1}). For SGD with momentum this is
close to the next step's update (momentum makes consecutive updates alike); for Adam likewise.

The adapter calls, at every optimizer step, after the backward pass that used the predicted
weights: :meth:`restore` (the real weights come back), the wrapped optimizer's update (or none
while the pipeline fills), then :meth:`predict` (remember the real weights, write the prediction).
Costs two copies of the weights in memory and three element-wise passes over them per step.
Between steps the parameters hold the prediction: evaluate or save inside :meth:`real_weights`
(PyTorch ``opt.real_weights()``), or after ``flush()``, which restores them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..ops.base import Tensor, TensorOps
from .formulas import adam_direction


class WeightPrediction:
    """State: the real weights w_t, the previous ones w_{t-1}, and a "started" flag. Until the
    first update the flag is off and every call leaves the parameters alone: weights broadcast
    from rank 0 after construction are taken as they are.

    ``host_flag=False`` (a traced TensorFlow step): the flag is a tensor (a variable in the graph)
    and the choices are ``where`` ops, so the same code runs eagerly and traced. ``host_flag=True``
    (an eager framework): the flag is a Python bool and the choices are made on the host, so a
    step costs no host-to-device copy of the flag and no ``where`` kernels per parameter."""

    def __init__(self, ops: TensorOps, params: Sequence[Any], host_flag: bool = False) -> None:
        self.ops = ops
        self.host_flag = host_flag
        self._flag = False
        self.started = ops.new_state(ops.zeros((), "float32"))
        self.current: List[Tensor] = [ops.new_state(ops.read(p)) for p in params]
        self.previous: List[Tensor] = [ops.new_state(ops.read(p)) for p in params]

    def _started(self) -> Any:
        return self._flag if self.host_flag else self.ops.read(self.started) > 0.5

    def _select(self, started: Any, a: Tensor, b: Tensor) -> Tensor:
        """``a`` where started, else ``b``: on the host for a host flag, a ``where`` op otherwise."""
        if self.host_flag:
            return a if started else b
        return self.ops.where(started, a, b)

    def _set(self, value: bool) -> None:
        self._flag = value
        if not self.host_flag:
            self.ops.assign(self.started, self.ops.full((), 1.0 if value else 0.0, "float32"))

    def _predicted(self, index: int, current: Tensor, previous: Tensor) -> Tensor:
        """The guess of the next real weights of tensor ``index``."""
        return current * 2.0 - previous

    def restore(self, params: Sequence[Any]) -> None:
        """Puts the real weights back into ``params`` (before the optimizer's update)."""
        ops, started = self.ops, self._started()
        if self.host_flag and not started:
            return
        for p, real in zip(params, self.current):
            ops.assign(p, self._select(started, ops.read(real), ops.read(p)))

    def predict(self, params: Sequence[Any]) -> None:
        """``params`` hold the real weights w_{t+1}: keep them, write w_{t+1} + (w_{t+1} - w_t).
        On the first call w_t is taken as w_{t+1} (no update to extrapolate with yet)."""
        ops, started = self.ops, self._started()
        for i, (prev, cur, p) in enumerate(zip(self.previous, self.current, params)):
            ops.assign(prev, self._select(started, ops.read(cur), ops.read(p)))
            ops.assign(cur, ops.read(p))
            ops.assign(p, self._predicted(i, ops.read(cur), ops.read(prev)))
        self._set(True)

    def reapply(self, params: Sequence[Any]) -> None:
        """Writes the prediction again after :meth:`restore` (e.g. an evaluation at the real
        weights); bit for bit what :meth:`predict` wrote, and no third copy of the weights."""
        ops, started = self.ops, self._started()
        if self.host_flag and not started:
            return
        for i, (prev, cur, p) in enumerate(zip(self.previous, self.current, params)):
            ops.assign(p, self._select(started, self._predicted(i, ops.read(cur), ops.read(prev)), ops.read(p)))

    def reset(self, params: Sequence[Any]) -> None:
        """Restores the real weights and starts afresh (after a flush)."""
        self.restore(params)
        self.stop()

    def stop(self) -> None:
        """Until the next :meth:`predict`, every call leaves the parameters alone."""
        self._set(False)

    def is_started(self) -> bool:
        """Eagerly: whether the parameters hold a prediction (a host read of a tensor flag)."""
        if self.host_flag:
            return self._flag
        return bool(self.ops.to_numpy(self.ops.read(self.started)) > 0.5)

    def state(self) -> List[Tensor]:
        return [self.started, *self.current, *self.previous]

    def state_dict(self, names: Sequence[str]) -> Dict[str, Any]:
        """Copies of w_t ("current") and w_{t-1} ("previous") by parameter name, and "started"."""
        ops = self.ops
        return {"started": self.is_started(),
                "current": {n: ops.new_state(ops.read(t)) for n, t in zip(names, self.current)},
                "previous": {n: ops.new_state(ops.read(t)) for n, t in zip(names, self.previous)}}

    def load_state_dict(self, state: Dict[str, Any], names: Sequence[str], params: Sequence[Any]) -> None:
        """Loads :meth:`state_dict` and writes the prediction into ``params``: the next gradient
        is computed where it would have been without the restart, whether the model was saved
        holding the prediction or (inside ``real_weights``) the real weights."""
        differ = sorted(set(names) ^ set(state["current"]))
        if differ:
            raise ValueError(f"the checkpoint's weight-prediction state does not match the parameters: {differ}")
        ops = self.ops
        for n, cur, prev in zip(names, self.current, self.previous):
            ops.assign(cur, state["current"][n])
            ops.assign(prev, state["previous"][n])
        self._set(bool(state["started"]))
        self.reapply(params)


@dataclass(frozen=True)
class AdamState:
    """What Adam/AdamW's next step of one tensor depends on, as the adapter reads it from the
    wrapped optimizer: moments after ``step`` updates, and the settings of its group.
    ``decoupled_weight_decay``: AdamW's (applied to the weights); Adam's L2 term is inside ``m``.
    ``step``, ``lr`` and ``decoupled_weight_decay`` may be traced tensors (Keras: ``step`` the
    float32 iteration count, which may be 0). ``eps_on_raw_v``: the optimizer adds eps to sqrt(v)
    rather than to sqrt(v_hat) (Keras's Adam does), so the eps of ``adam_direction`` is scaled."""

    m: Tensor
    v: Tensor
    step: Any
    lr: Any
    beta1: float
    beta2: float
    eps: float
    decoupled_weight_decay: Any = 0.0
    eps_on_raw_v: bool = False


class AdamPrediction(WeightPrediction):
    """Weight prediction with the wrapped Adam/AdamW's own next step instead of the last update:
    predicted = w - adam_direction(m, v, ...) with the moments as they are now (ACCO, NeurIPS
    2025, finds that extrapolating the raw update falls short with Adam). ``state_of(i)`` reads
    tensor i's :class:`AdamState` (None before its first update: no prediction for it yet).
    Same memory as weight prediction (``previous`` is kept so that the state and checkpoint
    format stay one), plus the direction's temporaries; about six element-wise passes per tensor."""

    def __init__(self, ops: TensorOps, params: Sequence[Any], state_of: Callable[[int], Optional[AdamState]],
                 host_flag: bool = False) -> None:
        super().__init__(ops, params, host_flag)
        self.state_of = state_of

    def _predicted(self, index: int, current: Tensor, previous: Tensor) -> Tensor:
        state = self.state_of(index)
        if state is None or (isinstance(state.step, int) and state.step < 1):
            return current
        ops, traced = self.ops, not isinstance(state.step, int)
        step = ops.where(state.step >= 1, state.step, 1.0) if traced else state.step  # no update yet: 0
        eps = state.eps
        if state.eps_on_raw_v:  # lr m_hat / (sqrt(v_hat) + eps / sqrt(1 - beta2^t)): Keras's own form
            eps = eps * (1.0 / (1.0 - state.beta2 ** step)) ** 0.5
        direction = adam_direction(ops, state.m, state.v, step, state.lr, state.beta1, state.beta2, eps,
                                   weight=current, weight_decay=state.decoupled_weight_decay)
        if traced:
            return ops.where(state.step >= 1, current - direction, current)
        return current - direction
