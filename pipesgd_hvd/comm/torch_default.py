"""Which transport a PyTorch optimizer uses when it is not given one object.

Under Horovod the default is the pipeline's own channel (:mod:`.pipeline_channel`), built over
Horovod's world: Horovod names an unnamed op after a per-process counter that every Horovod op
advances, so the pipeline's collectives, issued at moments that depend on thread timing, must
not be Horovod's ops (the user's unnamed ``hvd.allreduce(metric)`` would get different names on
different ranks and hang); the channel also moves the compressed phases at wire speed where
Horovod's alltoall/allgather reach about half (docs/transports.md).

The channel, and torch.distributed's communicator under torchrun, are one per process, shared by
every optimizer, with every tensor collective issued by one thread (:mod:`.ordered` says why).
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Tuple

from .base import Communicator

TRANSPORTS = ("channel", "horovod", "mpi4py", "torch.distributed")
CommFactory = Callable[[], Communicator]


def _horovod_initialized() -> bool:
    try:
        import horovod.torch as hvd
    except ImportError:  # torchrun users may not have Horovod
        return False
    return bool(hvd.is_initialized())


def _shared_channel() -> Communicator:
    """The process's pipeline channel for Horovod's current world (collective when it is built)."""
    import horovod.torch as hvd

    from ..ops.torch import TORCH_OPS
    from .ordered import shared_communicator
    from .pipeline_channel import PipelineChannel

    return shared_communicator(("channel", hvd.rank(), hvd.size()), PipelineChannel.from_horovod, TORCH_OPS)


def _shared_torch_distributed() -> Communicator:
    import torch.distributed as dist

    from ..ops.torch import TORCH_OPS
    from .ordered import shared_communicator
    from .torch_distributed import TorchDistributedCommunicator

    # The default group itself, not its id: a group made after destroy_process_group() may reuse an id.
    key = ("torch.distributed", dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    return shared_communicator(key, TorchDistributedCommunicator, TORCH_OPS)


def default_communicator(name: Optional[str] = None, *, collective: bool = True) -> Tuple[Communicator, Optional[CommFactory]]:
    """The transport named ``name`` (or ``PIPESGD_COMMUNICATOR``): "channel" (the default under
    Horovod), "horovod" (Horovod's own ops), "mpi4py", "torch.distributed" (the default without
    Horovod). Returns it and, when it must be built again for a new Horovod elastic world, how.

    ``collective=False``: issue no collective now (a worker joining a Horovod elastic job): the
    channel is then built by the factory, at the elastic sync, and Horovod's ops serve until then."""
    name = name or os.environ.get("PIPESGD_COMMUNICATOR") or None
    from .ordered import close_at_exit

    close_at_exit()  # before the optimizer registers its own exit handler (ordered.py says why)
    if name is not None and name not in TRANSPORTS:
        raise ValueError(f"unknown communicator {name!r}: use 'channel', 'horovod', 'mpi4py' or 'torch.distributed'")
    if name == "mpi4py":
        from ..ops.torch import TORCH_OPS
        from .mpi4py import Mpi4pyCommunicator

        return Mpi4pyCommunicator(TORCH_OPS), None
    if name in (None, "channel", "horovod") and _horovod_initialized():
        from .horovod_torch import HorovodTorchCommunicator

        if name == "horovod":
            return HorovodTorchCommunicator(), None
        if not collective:
            return HorovodTorchCommunicator(), _shared_channel
        return _shared_channel(), _shared_channel
    if name in (None, "torch.distributed"):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return _shared_torch_distributed(), None
    raise RuntimeError("no communicator is ready: call hvd.init() (or torch.distributed.init_process_group()) "
                       "before creating DistributedOptimizer")
