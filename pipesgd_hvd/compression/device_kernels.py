"""Which fused kernels a device tensor gets: the Triton ones (``triton_kernels.py``) when
``triton`` is importable, else none (the codecs then run their tensor-op reference, which on a
GPU is several kernels per codec pass but correct).

The Triton module is imported on first use by a CUDA tensor, never at import time: Triton is
absent from CPU installs, and importing it costs seconds.
"""
from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Optional


@functools.lru_cache(maxsize=None)
def load() -> Optional[ModuleType]:
    """The Triton kernels module, or None when Triton cannot be imported (asked once per process)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return None
    return importlib.import_module("pipesgd_hvd.compression.triton_kernels")
