"""``staleness_correction="split_batch"``: each update's gradient is half computed at the weights it
updates (ACCO, "Accumulate While You Communicate", NeurIPS 2025, arXiv 2406.02613).

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
supplies an :class:`OptimizerSnapshot`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Protocol, Sequence

from ..ops.base import Tensor, TensorOps

Cond = Any   # a Python bool, or a traced boolean tensor
Grads = List[Optional[Tensor]]


class OptimizerSnapshot(Protocol):
    """The wrapped optimizer's state, saved before the virtual step and put back after it (where
    ``when``; a Python bool or a traced boolean). Saving state that does not exist yet (an
    optimizer before its first update) and putting it back removes what the update created."""

    def save(self, when: Cond) -> None: ...
    def restore(self, when: Cond) -> None: ...


class SplitBatch:
    """The rule's state and its moments in a call (see the module docstring)::

        grads = split.gradients(avg, weights, stale)   before the update: a real step first puts
                                                       theta_t back into the weights
        with split.around_update():                    the wrapped optimizer's update of ``grads``
            apply(grads)
        grads = split.settle(avg, weights)             flush(): the average in flight, then apply

    ``host_flag``: the flag "the weights hold a look-ahead" is a Python bool (an eager core: the
    choices are made on the host), else a float32 variable and ``where`` ops (a traced step)."""

    name = "split_batch"

    def __init__(self, ops: TensorOps, weights: Sequence[Any], snapshot: OptimizerSnapshot,
                 host_flag: bool) -> None:
        self.ops, self.snapshot, self.host_flag = ops, snapshot, host_flag
        self.real: List[Tensor] = [ops.new_state(ops.read(w)) for w in weights]
        self.first_half: List[Tensor] = [ops.new_state(_zeros_like(ops, ops.read(w))) for w in weights]
        self._host_active = False
        self._flag = None if host_flag else ops.new_state(ops.zeros((), "float32"))
        self._pending: Optional[tuple] = None  # (virtual, active after the update), set by gradients()
        self._aside: Optional[List[Tensor]] = None  # the look-ahead while show_real() shows theta_t

    # ------------------------------------------------------------------------------- the flag
    def active(self) -> Cond:
        """Whether the weights hold the look-ahead ~theta_{t+1} (the last update was virtual)."""
        return self._host_active if self.host_flag else self.ops.read(self._flag) > 0.5

    def is_active(self) -> bool:
        """:meth:`active`, read on the host (eagerly)."""
        if self.host_flag:
            return self._host_active
        return bool(self.ops.to_numpy(self.ops.read(self._flag)) > 0.5)

    def _set_active(self, value: Cond) -> None:
        if self.host_flag:
            self._host_active = bool(value)
            return
        ops = self.ops
        ops.assign(self._flag, ops.full((), 1.0 if value else 0.0, "float32") if isinstance(value, bool)
                   else ops.cast(value, "float32"))

    # ------------------------------------------------------------------------------- a call
    def gradients(self, avg: Grads, weights: Sequence[Any], stale: Cond) -> Grads:
        """The gradients this call's update applies. ``avg``: what the pipeline hands this call;
        ``stale``: it is an earlier call's average (False: a synchronous call's own gradient, or
        nothing to apply; it passes through). A virtual step keeps theta_t and avg A aside; a real
        step writes theta_t back into ``weights`` and returns the mean of both halves."""
        active = self.active()
        virtual, real = _and(self.ops, stale, _not(self.ops, active)), _and(self.ops, stale, active)
        # after the update: a virtual step leaves the look-ahead in the weights, a real one not
        self._pending = (virtual, _or(self.ops, virtual, _and(self.ops, active, _not(self.ops, stale))))
        ops, out = self.ops, []
        for g, w, kept, first in zip(avg, weights, self.real, self.first_half):
            if g is None:
                out.append(None)
                continue
            if _maybe(virtual):  # read the weights before a real step could overwrite them
                ops.assign(kept, _select(ops, virtual, ops.read(w), ops.read(kept)))
                ops.assign(first, _select(ops, virtual, g, ops.read(first)))
            if _maybe(real):
                ops.assign(w, _select(ops, real, ops.read(kept), ops.read(w)))
                g = _select(ops, real, (ops.read(first) + g) * 0.5, g)
            out.append(g)
        return out

    @contextlib.contextmanager
    def around_update(self) -> Iterator[None]:
        """Wraps the update of the call :meth:`gradients` prepared: the optimizer's state is saved
        before a virtual update and put back after it (the weights keep the update: they are the
        look-ahead)."""
        if self._pending is None:
            raise RuntimeError("around_update() without gradients() first")
        virtual, active_after = self._pending
        if _maybe(virtual):
            self.snapshot.save(virtual)
        yield
        if _maybe(virtual):
            self.snapshot.restore(virtual)
        self._set_active(active_after)
        self._pending = None

    def skip_update(self) -> None:
        """The call :meth:`gradients` prepared applies nothing after all (a fill step): no change."""
        self._pending = None

    def settle(self, avg: Grads, weights: Sequence[Any]) -> Grads:
        """``flush()``, eagerly: the gradients that apply the average in flight. After a virtual
        step it is avg B, applied by the real step (theta_t back into the weights first); else it
        is a lone A half, applied as it is. The update that follows is an ordinary one."""
        grads = self.gradients(avg, weights, True)
        self._pending = None
        self._set_active(False)
        self._aside = None
        return grads

    # ---------------------------------------------------------------------- the real weights
    def show_real(self, weights: Sequence[Any]) -> Optional[List[Tensor]]:
        """Writes theta_t into ``weights`` when they hold a look-ahead, and returns a copy of the
        look-ahead for :meth:`show_look_ahead`; None (nothing written) otherwise."""
        if not self.is_active():
            return None
        ops = self.ops
        look_ahead = [ops.new_state(ops.read(w)) for w in weights]
        for w, kept in zip(weights, self.real):
            ops.assign(w, ops.read(kept))
        self._aside = look_ahead
        return look_ahead

    def show_look_ahead(self, weights: Sequence[Any], look_ahead: List[Tensor]) -> None:
        """Puts back what :meth:`show_real` returned (bit for bit), unless a ``flush()`` in between
        ended the look-ahead: the weights are the real ones then."""
        self._aside = None
        if self.is_active():
            for w, ahead in zip(weights, look_ahead):
                self.ops.assign(w, self.ops.read(ahead))

    # ------------------------------------------------------------------------ checkpointing
    def state(self) -> List[Tensor]:
        """The variables a traced framework's checkpoint tracks."""
        return [*([] if self._flag is None else [self._flag]), *self.real, *self.first_half]

    def state_dict(self, names: Sequence[str], weights: Sequence[Any]) -> Dict[str, Any]:
        """theta_t, avg A and the look-ahead by tensor name (copies), and whether it is active
        (inside ``real_weights()`` the look-ahead is the one set aside)."""
        ops = self.ops
        if self._aside is not None:
            weights = self._aside
        copy = lambda tensors: {n: ops.new_state(ops.read(t)) for n, t in zip(names, tensors)}  # noqa: E731
        return {"kind": self.name, "active": self.is_active(), "real": copy(self.real),
                "first_half": copy(self.first_half), "look_ahead": copy(weights)}

    def load_state_dict(self, state: Optional[Dict[str, Any]], names: Sequence[str],
                        weights: Sequence[Any]) -> None:
        """After the model's weights and the optimizer's state were loaded. A look-ahead is
        written into ``weights`` whether the model was saved holding it or (inside
        ``real_weights()``) theta_t. Without this rule's state (a checkpoint of another mode):
        no look-ahead, and an average in flight counts as a first half."""
        ops = self.ops
        if state is None or state.get("kind") != self.name:
            self._set_active(False)
            return
        differ = sorted(set(names) ^ set(state["real"]))
        if differ:
            raise ValueError(f"the checkpoint's split_batch state does not match the parameters: {differ}")
        for n, kept, first in zip(names, self.real, self.first_half):
            ops.assign(kept, state["real"][n])
            ops.assign(first, state["first_half"][n])
        self._set_active(bool(state["active"]))
        if state["active"]:
            for n, w in zip(names, weights):
                ops.assign(w, state["look_ahead"][n])


def _maybe(cond: Cond) -> bool:
    """False only for a condition known on the host to be false (no op is built for it then)."""
    return not (isinstance(cond, bool) and not cond)


def _select(ops: TensorOps, cond: Cond, a: Tensor, b: Tensor) -> Tensor:
    if isinstance(cond, bool):
        return a if cond else b
    return ops.where(cond, a, b)


def _not(ops: TensorOps, cond: Cond) -> Cond:
    return (not cond) if isinstance(cond, bool) else ops.logical_not(cond)


def _and(ops: TensorOps, a: Cond, b: Cond) -> Cond:
    if isinstance(a, bool):
        return b if a else False
    if isinstance(b, bool):
        return a if b else False
    return ops.logical_and(a, b)


def _or(ops: TensorOps, a: Cond, b: Cond) -> Cond:
    if isinstance(a, bool):
        return True if a else b
    if isinstance(b, bool):
        return True if b else a
    return ops.logical_not(ops.logical_and(ops.logical_not(a), ops.logical_not(b)))  # a or b


def _zeros_like(ops: TensorOps, x: Tensor) -> Tensor:
    return ops.zeros(ops.shape(x), ops.dtype_name(x), like=x)
