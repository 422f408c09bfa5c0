"""``hvd.elastic.TorchState`` for the pipelined optimizer: the rule of :mod:`pipesgd_hvd.optimizer.elastic_rule`.

``TorchState(model=..., optimizer=opt, ...)`` picks a handler per attribute from Horovod's
registry, first match by ``isinstance``. Horovod's ``OptimizerStateHandler`` restores with
``load_state_dict`` (which refuses gradients in flight) and syncs with
``broadcast_optimizer_state``, which sends only the wrapped optimizer's tensors: a joining
worker would miss the in-flight gradient and apply nothing where the others apply it. So the
pipelined optimizer gets its own handler, put ahead of Horovod's when an optimizer is built;
user code stays exactly Horovod's elastic example. The work is the optimizer core's.
"""
from __future__ import annotations

from typing import Any

from horovod.torch.elastic import state as _hvd_state


class PipelinedOptimizerStateHandler(_hvd_state.OptimizerStateHandler):
    """save: ``state_dict()`` (waits for the steps in flight: collective, at the same commit on
    every rank). restore: drop what is in flight, load the commit. sync: drop the old world's
    reductions, rebuild for the new world, continue from rank 0's state."""

    def __init__(self, optimizer: Any) -> None:
        optimizer.core.check_elastic_support()
        super().__init__(optimizer)

    def restore(self) -> None:
        self.value.core.elastic_restore(self._saved_optimizer_state)

    def sync(self) -> None:
        self.value.core.elastic_sync()


def register_elastic_handler(optimizer_class: type) -> None:
    """Puts the handler for ``optimizer_class`` first in Horovod's registry (once): it is a
    ``torch.optim.Optimizer`` too, and the first match wins."""
    registry = _hvd_state.get_handler_registry()
    if not any(cls is optimizer_class for cls, _ in registry):
        _hvd_state.set_handler_registry([(optimizer_class, PipelinedOptimizerStateHandler)] + list(registry))
