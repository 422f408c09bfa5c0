"""``import pipesgd_hvd.keras as psgd``: the pipelined optimizer for Keras 3 (``model.fit``)."""
from .compression import Compression
from .frameworks.tensorflow import DistributedOptimizer

__all__ = ["Compression", "DistributedOptimizer"]
