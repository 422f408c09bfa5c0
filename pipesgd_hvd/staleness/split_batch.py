"""``staleness_correction="split_batch"``, the accurate mode: part of each update's gradient is
computed at the weights it updates, with one all-reduce per update.

Why: with Adam at its edge of stability, a rule whose whole gradient is one step stale tolerates a
step about 38 times smaller than synchronous training does (docs/accuracy.md); a gradient part of
which is computed at the weights it updates keeps the synchronous threshold (ACCO, NeurIPS 2025,
arXiv 2406.02613). ACCO reduces each half of the batch on its own (two all-reduces per update,
:mod:`pipesgd_hvd.staleness.acco`); here each rank makes its look-ahead from its own, unreduced
gradient, so only the update's sum crosses the network, once, behind the next look-ahead half's compute.

Two calls make one update: a look-ahead part A of the update's batch (a share 1 - f of it), then a
fresh part B (a share f; f = ``fresh_fraction``, 1/2 by default), each computed by one call of
``step()`` / ``apply_gradients``::

    call A (at the look-ahead ~theta_{t+1}):  keeps g_A; waits for update t's all-reduce; puts
        theta_t back into the weights; the real step theta_{t+1} = Opt(theta_t, s_t; avg_t)
    call B (at theta_{t+1}):  g = (1 - f) g_A + f g_B, this rank's gradient of update t+1: its
        all-reduce starts (it runs while the next call A computes); theta_{t+1} is kept aside and
        the weights get this rank's look-ahead ~theta_{t+2} = Opt(theta_{t+1}, s_{t+1}; g), the
        optimizer's state put back to s_{t+1} afterwards

The real weights and the updates are the same on every rank (bitwise); only the look-ahead points,
where the A parts are computed, differ. When the pipeline is synchronous (``width=1``, warm-up,
or the auto mode's choice) the pair is one synchronous update at the end of call B, of the
whole batch: a call always means half an update, whatever the width.

The first pair computes its A part at the real weights (no look-ahead yet) and applies nothing at
call A. ``flush()`` applies what is in flight (the real step of update t), or, after a call A, the
kept part as an update of its own (nothing computed is lost).

Costs: one copy of the weights (theta aside while the model holds the look-ahead) and one of the
gradients (this rank's sum, kept between the calls); the look-ahead's step leaves the optimizer's
state alone, by the framework's stateless step where it has one (PyTorch's SGD, Adam, AdamW: a copy
of one parameter's state at a time), else by saving the state and putting it back (one copy of it).
Per update one more optimizer step (the look-ahead's), and one all-reduce of the whole gradient,
which starts as part B's backward pass hands over its buckets: comm-bound, an update takes about
part B's forward pass + the all-reduce.

Written once over :class:`~pipesgd_hvd.ops.base.TensorOps`: Python bools where PyTorch's core
decides on the host, traced booleans inside Keras's step.
"""
from __future__ import annotations

import contextlib
import numbers
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from ..ops.base import Tensor
from .conds import Flag, and_, maybe, not_, or_, select
from .correction import Call, CorrectionContext, Grads, StatelessStep
from .look_ahead import LookAheadCorrection

Cond = Any

DEFAULT_FRESH_FRACTION = 0.5


def _all_finite(ops: Any, grads: Grads) -> bool:
    """Eagerly: every gradient finite (one host read)."""
    flags = [ops.all(ops.reshape(ops.isfinite(g), (-1,)), 0) for g in grads if g is not None]
    return not flags or bool(ops.to_numpy(ops.all(ops.stack(flags, 0), 0)))


