"""``staleness_correction="delay_compensation"`` / ``"eager"``: corrections of the stale averaged
gradient, written once over :class:`TensorOps`.

:mod:`pipesgd_hvd.staleness.formulas` has the formulas; this module keeps the per-step state they
need and says which step's state corrects which gradient, as a
:class:`~pipesgd_hvd.staleness.correction.Correction`. At step t (width K) the pipeline applies
the average of step s = t - K + 1: before the update it is corrected with step s's state, and
step t's state is kept. At ``flush()`` each in-flight average goes through :meth:`settle`. State
of the K - 1 steps in flight lives in K - 1 slots; step s uses slot ``s % (K - 1)``. The steps in
flight are consecutive, so their slots differ, and the step applied at t shares t's slot: it is
read before it is written. Synchronous steps (width 1, warm-up) apply their own fresh gradient
and are neither corrected nor remembered.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..comm.base import ReduceOp
from ..ops.base import Tensor, TensorOps
from .conds import and_, select
from .correction import Call, Correction, CorrectionContext, Grads, Step
from .formulas import check_dc_lambda, delay_compensated, eager_mix

Cond = Any


class _Slots:
    """``count`` slots, each a copy of every tensor in ``like`` and a flag. ``host_flag``: the
    flags are Python bools (an eager core: no device read per step), else float32 variables."""

    def __init__(self, ops: TensorOps, like: Sequence[Any], count: int, host_flag: bool) -> None:
        self.ops, self.count, self.host_flag = ops, count, host_flag
        self.values: List[List[Tensor]] = [[ops.new_state(ops.read(x)) for x in like] for _ in range(count)]
        self._host = [False] * count
        self.flags = [] if host_flag else [ops.new_state(ops.zeros((), "float32")) for _ in range(count)]

    def _flag(self, j: int) -> Cond:
        return self._host[j] if self.host_flag else self.ops.read(self.flags[j]) > 0.5

    def read(self, step: Step) -> "tuple[List[Tensor], Cond]":
        """Slot ``step % count``: its copies and its flag."""
        ops = self.ops
        if isinstance(step, int) or self.count == 1:
            j = step % self.count if isinstance(step, int) else 0
            return [ops.read(v) for v in self.values[j]], self._flag(j)
        values, flag = [ops.read(v) for v in self.values[0]], self._flag(0)
        for j in range(1, self.count):  # a traced slot index: one where pass per extra slot
            use = step % self.count == j
            values = [ops.where(use, ops.read(v), x) for v, x in zip(self.values[j], values)]
            flag = ops.where(use, self._flag(j), flag)
        return values, flag

    def write(self, step: Step, new: Sequence[Tensor], flag: Cond, when: Cond) -> None:
        """Slot ``step % count`` takes ``new`` and ``flag`` where ``when``."""
        ops = self.ops
        if isinstance(when, bool) and isinstance(step, int):
            if not when:
                return
            j = step % self.count
            for v, x in zip(self.values[j], new):
                ops.assign(v, x)
            self._set_flag(j, flag)
            return
        if self.host_flag:
            raise TypeError("a host-flag slot store takes Python steps and conditions")
        for j in range(self.count):
            use = ops.logical_and(when, step % self.count == j)
            for v, x in zip(self.values[j], new):
                ops.assign(v, ops.where(use, x, ops.read(v)))
            ops.assign(self.flags[j], ops.where(use, ops.cast(flag, "float32"), ops.read(self.flags[j])))

    def _set_flag(self, j: int, flag: Cond) -> None:
        if self.host_flag:
            self._host[j] = bool(flag)
        else:
            self.ops.assign(self.flags[j], self.ops.cast(flag, "float32") if not isinstance(flag, bool)
                            else self.ops.full((), 1.0 if flag else 0.0, "float32"))

    def state(self) -> List[Tensor]:
        return [*self.flags, *(v for slot in self.values for v in slot)]

    def state_dict(self, names: Sequence[str]) -> Dict[str, Any]:
        ops = self.ops
        flags = [bool(self._host[j]) if self.host_flag else bool(ops.to_numpy(ops.read(self.flags[j])) > 0.5)
                 for j in range(self.count)]
        return {"flags": flags,
                "slots": [{n: ops.new_state(ops.read(v)) for n, v in zip(names, slot)} for slot in self.values]}

    def load_state_dict(self, state: Dict[str, Any], names: Sequence[str]) -> None:
        if len(state["slots"]) != self.count or any(sorted(s) != sorted(names) for s in state["slots"]):
            raise ValueError("the checkpoint's staleness-correction state does not match this optimizer's width "
                             "and parameters: resume with the width and model it was saved with")
        for j, saved in enumerate(state["slots"]):
            for n, v in zip(names, self.values[j]):
                self.ops.assign(v, saved[n])
            self._set_flag(j, bool(state["flags"][j]))

    def reset(self, like: Sequence[Any]) -> None:
        """Every slot holds ``like`` and a cleared flag (a resume without saved state)."""
        for j in range(self.count):
            for v, x in zip(self.values[j], like):
                self.ops.assign(v, self.ops.read(x))
            self._set_flag(j, False)


class StaleCorrection(Correction):
    """What both corrections share (see the module docstring)."""

    elastic = False
    per_rank_state = True  # eager: this rank's own local shares; both: per-rank copies of steps in flight

    def __init__(self, context: CorrectionContext, like: Sequence[Any]) -> None:
        super().__init__(context)
        self.width = context.width
        self.slots = _Slots(self.ops, like, max(context.width - 1, 1), context.eager)

    @classmethod
    def refusal(cls, options: Any, grad_scaler: bool) -> Optional[str]:
        # Per-step state: the auto mode's rebuilds would drop it mid-run; a loss scale mixes
        # gradients scaled differently.
        if options.auto is not None:
            return (f"staleness_correction={cls.name!r} does not support width='auto' or compression='auto': pass a "
                    "fixed width and compression, or use staleness_correction='split_batch'")
        if grad_scaler:
            return (f"staleness_correction={cls.name!r} does not support grad_scaler: train without a GradScaler "
                    "(bf16 autocast needs none), or use 'weight_prediction' or 'split_batch'")
        return None

    def before_update(self, call: Call, grads: Grads) -> Tuple[Grads, Any]:
        """The stale average corrected; this step's state kept (a synchronous step's own fresh
        gradient passes through)."""
        out = self.correct(list(grads), call.stale_step, call.stale, call.local)
        self.remember(call.step, call.local, call.pipelined, and_(self.ops, call.pipelined, call.applies))
        return out, call.applies

    def correct(self, avg: Grads, stale_step: Step, has_stale: Cond, local: Optional[Grads] = None) -> Grads:
        raise NotImplementedError

    def remember(self, step: Step, local: Optional[Grads], pipelined: Cond, applies: Cond) -> None:
        raise NotImplementedError

    def state(self) -> List[Tensor]:
        return self.slots.state()

    def state_dict(self, names: Sequence[str]) -> Dict[str, Any]:
        return {"kind": self.name, **self.slots.state_dict(names)}

    def load_state_dict(self, saved: Optional[Dict[str, Any]], names: Sequence[str]) -> None:
        """A checkpoint without this correction's state (or another's): the in-flight averages
        are applied uncorrected (delay compensation: w_then taken as the loaded weights; eager: no
        local share to take back)."""
        if saved is None or saved.get("kind") != self.name:
            self.slots.reset(self.weights)
            return
        self.slots.load_state_dict(saved, names)


class DelayCompensation(StaleCorrection):
    """DC-ASGD's first-order correction: the average of step s, computed at the weights w_s,
    becomes ``g + lam * g * g * (w_now - w_s)``. Keeps w_s for each of the K - 1 steps in flight:
    K - 1 copies of the weights (one at width 2). Per applied step: five element-wise ops per
    tensor (each a temporary) and one copy of the weights into the slot (traced: also ``where``
    passes to select, and with K > 2 one per slot)."""

    name = "delay_compensation"

    def __init__(self, context: CorrectionContext) -> None:
        super().__init__(context, context.weights)
        self.lam = check_dc_lambda(context.options.dc_lambda)

    def correct(self, avg: Grads, stale_step: Step, has_stale: Cond, local: Optional[Grads] = None) -> Grads:
        if has_stale is False:
            return list(avg)
        w_then, _ = self.slots.read(stale_step)
        ops, out = self.ops, []
        for g, w, then in zip(avg, self.weights, w_then):
            out.append(None if g is None else
                       select(ops, has_stale, delay_compensated(ops, g, ops.read(w), then, self.lam), g))
        return out

    def remember(self, step: Step, local: Optional[Grads], pipelined: Cond, applies: Cond) -> None:
        self.slots.write(step, [self.ops.read(w) for w in self.weights], applies, pipelined)

    def settle(self, grads: Grads, step: Step) -> Grads:
        return self.correct(grads, step, True)


class EagerMix(StaleCorrection):
    """Eager updates (arXiv 2502.12996): at step t apply ``avg_s + (local_t - local_s) / N``,
    this rank's share of the stale average swapped for its fresh local gradient. The local
    gradient is the one this rank handed to the pipeline, before any compression (so with a
    codec the share taken back is not exactly the one inside the decoded average: the codec's
    error, which error feedback carries to later steps, stays in). The share of step s is taken
    back only if step s applied it (a fill step applies nothing, so its share is not taken back);
    ``flush()`` takes back the shares of the steps in flight. Over a run the local shares cancel:
    with plain SGD the result after ``flush()`` is the synchronous one up to rounding, but between
    steps replicas differ by their last local share (bounded for SGD; with momentum or Adam the
    optimizer states differ too), so the replica check is refused with it.
    Keeps one copy of the local gradients per step in flight (K - 1 copies of the model's size);
    per step: a zeros tensor and three element-wise ops per tensor, and one copy into the slot."""

    name = "eager"
    needs_local = True

    def __init__(self, context: CorrectionContext) -> None:
        super().__init__(context, context.weights)
        self.world_size = context.world_size

    @classmethod
    def refusal(cls, options: Any, grad_scaler: bool) -> Optional[str]:
        if options.op != ReduceOp.AVERAGE:
            return ("staleness_correction='eager' swaps this rank's 1/size share of an average, so it needs "
                    "op=hvd.Average (the default): drop op=hvd.Sum, or use 'delay_compensation'")
        if options.check_replicas_every:
            return ("staleness_correction='eager' makes replicas differ between steps by design (each rank applies its "
                    "own fresh gradient), so check_replicas_every cannot be used with it: set check_replicas_every=0, "
                    "or use 'delay_compensation'")
        return super().refusal(options, grad_scaler)

    def _mix(self, g: Tensor, fresh: Optional[Tensor], stale: Tensor, taken_back: Cond) -> Tensor:
        ops = self.ops
        zero = ops.zeros(ops.shape(g), ops.dtype_name(g), like=g)
        return eager_mix(g, zero if fresh is None else fresh, select(ops, taken_back, stale, zero), self.world_size)

    def correct(self, avg: Grads, stale_step: Step, has_stale: Cond, local: Optional[Grads] = None) -> Grads:
        if has_stale is False:
            return list(avg)
        stale, shared = self.slots.read(stale_step)
        fresh = local if local is not None else [None] * len(avg)
        return [None if g is None else select(self.ops, has_stale, self._mix(g, f, s, shared), g)
                for g, f, s in zip(avg, fresh, stale)]

    def remember(self, step: Step, local: Optional[Grads], pipelined: Cond, applies: Cond) -> None:
        ops = self.ops
        values = [ops.zeros(ops.shape(ops.read(w)), ops.dtype_name(ops.read(w)), like=ops.read(w)) if g is None
                  else g for g, w in zip(local or [None] * len(self.weights), self.weights)]
        self.slots.write(step, values, applies, pipelined)

    def settle(self, grads: Grads, step: Step) -> Grads:
        stale, shared = self.slots.read(step)
        return [None if g is None else self._mix(g, None, s, shared) for g, s in zip(grads, stale)]
