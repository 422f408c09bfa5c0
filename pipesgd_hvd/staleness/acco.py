"""``staleness_correction="acco"``: ACCO's rule ("Accumulate While You Communicate", NeurIPS 2025,
arXiv 2406.02613): each update's gradient is half computed at the weights it updates, with two
all-reduces per update. ``"split_batch"`` (:mod:`pipesgd_hvd.staleness.split_batch`) is the same
idea with one all-reduce per update; this is kept as its alternative.

Why: with Adam at its edge of stability, a rule whose whole gradient is one step stale tolerates a
step about 38 times smaller than synchronous training does (docs/accuracy.md); a gradient half of
which is computed at the weights it updates keeps the synchronous threshold.

The rule, over the calls of a width-2 pipeline. Calls alternate between the two halves of an
update's batch: a look-ahead half A, computed at a look-ahead of the weights, and a real half B,
computed at the real weights theta_t. Each call's all-reduce runs while the next call computes
(the pipeline is the usual width-2 one), and each call applies the average of the call before::

    call B, at theta_t:        applies avg A, the virtual step:
                               ~theta_{t+1} = Opt(theta_t, s_t; avg A); the optimizer's state goes
                               back to s_t, the weights hold ~theta_{t+1}, theta_t is kept aside
    call A, at ~theta_{t+1}:   applies avg B, the real step:
                               theta_{t+1} = Opt(theta_t, s_t; (avg A + avg B) / 2)

The first pipelined call computes its A half at the real weights and applies nothing (a fill
step). Synchronous calls (warm-up, width 1) apply their own gradient and take no part.
``flush()`` applies what is in flight: after a virtual step, the real step; otherwise the lone A
half, as an update of its own (nothing computed is lost). Every rank applies the same updates, so
replicas stay bitwise identical.

One update takes two calls, each with its own batch: with half the batch per call and twice the
calls of synchronous training, an update sees the same samples (docs/options.md says what a step,
the batch and a learning-rate schedule mean then).

Costs: one copy of the weights (theta_t, while the model holds the look-ahead), one of the
gradients (avg A, for the real step) and one of the optimizer's state (the virtual update is
undone); per update one more optimizer step (the virtual one), and two all-reduces of the whole
gradient (one per call).

Written once over :class:`~pipesgd_hvd.ops.base.TensorOps`, with host conditions (PyTorch's core)
or traced ones (Keras's step): ``stale`` is a Python bool or a boolean tensor. The framework
supplies an :class:`~pipesgd_hvd.staleness.correction.OptimizerSnapshot`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..ops.base import Tensor
from .conds import and_, maybe, not_, or_, select, zeros_like
from .correction import Call, CorrectionContext, Grads, StatelessStep
from .look_ahead import LookAheadCorrection

Cond = Any   # a Python bool, or a traced boolean tensor


class Acco(LookAheadCorrection):
    """The rule's state and its moments in a call (see the module docstring): before the update
    a virtual step keeps theta_t and avg A aside, a real step writes theta_t back and applies the
    mean of both halves; around a virtual update the optimizer's state is saved and put back."""

    elastic = False
    name = "acco"
    calls_per_update = 2

    def __init__(self, context: CorrectionContext) -> None:
        super().__init__(context)
        ops = self.ops
        self.first_half: List[Tensor] = [ops.new_state(zeros_like(ops, ops.read(w))) for w in self.weights]
        self._pending: Optional[Tuple[Cond, Cond]] = None  # (virtual, ahead after the update)

    @classmethod
    def refusal(cls, options: Any, grad_scaler: bool) -> Optional[str]:
        if options.auto is not None:
            return ("staleness_correction='acco' does not support width='auto' or compression='auto': pass a fixed "
                    "width and compression, or use staleness_correction='split_batch'")
        if grad_scaler:
            return ("staleness_correction='acco' does not support grad_scaler: use staleness_correction='split_batch'")
        if options.width not in (1, 2):
            return (f"staleness_correction='acco' pairs two consecutive steps into one update (a look-ahead half "
                    f"and a real half), which needs width=2 (or 1: synchronous), got width={options.width!r}")
        return None

    # ------------------------------------------------------------------------------- a call
    def before_update(self, call: Call, grads: Grads) -> Tuple[Grads, Cond]:
        """``grads``: what the pipeline hands this call; ``call.stale``: it is an earlier call's
        average (False: a synchronous call's own gradient, or nothing to apply; it passes through)."""
        return self._gradients(grads, call.stale), call.applies

    def _gradients(self, avg: Grads, stale: Cond) -> Grads:
        ops, active = self.ops, self.ahead.get()
        virtual, real = and_(ops, stale, not_(ops, active)), and_(ops, stale, active)
        # after the update: a virtual step leaves the look-ahead in the weights, a real one not
        self._pending = (virtual, or_(ops, virtual, and_(ops, active, not_(ops, stale))))
        out = []
        for g, w, kept, first in zip(avg, self.weights, self.real, self.first_half):
            if g is None:
                out.append(None)
                continue
            if maybe(virtual):  # read the weights before a real step could overwrite them
                ops.assign(kept, select(ops, virtual, ops.read(w), ops.read(kept)))
                ops.assign(first, select(ops, virtual, g, ops.read(first)))
            if maybe(real):
                ops.assign(w, select(ops, real, ops.read(kept), ops.read(w)))
                g = select(ops, real, (ops.read(first) + g) * 0.5, g)
            out.append(g)
        return out

    @contextlib.contextmanager
    def around_update(self, call: Call) -> Iterator[Optional[StatelessStep]]:
        """A virtual update leaves the optimizer's state as it was (the weights keep the update:
        they are the look-ahead): the framework's stateless step, or a save and a restore."""
        if self._pending is None:
            raise RuntimeError("around_update() without before_update() first")
        virtual, ahead_after = self._pending
        with self.state_kept(virtual) as stateless:
            yield stateless
        self.ahead.set(ahead_after)
        self._pending = None

    def after_update(self, call: Call) -> None:
        self._pending = None  # a fill step, or a traced step: nothing is left to wrap

    def update_skipped(self, call: Call) -> None:
        self._pending = None

    def settle(self, grads: Grads, step: Any) -> Grads:
        """``flush()``, eagerly: after a virtual step the average in flight is avg B, applied by
        the real step (theta_t back into the weights first); else it is a lone A half, applied as
        it is. The update that follows is an ordinary one."""
        out = self._gradients(grads, True)
        self._pending = None
        self.ahead.set(False)
        self._aside = None
        return out

    # ------------------------------------------------------------------------ checkpointing
    def state(self) -> List[Tensor]:
        return [*self.ahead.state(), *self.real, *self.first_half]

    def state_dict(self, names: Sequence[str]) -> Dict[str, Any]:
        """theta_t, avg A and the look-ahead by tensor name (copies), and whether it is active
        (inside ``real_weights()`` the look-ahead is the one set aside)."""
        ops = self.ops
        copy = lambda tensors: {n: ops.new_state(ops.read(t)) for n, t in zip(names, tensors)}  # noqa: E731
        active = self.ahead.is_set()
        real = copy(self.real)
        return {"kind": self.name, "active": active, "real": real, "first_half": copy(self.first_half),
                "look_ahead": copy(self.shown_weights()), "real_weights": real if active else None}

    def load_state_dict(self, saved: Optional[Dict[str, Any]], names: Sequence[str]) -> None:
        """A look-ahead is written into the weights whether the model was saved holding it or
        (inside ``real_weights()``) theta_t. Without this rule's state (a checkpoint of another
        mode): no look-ahead, and an average in flight counts as a first half."""
        ops = self.ops
        if saved is None or saved.get("kind") != self.name:
            self.ahead.set(False)
            return
        differ = sorted(set(names) ^ set(saved["real"]))
        if differ:
            raise ValueError(f"the checkpoint's acco state does not match the parameters: {differ}")
        for n, kept, first in zip(names, self.real, self.first_half):
            ops.assign(kept, saved["real"][n])
            ops.assign(first, saved["first_half"][n])
        self.ahead.set(bool(saved["active"]))
        if saved["active"]:
            for n, w in zip(names, self.weights):
                ops.assign(w, saved["look_ahead"][n])
