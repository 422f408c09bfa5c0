"""``import pipesgd_hvd.torch as hvd``: Horovod's PyTorch API with a pipelined DistributedOptimizer.

Everything public in ``horovod.torch`` (init, rank, size, broadcast_parameters, allreduce, ...)
is handed through unchanged; ``DistributedOptimizer``, ``Compression``, ``join`` (uneven data
per rank, with a pipelined optimizer), ``halves`` (the two calls of an update in the accurate
mode) and ``AccuracyWarning`` are pipesgd_hvd's.
Importing this module does not import TensorFlow.
"""
try:
    # Hand Horovod's functions through (not rewritten): init, rank, size, local_rank,
    # broadcast_parameters, broadcast_optimizer_state, allreduce, allgather, join, ...
    from horovod.torch import *  # noqa: F401,F403
    from horovod.torch import Average, Sum  # noqa: F401
except ImportError:  # torchrun without Horovod: the optimizer still works over torch.distributed
    from ..comm.base import ReduceOp as _ReduceOp

    Average, Sum = _ReduceOp.AVERAGE, _ReduceOp.SUM

from ..comm.base import PeerLostError  # noqa: E402
from ..compression import Compression  # noqa: E402
from ..pipeline.guards import ReplicaDriftError, StepCountMismatchError  # noqa: E402
from .distributed_optimizer import DistributedOptimizer, join  # noqa: E402,F811 (ours replaces Horovod's join)
from ..staleness.choice import AccuracyWarning  # noqa: E402
from ..staleness.halves import halves  # noqa: E402

__all__ = ["AccuracyWarning", "Average", "Compression", "DistributedOptimizer", "PeerLostError", "ReplicaDriftError",
           "StepCountMismatchError", "Sum", "halves", "join"]
