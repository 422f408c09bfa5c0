"""What the corrections whose model variables hold a look-ahead share (``split_batch`` and
``acco``): the real weights theta_t kept aside while the model holds the look-ahead, shown in
their place (``real_weights()``, a checkpoint) and put back, and the look-ahead's optimizer step,
which leaves the optimizer's state as it found it.

Written once over :class:`~pipesgd_hvd.ops.base.TensorOps`, with host conditions (PyTorch's core)
or traced ones (Keras's step)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Optional

from ..ops.base import Tensor
from .conds import Flag, maybe, select
from .correction import Correction, CorrectionContext, StatelessStep


class LookAheadCorrection(Correction):
    """``real``: theta_t while ``ahead`` is set (the weights hold the look-ahead); ``_aside``: the
    look-ahead while :meth:`show_real` shows theta_t in its place."""

    def __init__(self, context: CorrectionContext) -> None:
        super().__init__(context)
        ops = self.ops
        # A look-ahead's step: the framework's own stateless one where it has it (no copy of the
        # optimizer's state), else the ordinary step between a save and a restore of the state.
        self.stateless = context.framework.look_ahead_step()
        self.snapshot = context.framework.optimizer_snapshot() if self.stateless is None else None
        self.real: List[Tensor] = [ops.new_state(ops.read(w)) for w in self.weights]
        self.ahead = Flag(ops, self.eager)  # the weights hold the look-ahead, theta_t is in ``real``
        self._aside: Optional[List[Tensor]] = None

    @contextlib.contextmanager
    def state_kept(self, virtual: Any) -> Iterator[Optional[StatelessStep]]:
        """Around the optimizer's step: where ``virtual`` (the look-ahead's step), the optimizer's
        state is left as it was: the framework's stateless step is yielded for it, or the state is
        saved before the ordinary step and restored after."""
        if self.snapshot is None:
            yield self.stateless if virtual is True else None
            return
        if maybe(virtual):
            self.snapshot.save(virtual)
        yield None
        if maybe(virtual):
            self.snapshot.restore(virtual)

    def shown_weights(self) -> List[Tensor]:
        """The variables that hold the look-ahead now (set aside inside ``real_weights()``)."""
        return self._aside if self._aside is not None else self.weights

    # ---------------------------------------------------------------------- the real weights
    def holds_other_weights(self) -> bool:
        return self.ahead.is_set()

    def real_values(self) -> List[Tensor]:
        ops, other = self.ops, self.ahead.get()
        return [select(ops, other, ops.read(kept), ops.read(w)) for w, kept in zip(self.weights, self.real)]

    def show_real(self) -> Optional[List[Tensor]]:
        if not self.ahead.is_set():
            return None
        ops = self.ops
        look_ahead = [ops.new_state(ops.read(w)) for w in self.weights]
        for w, kept in zip(self.weights, self.real):
            ops.assign(w, ops.read(kept))
        self._aside = look_ahead
        return look_ahead

    def show_back(self, token: Optional[List[Tensor]]) -> None:
        self._aside = None
        if token is not None and self.ahead.is_set():
            for w, ahead in zip(self.weights, token):
                self.ops.assign(w, self.ops.read(ahead))
