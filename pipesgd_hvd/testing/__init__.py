"""Test scaffolding, shipped for your own tests as ``torch.testing`` is: no training job needs it.

* :class:`LocalWorld` / :class:`LocalCommunicator`: N ranks as threads of one process; pass
  ``communicator=world.communicator(rank)`` to the optimizer on each rank's thread. Collectives
  are matched by issue order, as MPI matches them, and a rank that issues a different collective
  from its peers raises at once, so a test also catches ranks that diverge.
* :class:`LocalCluster`: hosts x ranks-per-host in-process ranks with the node and cross-node
  groups of the hierarchical all-reduce (``hierarchical=cluster.topology(rank)``).
* :class:`CountingComm`: any communicator seen through a byte counter (bytes within and between hosts).

The production layers (``pipesgd_hvd.torch`` ... ``pipesgd_hvd.ops``) never import this package
(``tests/test_imports.py``); it may import any of them. docs/transports.md shows its use.
"""
from .cluster import LocalCluster
from .counting import CountingComm
from .local import LocalCommunicator, LocalWorld

__all__ = ["CountingComm", "LocalCluster", "LocalCommunicator", "LocalWorld"]
