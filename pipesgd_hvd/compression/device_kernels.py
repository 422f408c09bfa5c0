"""Which fused kernels a tensor without an address gets, by the device its table names
(``TensorOps.kernel_device``):

* ``"cuda"``: the Triton kernels (``triton_kernels.py``) when ``triton`` is importable, else none
  (the codecs then run their tensor-op reference, which on a GPU is several kernels per codec
  pass but correct);
* ``"tensorflow"``: the host kernels inside ``tf.numpy_function`` (``tf_kernels.py``); asked only
  when the C kernels are built (``kernels.device_module`` warns as the host path does if not).

Each module is imported on first use, never at import time: Triton is absent from CPU installs
and importing it costs seconds, and TensorFlow is only there for its own tensors.
"""
from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Optional


@functools.lru_cache(maxsize=None)
def load(device: str) -> Optional[ModuleType]:
    """The kernels module for ``device`` (asked once per process and device), or None."""
    if device == "cuda":
        try:
            importlib.import_module("triton")
        except ImportError:
            return None
        return importlib.import_module("pipesgd_hvd.compression.triton_kernels")
    if device == "tensorflow":  # the caller (kernels.device_module) checked that the C kernels are built
        return importlib.import_module("pipesgd_hvd.compression.tf_kernels")
    raise ValueError(f"no device kernels for {device!r}: a table's kernel_device() names 'cuda' or 'tensorflow'")
