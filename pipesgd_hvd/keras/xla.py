"""Keras and XLA: the pipelined step cannot be XLA-compiled; say so before ``fit`` fails inside it.

Keras 3 compiles the train step with XLA when ``model.compile(jit_compile=True)``, and
``jit_compile="auto"`` (the default) resolves to True when a GPU is visible. The pipelined step
holds ops that have no XLA kernels (Horovod's collectives, ``tf.py_function`` for the pipeline's
own transports, ``fingerprint`` in the replica check), so such a ``fit`` fails deep in XLA's
compiler. The check runs when Keras builds the optimizer at the start of ``fit``; a custom loop
that wraps its step in ``tf.function(jit_compile=True)`` cannot be seen from here and fails there.
"""
from __future__ import annotations

import inspect
from typing import Any, Optional

XLA_FIX = "model.compile(..., jit_compile=False)"


def check_not_xla_compiled(model: Any) -> None:
    """Raises ValueError, with the fix, when ``model``'s train step would be XLA-compiled."""
    if getattr(model, "jit_compile", False) is True:  # compile() resolved "auto" already
        raise ValueError(
            "pipesgd_hvd's Keras DistributedOptimizer cannot run in an XLA-compiled train step, and this model's "
            "is (model.jit_compile is True; Keras's default jit_compile='auto' turns XLA on when a GPU is visible): "
            "Horovod's collectives and the pipeline's tf.py_function have no XLA kernels. Fix: compile with "
            f"{XLA_FIX}")


def calling_model(depth: int = 16) -> Optional[Any]:
    """The Keras model whose method is on the call stack (``fit`` builds the optimizer from
    ``Model._symbolic_build``), or None (a custom loop)."""
    import keras

    frame = inspect.currentframe()
    try:
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.Model):
                return owner
        return None
    finally:
        del frame
