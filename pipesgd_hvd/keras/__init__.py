"""``import pipesgd_hvd.keras as hvd``: Horovod's Keras API, working on Keras 3, pipelined.

Horovod's functions are handed through unchanged (init, rank, size, local_rank, allreduce,
allgather, broadcast, ...). Ours, because Horovod's do not work with Keras 3:
``DistributedOptimizer`` (pipelined; ``width=1`` is synchronous), ``callbacks`` (broadcast,
metric average, learning-rate warm-up and schedule, best-model checkpoint), ``elastic``
(``KerasState``, ``run`` and the elastic callbacks), and ``broadcast_global_variables`` /
``load_model``. ``Compression`` is ours and also accepts Horovod's compressors.
``ReplicaDriftError``, ``StepCountMismatchError``, ``PeerLostError``: the errors of
``docs/reliability.md``.
"""
from horovod.tensorflow import allgather_object, broadcast_object  # noqa: F401 (handy for scripts)
from horovod.tensorflow.keras import (  # noqa: F401
    Average, ProcessSet, Sum, add_process_set, allgather, allreduce, broadcast, ccl_built, cross_rank, cross_size,
    cuda_built, ddl_built, global_process_set, gloo_built, gloo_enabled, init, is_initialized, local_rank,
    local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, reducescatter, remove_process_set,
    rocm_built, shutdown, size, start_timeline, stop_timeline)

from ..comm.base import PeerLostError
from ..compression import Compression
from ..pipeline.guards import ReplicaDriftError, StepCountMismatchError
from ..staleness.choice import AccuracyWarning
from ..staleness.halves import halves
from .optimizer import DistributedOptimizer, load_model
from . import callbacks, elastic
from .callbacks import broadcast_global_variables, broadcast_variables

__all__ = ["AccuracyWarning", "Average", "Compression", "DistributedOptimizer", "PeerLostError", "ReplicaDriftError",
           "StepCountMismatchError", "Sum", "broadcast_global_variables", "broadcast_variables", "callbacks",
           "elastic", "halves", "load_model"]
