"""Communicators: the collectives behind one protocol. Implementations import their transport
lazily (``pipesgd_hvd.comm.horovod_torch`` imports Horovod, ``.mpi4py`` imports mpi4py, ...)."""
from .base import Communicator, DoneHandle, Handle, PeerLostError, PolledHandle, ReduceOp

__all__ = ["Communicator", "DoneHandle", "Handle", "PeerLostError", "PolledHandle", "ReduceOp"]