def check_fresh_fraction(value: Any) -> float:
    """``fresh_fraction``: the share f of each update's batch that call B computes, in (0, 1)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < float(value) < 1.0:
        raise ValueError(f"fresh_fraction must be a number between 0 and 1 (the share of each update's batch "
                         f"computed at the real weights; {DEFAULT_FRESH_FRACTION} splits it in halves), got {value!r}")
    return float(value)


class SplitBatch(LookAheadCorrection):
    """The rule's state between calls (see the module docstring): ``second`` (the next call is
    the fresh part B: a part A is kept), ``ahead`` (the weights hold this rank's look-ahead and
    ``real`` theta_t), and ``local``, this rank's gradient of the update being computed."""

    name = "split_batch"
    calls_per_update = 2
    transforms_input = True

    def __init__(self, context: CorrectionContext) -> None:
        super().__init__(context)
        ops = self.ops
        self.fresh = check_fresh_fraction(getattr(context.options, "fresh_fraction", DEFAULT_FRESH_FRACTION))
        self.local: List[Tensor] = [ops.new_state(ops.read(w) * 0.0) for w in self.weights]
        self.second = Flag(ops, self.eager)   # a part A is kept; the next call is part B
        self._virtual: Cond = False           # this call's update is the look-ahead's (set by before_update)
        self._kept: Set[int] = set()          # eagerly: tensors part A gave a gradient
        self._sent: Set[int] = set()          # eagerly, in call B: tensors handed to the pipeline
        self._kept_scale: Any = None          # eagerly: the loss scale part A was computed with
        self._ratio: Any = None               # eagerly, in call B: loss scale now / part A's, or None

    @classmethod
    def refusal(cls, options: Any, grad_scaler: bool) -> Optional[str]:
        if options.width not in (1, 2, "auto"):
            return (f"staleness_correction='split_batch' makes one update of two calls with one all-reduce in "
                    f"flight, which needs width=2 (or 1, or 'auto'), got width={options.width!r}")
        return None

    @classmethod
    def active_at(cls, width: int) -> bool:
        return True  # a call is half an update at every width

    # ------------------------------------------------------------------------------- a call
    def feeds(self) -> Cond:
        return self.second.get()

    def takes(self) -> Cond:
        return not_(self.ops, self.second.get())

    def begin_call(self, loss_scale: Any) -> None:
        """Eagerly, at the call's first gradient: part A notes its loss scale; part B the ratio
        by which part A is rescaled to its own (a GradScaler may have changed it in between)."""
        self._sent = set()
        if not self.second.is_set():
            self._kept, self._kept_scale = set(), loss_scale
        elif loss_scale is not None and self._kept_scale is not None:
            self._ratio = loss_scale / self._kept_scale
        else:
            self._ratio = None

    def local_(self, index: int, grad: Tensor) -> Tensor:
        """Part A: ``local = (1 - f) g_A`` (kept). Part B: ``local += f g_B``, handed to the pipeline."""
        ops, kept = self.ops, self.local[index]
        if self.eager:
            if not self.second.is_set():
                self._kept.add(index)
                return ops.assign_scaled(kept, grad, 1.0 - self.fresh)
            self._sent.add(index)
            if index not in self._kept:
                return ops.assign_scaled(kept, grad, self.fresh)
            self._kept.discard(index)
            if self._ratio is not None:
                ops.assign_scaled(kept, kept, self._ratio)
            return ops.assign_scaled(kept, grad, self.fresh, accumulate=True)
        second = self.second.get()
        ops.assign(kept, ops.where(second, ops.read(kept) + grad * self.fresh, grad * (1.0 - self.fresh)))
        return ops.read(kept)

    def kept_gradient(self, index: int) -> Optional[Tensor]:
        """Eagerly, in call B, for a tensor that got no gradient in this call: part A's, if kept."""
        if not self.second.is_set() or index not in self._kept:
            return None
        self._kept.discard(index)
        self._sent.add(index)
        return self.ops.assign(self.local[index], self._rescaled(self.ops.read(self.local[index])))

    def _rescaled(self, x: Tensor) -> Tensor:
        return x if self._ratio is None else x * self._ratio

    def before_update(self, call: Call, grads: Grads) -> Tuple[Grads, Cond]:
        """Call A: theta_t back into the weights; the real step applies update t's average (if
        one was in flight). Call B: pipelined, keep theta_{t+1} aside and step to the look-ahead
        with this rank's gradient; synchronous, the average of this update is the real step."""
        ops = self.ops
        second, ahead = self.second.get(), self.ahead.get()
        restore = and_(ops, not_(ops, second), ahead)
        virtual = and_(ops, second, not_(ops, call.applies))
        self._virtual = virtual
        out: Grads = []
        for i, (g, w, kept) in enumerate(zip(grads, self.weights, self.real)):
            if maybe(restore):
                ops.assign(w, select(ops, restore, ops.read(kept), ops.read(w)))
            if maybe(virtual):
                ops.assign(kept, select(ops, virtual, ops.read(w), ops.read(kept)))
                if self.eager:  # virtual is True here: this rank's gradient, where the update has one
                    g = ops.read(self.local[i]) if i in self._sent else None
                elif g is not None:
                    g = ops.where(virtual, ops.read(self.local[i]), g)
            out.append(g)
        if virtual is True and call.loss_scaled and not _all_finite(ops, out):
            # A loss scaler decides on each rank alone what it sees: an overflow in this rank's
            # own gradient would skip its step and lower its scale only, and the ranks' scales
            # would part. The overflow rides in the all-reduce instead (every rank's scaler sees
            # it at the real step); the look-ahead steps with zeros (momentum alone).
            out = [None if g is None else ops.zeros(ops.shape(g), ops.dtype_name(g), like=g) for g in out]
        return out, or_(ops, call.applies, virtual)

    @contextlib.contextmanager
    def around_update(self, call: Call) -> Iterator[Optional[StatelessStep]]:
        """The look-ahead's step leaves the optimizer's state as it found it: the framework's
        stateless step, or a save and a restore around its ordinary one."""
        with self.state_kept(self._virtual) as stateless:
            yield stateless

    def after_update(self, call: Call) -> None:
        self.ahead.set(self._virtual)
        self.second.set(not_(self.ops, self.second.get()))
        self._virtual = False

    def update_skipped(self, call: Call) -> None:
        """A GradScaler skipped the step: no look-ahead was made (the weights are the real ones);
        the pair goes on."""
        self.ahead.set(False)
        self.second.set(not self.second.is_set())
        self._virtual = False

    # ------------------------------------------------------------------------------ flush()
    def settle(self, grads: Grads, step: Any) -> Grads:
        """Update t's average, in flight: the real step from theta_t."""
        if self.ahead.is_set():
            for w, kept in zip(self.weights, self.real):
                self.ops.assign(w, self.ops.read(kept))
            self.ahead.set(False)
        self._aside = None
        return grads

    def pending(self) -> Optional[Grads]:
        """After a call A: its part, as the gradient of an update of its own."""
        if not self.second.is_set():
            return None
        ops, scale = self.ops, 1.0 / (1.0 - self.fresh)
        kept = range(len(self.weights)) if not self.eager else self._kept
        return [ops.read(t) * scale if i in kept else None for i, t in enumerate(self.local)]

    def before_flush(self) -> None:
        """The real weights back first: the averages in flight are applied to them."""
        self.settle([], None)

    def flushed(self) -> None:
        self.second.set(False)
        self.ahead.set(False)
        self._kept, self._aside, self._virtual = set(), None, False

    # ------------------------------------------------------------------------ checkpointing
    def state(self) -> List[Tensor]:
        return [*self.second.state(), *self.ahead.state(), *self.real, *self.local]

    def state_dict(self, names: Sequence[str]) -> Dict[str, Any]:
        """The pair's position, theta aside and the look-ahead (inside ``real_weights()`` the one
        set aside), and this rank's kept part A, by tensor name (copies)."""
        ops = self.ops
        copy = lambda tensors: {n: ops.new_state(ops.read(t)) for n, t in zip(names, tensors)}  # noqa: E731
        ahead, second = self.ahead.is_set(), self.second.is_set()
        real = copy(self.real) if ahead else None
        kept = sorted(names[i] for i in self._kept) if self.eager else list(names)
        return {"kind": self.name, "fresh_fraction": self.fresh, "second": second, "ahead": ahead,
                "real": real, "look_ahead": copy(self.shown_weights()) if ahead
                else None, "local": copy(self.local) if second else None, "kept": kept if second else [],
                "kept_scale": self._kept_scale if second else None, "real_weights": real}

    def load_state_dict(self, saved: Optional[Dict[str, Any]], names: Sequence[str]) -> None:
        """After the model's weights and the optimizer's state were loaded. Without this rule's
        state (a checkpoint of another mode, or ACCO's): a fresh pair, in-flight averages applied
        as they are."""
        ops = self.ops
        if saved is None or saved.get("kind") != self.name or "second" not in saved:
            self.flushed()
            return
        if float(saved["fresh_fraction"]) != self.fresh:
            raise ValueError(f"the checkpoint was saved with fresh_fraction={saved['fresh_fraction']}, this optimizer "
                             f"has {self.fresh}: resume with the same fresh_fraction")
        for part in ("real", "local"):
            if saved[part] is not None and sorted(saved[part]) != sorted(names):
                raise ValueError(f"the checkpoint's split_batch state does not match the parameters: "
                                 f"{sorted(set(names) ^ set(saved[part]))}")
        self.second.set(bool(saved["second"]))
        self.ahead.set(bool(saved["ahead"]))
        if saved["ahead"]:
            for n, w, kept in zip(names, self.weights, self.real):
                ops.assign(kept, saved["real"][n])
                ops.assign(w, saved["look_ahead"][n])
        if saved["second"]:
            for n, kept in zip(names, self.local):
                ops.assign(kept, saved["local"][n])
        index = {n: i for i, n in enumerate(names)}
        self._kept = {index[n] for n in saved["kept"]} if self.eager else set()
        self._kept_scale = saved.get("kept_scale")
        self._aside, self._virtual = None, False
