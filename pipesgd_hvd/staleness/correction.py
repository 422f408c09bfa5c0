"""One interface for everything behind ``staleness_correction=``, and the registry of its names.

A correction plugs into the pipelined optimizer the way a transform plugs into optax's ``chain``
or a hook into PyTorch's ``register_comm_hook``: the optimizer's core (PyTorch's
``optimizer/core.py`` and Keras's ``keras/traced_step.py``) calls these methods at fixed moments of
every call of ``step()`` / ``apply_gradients`` and never asks which correction it holds. The
identity (:class:`Correction` itself, ``staleness_correction=False``) is what plain Pipe-SGD does.

The moments of one call, in order::

    c.feeds(), c.takes()               does this call hand its gradients to the pipeline, and
                                       take what the pipeline has ready?
    g = c.local_(i, grad)              (backward pass) what it hands for tensor i (None: nothing)
    grads, applies = c.before_update(call, averaged)
                                       the gradients the update applies (may write the weights)
    with c.around_update(call):        the wrapped optimizer's update, if ``applies``
        update(grads)
    c.after_update(call)               (may write the weights the next gradient is computed at)

and at ``flush()``: ``c.before_flush()``, ``c.settle(avg, step)`` per step in flight, then
``c.pending()`` (a half it kept, reduced and applied as an update of its own) and ``c.flushed()``. Between calls
the model may hold weights that are not the real ones (a prediction, a look-ahead):
:meth:`show_real` / :meth:`show_back` swap the real ones in for an evaluation or a save.

Written once over :class:`~pipesgd_hvd.ops.base.TensorOps`: with Python bools and ints where the
core decides on the host (PyTorch), with traced tensors inside Keras's step (``Cond`` and
``Step`` are either; :mod:`pipesgd_hvd.staleness.conds` combines them).

Adding a correction is one module in this package that defines a subclass with a ``name``, and
its line in the table of :mod:`pipesgd_hvd.staleness.registry`; ``staleness_correction=<name>``
selects it, and its :meth:`Correction.refusal` says which settings it cannot run with.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager, Dict, List, Optional, Protocol, Sequence, Tuple

from ..ops.base import Tensor, TensorOps

Cond = Any    # a Python bool, or a traced boolean tensor
Step = Any    # a Python int, or a traced integer tensor
Grads = List[Optional[Tensor]]  # one per tensor of the optimizer's list; None: no gradient


class OptimizerSnapshot(Protocol):
    """The wrapped optimizer's state, saved before a virtual update and put back after it (where
    ``when``: a Python bool or a traced boolean). Saving state that does not exist yet (an
    optimizer before its first update) and putting it back removes what the update created."""

    def save(self, when: Cond) -> None: ...
    def restore(self, when: Cond) -> None: ...


class StatelessStep(Protocol):
    """The wrapped optimizer's step that leaves its state as it was (a look-ahead's)."""

    def step_(self) -> None: ...


class FrameworkAccess(Protocol):
    """What a correction may ask of the framework, once, when it is built (``optimizer/framework.py``'s
    ``FrameworkSide`` implements it)."""

    def check_adam_support(self) -> None: ...
    def adam_state(self, index: int) -> Any: ...
    def optimizer_snapshot(self) -> OptimizerSnapshot: ...
    def look_ahead_step(self) -> Optional[StatelessStep]:
        """The optimizer's step without a change of its state, where the framework can make one
        (None: a look-ahead saves and puts back the state around the ordinary step)."""


@dataclass(frozen=True)
class CorrectionContext:
    """Everything a correction is built from. ``weights``: the tensors it may read and write
    (PyTorch parameters, Keras variables), in the optimizer's order; ``eager``: choices are made
    on the host (PyTorch) rather than traced (Keras); ``options``: the optimizer's
    :class:`~pipesgd_hvd.optimizer.options.OptimizerOptions` (for the correction's own settings)."""

    ops: TensorOps
    weights: Sequence[Any]
    eager: bool
    width: int
    world_size: int
    options: Any
    framework: FrameworkAccess


@dataclass
class Call:
    """One call as the core sees it when it hands the averaged gradients to the correction.

    ``step``: the pipeline step of this call's gradient; ``stale``: the averaged gradients are
    an earlier step's, ``stale_step`` (False: this call's own, synchronous, or none);
    ``applies``: the pipeline has something to apply; ``pipelined``: past warm-up (this call's
    gradient is in flight); ``local``: this call's local gradients, when
    :attr:`Correction.needs_local`; ``loss_scaled``: an AMP loss scaler checks the update's
    gradients for overflow (eagerly, on each rank)."""

    step: Step
    stale: Cond
    stale_step: Step
    applies: Cond
    pipelined: Cond
    local: Optional[Grads] = None
    loss_scaled: bool = False


class Correction:  # noqa: B024 - the identity is usable as it is
    """The identity correction, and the interface every correction implements (module docstring).

    Class attributes the core reads once:

    * ``name``: the ``staleness_correction=`` value; ``""`` for the identity.
    * ``calls_per_update``: 2 where two calls (two halves of a batch) make one update.
    * ``needs_local``: :meth:`before_update` reads this call's local gradients (``Call.local``).
    * ``transforms_input``: :meth:`local_` does something (the core skips it otherwise).
    * ``per_rank_state``: its state of the steps in flight differs between ranks, so a rank that
      did not load the checkpoint cannot take another's.
    * ``elastic``: it runs under Horovod elastic (a new world takes rank 0's state, settled:
      :meth:`before_flush` then :meth:`flushed`, with the in-flight average still to apply).
    """

    name: ClassVar[str] = ""
    calls_per_update: ClassVar[int] = 1
    needs_local: ClassVar[bool] = False
    transforms_input: ClassVar[bool] = False
    per_rank_state: ClassVar[bool] = False
    elastic: ClassVar[bool] = True

    def __init__(self, context: CorrectionContext) -> None:
        # What every call needs; the rest of the context is read once by the subclass's __init__.
        self.ops, self.weights, self.eager = context.ops, list(context.weights), context.eager

    @classmethod
    def refusal(cls, options: Any, grad_scaler: bool) -> Optional[str]:
        """Why this correction cannot run with ``options`` (None: it can)."""
        return None

    @classmethod
    def active_at(cls, width: int) -> bool:
        """Whether the correction has anything to do at ``width`` (most do nothing at width 1)."""
        return width > 1

    # ---------------------------------------------------------------------------- a call
    def feeds(self) -> Cond:
        """Whether this call hands its gradients to the pipeline (a reduction of its own)."""
        return True

    def takes(self) -> Cond:
        """Whether this call takes what the pipeline has ready: a call that feeds takes what
        falls out at the pipeline's width, one that does not feeds takes everything in flight."""
        return True

    def begin_call(self, loss_scale: Any) -> None:
        """The call's first gradient is about to arrive; ``loss_scale``: the AMP scale now (None)."""

    def local_(self, index: int, grad: Tensor) -> Tensor:
        """What this call hands the pipeline for tensor ``index`` if it :meth:`feeds` (``grad``:
        its local gradient); a call that does not feed may keep ``grad`` here."""
        return grad

    def before_update(self, call: Call, grads: Grads) -> Tuple[Grads, Cond]:
        """The gradients the update applies, and whether it runs; ``grads``: the averaged
        gradients the pipeline hands this call (``call.applies``: there are any)."""
        return grads, call.applies

    def around_update(self, call: Call) -> ContextManager[Optional[StatelessStep]]:
        """Wraps the wrapped optimizer's update of this call; yields the framework's
        :class:`StatelessStep` when this update must leave the optimizer's state alone and the
        framework can make such a step (it runs that instead of its ordinary step), else None."""
        return contextlib.nullcontext()

    def after_update(self, call: Call) -> None:
        """After this call's update, or at the end of a call that had none to make (a fill step)."""

    def update_skipped(self, call: Call) -> None:
        """The update :meth:`before_update` prepared did not run (a GradScaler found the
        gradients not finite and skipped ``optimizer.step()``)."""

    # ---------------------------------------------------------------------------- flush()
    def before_flush(self) -> None:
        """``flush()`` begins: the steps in flight are applied next, through :meth:`settle`."""

    def settle(self, grads: Grads, step: Step) -> Grads:
        """``flush()``: the gradients that apply the average of step ``step`` still in flight."""
        return grads

    def flushed(self) -> None:
        """``flush()`` applied everything: the weights are the real ones, nothing is pending."""

    def pending(self) -> Optional[Grads]:
        """``flush()``: gradients this correction holds that no reduction carries yet (a half
        batch it kept), to reduce and apply as an update of their own; None: nothing."""
        return None

    # ---------------------------------------------------------------------- real weights
    def show_real(self) -> Any:
        """Writes the real weights into the model where it holds others; returns what
        :meth:`show_back` needs to put them back (None: nothing was written)."""
        return None

    def show_back(self, token: Any) -> None:
        """Puts back what :meth:`show_real` took out (bit for bit), unless a ``flush()`` in
        between made the real weights the ones to keep."""

    def holds_other_weights(self) -> bool:
        """Eagerly: whether the model holds weights other than the real ones now."""
        return False

    def real_values(self) -> List[Tensor]:
        """The real weights' values, as tensors (traced: where the model holds others, theirs
        from the correction's state), for a check that compares replicas."""
        return [self.ops.read(w) for w in self.weights]

    # ---------------------------------------------------------------------- checkpointing
    def state(self) -> List[Tensor]:
        """The variables a traced framework's checkpoint tracks."""
        return []

    def state_dict(self, names: Sequence[str]) -> Optional[Dict[str, Any]]:
        """Copies of its state by tensor name, with ``"kind": name`` (None: it has none)."""
        return None

    def load_state_dict(self, saved: Optional[Dict[str, Any]], names: Sequence[str]) -> None:
        """After the model's weights and the optimizer's state were loaded. ``saved`` may be
        another correction's state or None (a checkpoint of another mode): then start afresh,
        applying what is in flight as it is."""


def saved_kind(saved: Optional[Dict[str, Any]], kind: str) -> Optional[Dict[str, Any]]:
    """``saved`` if it is the state of correction ``kind``, else None."""
    return saved if saved is not None and saved.get("kind") == kind else None
