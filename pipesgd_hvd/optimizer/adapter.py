"""What the optimizer core (``optimizer/core.py``) asks of a framework whose training step runs
in Python: the one interface an adapter implements (PyTorch's: ``torch/adapter.py``)."""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Dict, List, Optional, Protocol, Tuple

from ..ops.base import MutableTensorOps, Tensor
from ..pipeline.fusion import TensorSpec


class TrainingAdapter(Protocol):
    """What the core needs from a framework whose training step runs in Python. Tensors are
    addressed by their index in the core's tensor list (the order of ``tensor_specs()``)."""

    ops: MutableTensorOps

    def tensor_specs(self) -> List[TensorSpec]: ...
    def device_anchors(self) -> Dict[str, Tensor]:
        """A tensor per device name, next to which that device's fusion buffers go."""
    def trainable(self) -> List[int]:
        """Indices of the tensors that take part in this step (require grad now)."""
    def has_local_gradient(self, index: int) -> bool: ...
    def local_gradient(self, index: int) -> Tensor:
        """This rank's gradient of the tensor (it has one), checked and dense."""
    def write_gradients(self, grads: Dict[int, Tensor], scale: Any, owned: bool = False) -> None:
        """Put the averaged gradients (times ``scale``: a float, 1.0 for none, or a 0-d tensor)
        where the update reads them; tensors missing from ``grads`` get none. ``owned``: the
        tensors' memory is the adapter's now (see :class:`~pipesgd_hvd.pipeline.engine.AppliedStep`), so
        they may become the gradients without a copy."""
    def zero_gradients(self) -> None: ...
    def apply_update(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Run the wrapped optimizer's update on the written gradients."""
    def loss_scale(self) -> Any:
        """The AMP loss scale now (None without one): a float, or a 0-d tensor on the device
        where the framework keeps it (the ratio of two scales is then computed there, no sync)."""
    def gradients_finite(self) -> bool: ...
    def gradients_all_zero(self) -> bool:
        """Every present gradient is zero (how Horovod's broadcast_optimizer_state creates state)."""
    def optimizer_has_state(self) -> bool:
        """The wrapped optimizer holds per-tensor state (momentum buffers, moments)."""
    def weights(self) -> List[Tensor]:
        """The tensors themselves (weight prediction writes them, inside ``weights_guard()``)."""
    def weights_guard(self) -> ContextManager[Any]: ...
    def replica_fingerprints(self) -> List[Tuple[str, Any]]:
        """(name, host array) per tensor for the replica check: arrays that are equal iff the
        tensors are bitwise equal (the values, or a fingerprint computed on the device)."""
    def optimizer_snapshot(self) -> Any:
        """An :class:`~pipesgd_hvd.staleness.split_batch.OptimizerSnapshot` of the wrapped optimizer."""
    def optimizer_state_dict(self) -> Dict[str, Any]: ...
    def load_optimizer_state_dict(self, state: Dict[str, Any]) -> None: ...
    def watch_gradients(self, ready: Callable[[int], None]) -> None:
        """Make every trainable tensor report its gradient, ``ready(index)``, as soon as it is
        produced (called again after each step: tensors unfrozen since then start reporting)."""
    def unwatch_gradients(self) -> None:
        """Stop reporting (the optimizer is gone)."""
    def check_adam_support(self) -> None:
        """Raises a ValueError naming the fix unless the wrapped optimizer is Adam/AdamW."""
    def adam_state(self, index: int) -> Any:
        """Its :class:`~pipesgd_hvd.staleness.prediction.AdamState` for tensor ``index`` (None before an update)."""
