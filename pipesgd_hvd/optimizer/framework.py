"""What the optimizer asks of a framework.

* :class:`FrameworkSide`: what the pipeline's life cycle (``optimizer/lifecycle.py``) needs of any
  framework, eager or traced: the tensors it trains and its wrapped optimizer's state, for the
  staleness corrections. Keras's is ``keras/traced_step.py``'s ``KerasSide``.
* :class:`TrainingAdapter`: that, plus what the per-step policy (``optimizer/core.py``) needs of a
  framework whose training step runs in Python: gradients, hooks, the update. PyTorch's is
  ``torch/tensors.py``.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, List, Optional, Protocol, Tuple

from ..ops.base import MutableTensorOps, Tensor, TensorOps
from ..pipeline.fusion import TensorSpec
from ..staleness.prediction import AdamState
from ..staleness.correction import OptimizerSnapshot, StatelessStep


class FrameworkSide(Protocol):
    """The tensors a pipelined optimizer trains and its wrapped optimizer, as the staleness
    corrections reach them. Tensors are addressed by their index in the optimizer's list."""

    ops: TensorOps

    def weights(self) -> List[Tensor]:
        """The tensors themselves (the corrections write them, inside ``weights_guard()``)."""
    #: The context to write them in (``torch.no_grad``): the framework's own, so that the core,
    #: which enters it on every step, does not call back into the adapter.
    weights_guard: Callable[[], ContextManager[Any]]
    def check_adam_support(self) -> None:
        """Raises a ValueError naming the fix unless the wrapped optimizer is Adam/AdamW."""
    def adam_state(self, index: int) -> Optional[AdamState]:
        """Its :class:`~pipesgd_hvd.staleness.prediction.AdamState` for tensor ``index`` (None
        before its first update), for ``staleness_correction="adam_prediction"``."""
    def optimizer_snapshot(self) -> OptimizerSnapshot:
        """The wrapped optimizer's state saved and put back around a look-ahead's virtual update
        (:mod:`pipesgd_hvd.staleness.split_batch`, :mod:`pipesgd_hvd.staleness.acco`)."""
    def look_ahead_step(self) -> Optional[StatelessStep]:
        """The wrapped optimizer's step without a change of its state, where the framework can
        make one (no copy of the state then); None: the snapshot above is used."""


class TrainingAdapter(FrameworkSide, Protocol):
    """What the per-step policy needs from a framework whose training step runs in Python."""

    ops: MutableTensorOps

    def tensor_specs(self) -> List[TensorSpec]: ...
    def device_anchors(self) -> Dict[str, Tensor]:
        """A tensor per device name, next to which that device's fusion buffers go."""
    def trainable(self) -> List[int]:
        """Indices of the tensors that take part in this step (require grad now)."""
    def has_local_gradient(self, index: int) -> bool: ...
    def local_gradient(self, index: int) -> Tensor:
        """This rank's gradient of the tensor (it has one), checked and dense."""
    def apply(self, update: Any, check_finite: bool, stateless: Any = None) -> bool:
        """Writes ``update`` (an :class:`~pipesgd_hvd.optimizer.core.Update`; None: the gradients
        are written already) where the wrapped optimizer reads it and runs its step (``stateless``:
        that step instead, a look-ahead's); with ``check_finite`` skips the step where a gradient
        is not finite (a loss scale's overflow at ``flush()``). Returns whether the step ran. The
        rarer paths only (flush, join, exit): the framework drives the steady steps itself."""
    def loss_scale(self) -> Any:
        """The AMP loss scale now (None without one): a float, or a 0-d tensor on the device
        where the framework keeps it (the ratio of two scales is then computed there, no sync)."""
    def gradients_all_zero(self) -> bool:
        """Every present gradient is zero (how Horovod's broadcast_optimizer_state creates state)."""
    def optimizer_has_state(self) -> bool:
        """The wrapped optimizer holds per-tensor state (momentum buffers, moments)."""
    def replica_fingerprints(self) -> List[Tuple[str, Any]]:
        """(name, host array) per tensor for the replica check: arrays that are equal iff the
        tensors are bitwise equal (the values, or a fingerprint computed on the device)."""
    def optimizer_state_dict(self) -> Dict[str, Any]: ...
    def load_optimizer_state_dict(self, state: Dict[str, Any]) -> None: ...
    def watch_gradients(self, ready: Callable[[int], None]) -> None:
        """Make every trainable tensor report its gradient, ``ready(index)``, as soon as it is
        produced (called again when the trainable set changes: tensors unfrozen since then start
        reporting)."""
    def unwatch_gradients(self) -> None:
        """Stop reporting (the optimizer is gone)."""
