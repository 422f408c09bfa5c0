"""``staleness_correction="weight_prediction"`` / ``"adam_prediction"``: the gradient of step t is
computed at a guess of the weights it will be applied to.

With width 2 the gradient computed at step t, at weights w_t, is applied one step later, to
w_{t+1}. Weight prediction (SpecTrain, SAPipe) computes it at a guess of w_{t+1} instead. The
update that will turn w_t into w_{t+1} is still being reduced when step t starts, so we guess it
with the last update applied: predicted = w_t + (w_t - w_{t-1}). For SGD with momentum this is
close to the next step's update (momentum makes consecutive updates alike); for Adam likewise.
``"adam_prediction"`` guesses with the wrapped Adam/AdamW's own next step from its moments now.

As a :class:`~pipesgd_hvd.staleness.correction.Correction`: before each update the real weights
come back (the gradients were computed at the prediction; the update applies to the real ones);
after it (or after a fill step, which updates nothing) the real weights are kept and the
prediction written. Costs two copies of the weights in memory and three element-wise passes over
them per step. Between steps the parameters hold the prediction: evaluate or save inside
``opt.real_weights()`` (PyTorch), or after ``flush()``, which restores them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..ops.base import Tensor
from .conds import Flag, select
from .correction import Call, Correction, CorrectionContext, Grads, saved_kind
from .formulas import adam_direction


class WeightPrediction(Correction):
    """State: the real weights w_t ("current"), the previous ones w_{t-1}, and a "started" flag.
    Until the first update the flag is off and nothing is written: weights broadcast from rank 0
    after construction are taken as they are. Eagerly the choices are made on the host (no
    device read of the flag, no ``where`` kernels); traced, the flag is a variable and the
    choices ``where`` ops, so the same code runs in Keras's step."""

    elastic = False
    name = "weight_prediction"

    def __init__(self, context: CorrectionContext) -> None:
        super().__init__(context)
        ops = self.ops
        self.started = Flag(ops, self.eager)
        self.current: List[Tensor] = [ops.new_state(ops.read(p)) for p in self.weights]
        self.previous: List[Tensor] = [ops.new_state(ops.read(p)) for p in self.weights]
        self._in_weights = False  # eagerly: the parameters hold the prediction now

    @classmethod
    def active_at(cls, width: int) -> bool:
        return True  # at every width, as asked: the auto mode may widen the pipeline later

    def _predicted(self, index: int, current: Tensor, previous: Tensor) -> Tensor:
        """The guess of the next real weights of tensor ``index``."""
        return current * 2.0 - previous

    # ------------------------------------------------------------------------------ a call
    def before_update(self, call: Call, grads: Grads) -> Tuple[Grads, Any]:
        self._restore()  # the gradients were computed at the prediction: update the real weights
        return grads, call.applies

    def after_update(self, call: Call) -> None:
        """``params`` hold the real weights w_{t+1}: keep them, write w_{t+1} + (w_{t+1} - w_t).
        On the first call w_t is taken as w_{t+1} (no update to extrapolate with yet)."""
        ops, started = self.ops, self.started.get()
        for i, (prev, cur, p) in enumerate(zip(self.previous, self.current, self.weights)):
            ops.assign(prev, select(ops, started, ops.read(cur), ops.read(p)))
            ops.assign(cur, ops.read(p))
            ops.assign(p, self._predicted(i, ops.read(cur), ops.read(prev)))
        self.started.set(True)
        self._in_weights = True

    def _restore(self) -> None:
        """Puts the real weights back (where the parameters hold the prediction)."""
        ops, started = self.ops, self.started.get()
        if self.eager and not self._in_weights:
            return
        for p, real in zip(self.weights, self.current):
            ops.assign(p, select(ops, started, ops.read(real), ops.read(p)))
        self._in_weights = False

    def _reapply(self) -> None:
        """The prediction again after :meth:`_restore`; bit for bit what :meth:`after_update` wrote."""
        ops, started = self.ops, self.started.get()
        if self.eager and not started:
            return
        for i, (prev, cur, p) in enumerate(zip(self.previous, self.current, self.weights)):
            ops.assign(p, select(ops, started, self._predicted(i, ops.read(cur), ops.read(prev)), ops.read(p)))
        self._in_weights = self.started.is_set() if self.eager else True

    # ------------------------------------------------------------------------------ flush()
    def before_flush(self) -> None:
        """The real weights first; the prediction starts afresh at the next step."""
        self._restore()
        self.started.set(False)

    # ------------------------------------------------------------------------ real weights
    def real_values(self) -> List[Tensor]:
        ops, other = self.ops, self.started.get()
        return [select(ops, other, ops.read(kept), ops.read(w)) for w, kept in zip(self.weights, self.current)]

    def show_real(self) -> Any:
        if not self.holds_other_weights():
            return None
        self._restore()
        return True

    def show_back(self, token: Any) -> None:
        if token is not None:
            self._reapply()  # nothing if flush() ran inside the block

    def holds_other_weights(self) -> bool:
        return self._in_weights if self.eager else self.started.is_set()

    # ----------------------------------------------------------------------- checkpointing
    def state(self) -> List[Tensor]:
        return [*self.started.state(), *self.current, *self.previous]

    def state_dict(self, names: Sequence[str]) -> Dict[str, Any]:
        """Copies of w_t ("current") and w_{t-1} ("previous") by parameter name, "started", and
        the real weights when the parameters hold the prediction."""
        ops = self.ops
        current = {n: ops.new_state(ops.read(t)) for n, t in zip(names, self.current)}
        started = self.started.is_set()
        return {"kind": self.name, "started": started, "current": current,
                "previous": {n: ops.new_state(ops.read(t)) for n, t in zip(names, self.previous)},
                "real_weights": current if started else None}

    def load_state_dict(self, saved: Optional[Dict[str, Any]], names: Sequence[str]) -> None:
        """Writes the prediction into the parameters: the next gradient is computed where it would
        have been without the restart, whether the model was saved holding the prediction or
        (inside ``real_weights``) the real weights. Without this state: no prediction yet."""
        saved = prediction_state(saved, self.name)
        if saved is None:
            self.started.set(False)
            self._in_weights = False
            return
        differ = sorted(set(names) ^ set(saved["current"]))
        if differ:
            raise ValueError(f"the checkpoint's weight-prediction state does not match the parameters: {differ}")
        ops = self.ops
        for n, cur, prev in zip(names, self.current, self.previous):
            ops.assign(cur, saved["current"][n])
            ops.assign(prev, saved["previous"][n])
        self.started.set(bool(saved["started"]))
        self._in_weights = bool(saved["started"])
        self._reapply()


def prediction_state(saved: Optional[Dict[str, Any]], kind: str) -> Optional[Dict[str, Any]]:
    """A prediction's saved state: this kind's, or one of either prediction (their formats are
    one: a checkpoint of weight prediction resumes with Adam's and back)."""
    if saved is None:
        return None
    if saved.get("kind") in ("weight_prediction", "adam_prediction"):
        return saved
    return saved_kind(saved, kind)


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
    2025, finds that extrapolating the raw update falls short with Adam). The framework reads
    tensor i's :class:`AdamState` (None before its first update: no prediction for it yet).
    Same memory as weight prediction (``previous`` is kept so that the state and checkpoint
    format stay one), plus the direction's temporaries; about six element-wise passes per tensor."""

    name = "adam_prediction"

    def __init__(self, context: CorrectionContext) -> None:
        context.framework.check_adam_support()
        super().__init__(context)
        self.state_of: Callable[[int], Optional[AdamState]] = context.framework.adam_state

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
