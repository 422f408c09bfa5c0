"""Which transport a PyTorch optimizer uses when it is not given one."""
from __future__ import annotations

import os
from typing import Optional

from .base import Communicator

TRANSPORTS = ("horovod", "mpi4py", "torch.distributed")


def default_communicator(name: Optional[str] = None) -> Communicator:
    """Horovod when it is initialized, else torch.distributed; ``name`` or ``PIPESGD_COMMUNICATOR``
    ("horovod", "mpi4py", "torch.distributed") picks one explicitly."""
    name = name or os.environ.get("PIPESGD_COMMUNICATOR") or None
    if name is not None and name not in TRANSPORTS:
        raise ValueError(f"unknown communicator {name!r}: use 'horovod', 'mpi4py' or 'torch.distributed'")
    if name == "mpi4py":
        from ..frameworks.torch_ops import TORCH_OPS
        from .mpi4py import Mpi4pyCommunicator

        return Mpi4pyCommunicator(TORCH_OPS)
    if name in (None, "horovod"):
        try:
            import horovod.torch as hvd
        except ImportError:  # torchrun users may not have Horovod
            hvd = None
        if hvd is not None and hvd.is_initialized():
            from .horovod_torch import HorovodTorchCommunicator

            return HorovodTorchCommunicator()
    if name in (None, "torch.distributed"):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from .torch_distributed import TorchDistributedCommunicator

            return TorchDistributedCommunicator()
    raise RuntimeError("no communicator is ready: call hvd.init() (or torch.distributed.init_process_group()) "
                       "before creating DistributedOptimizer")
