"""Which ranks share a node: the two sub-communicators of the hierarchical all-reduce.

Horovod numbers ranks on a node by ``local_rank`` (0 .. ``local_size``-1) and the ranks of one
local rank across nodes by ``cross_rank`` (0 .. ``cross_size``-1). A :class:`Topology` holds a
communicator over this rank's node (``local``, ordered by local rank) and one over the ranks of
its local rank on every node (``cross``, ordered by cross rank). The hierarchical all-reduce
(``compression/hierarchical.py``) reduces inside the node on the first and compresses across
nodes on the second.

Built for the pipeline's own channel (:func:`channel_topology`: two more channels on the same
store, each with its own Gloo groups, so their collectives never interleave with the parent's),
for in-process ranks (:class:`pipesgd_hvd.testing.LocalCluster`), or by hand over any transport
(``Topology(layout, local=..., cross=...)``, passed as ``hierarchical=``).
:func:`resolve_topology` turns the optimizer's ``hierarchical`` argument into one, or None.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .base import Communicator


@dataclass(frozen=True)
class NodeLayout:
    """This rank's place among nodes, as Horovod numbers it."""

    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def __post_init__(self) -> None:
        if not (0 <= self.local_rank < self.local_size and 0 <= self.cross_rank < self.cross_size):
            raise ValueError(f"not a rank's place among nodes: {self}")

    @property
    def size(self) -> int:
        return self.local_size * self.cross_size

    @property
    def worth_it(self) -> bool:
        """Several ranks per node and several nodes: only then do cross-node bytes shrink (with one
        rank per node it is the flat reduction plus two empty stages; on one node, it compresses
        nothing that crosses a slow link)."""
        return self.local_size > 1 and self.cross_size > 1

    @classmethod
    def from_horovod(cls) -> "NodeLayout":
        import horovod.torch as hvd

        return cls(hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())


@dataclass(frozen=True)
class Topology:
    """This rank's node group (``local``) and cross-node group (``cross``), see the module docstring."""

    layout: NodeLayout
    local: Communicator
    cross: Communicator

    def __post_init__(self) -> None:
        lay = self.layout
        if (self.local.rank, self.local.size) != (lay.local_rank, lay.local_size) or \
                (self.cross.rank, self.cross.size) != (lay.cross_rank, lay.cross_size):
            raise ValueError(f"the communicators do not match the layout {lay}: local is rank {self.local.rank} of "
                             f"{self.local.size}, cross rank {self.cross.rank} of {self.cross.size}")

    def with_comms(self, wrap: Callable[[Communicator], Communicator]) -> "Topology":
        """The same groups, each seen through ``wrap`` (the engine's abort check)."""
        return Topology(self.layout, wrap(self.local), wrap(self.cross))

    def close(self) -> None:
        """Closes the groups that can be closed (the channel's)."""
        for comm in (self.local, self.cross):
            close = getattr(comm, "close", None)
            if close is not None:
                close()


def layout_problem(layouts: Sequence[NodeLayout], size: int) -> Optional[str]:
    """Why the ranks' layouts cannot make a hierarchical reduction (None if they can): every node
    must hold as many ranks, and every (node, local rank) must be taken exactly once."""
    local_sizes = sorted({lay.local_size for lay in layouts})
    cross_sizes = sorted({lay.cross_size for lay in layouts})
    if len(local_sizes) > 1 or len(cross_sizes) > 1:
        return (f"the hosts hold different numbers of ranks (local sizes {local_sizes}, cross sizes {cross_sizes}); "
                "launch as many ranks on every host (e.g. horovodrun -H a:4,b:4)")
    places = {(lay.cross_rank, lay.local_rank) for lay in layouts}
    if layouts[0].size != size or len(places) != size:
        return (f"{size} ranks do not fill {layouts[0].cross_size} hosts x {layouts[0].local_size} ranks once each "
                f"(places {sorted(places)})")
    return None


def _sub_channel(parent: Any, rank: int, size: int, label: str) -> Any:
    """A channel over some of ``parent``'s ranks, on its store, under its prefix plus ``label``
    (the same on every member and different for every group), with its timeout, address and
    error type. Collective over the group's members. (Reads the parent's settings: the channel
    keeps them private, and a sub-group must be built exactly as its parent was.)"""
    from .pipeline_channel import PipelineChannel

    return PipelineChannel(parent._store, rank, size, address=parent.address, secret=parent._secret,
                           timeout=parent._timeout, prefix=f"{parent._prefix}/{label}", error=parent._error, ops=parent._ops,
                           device_group=parent._device_factory)


def channel_topology(channel: Any, layout: NodeLayout, name: str) -> Topology:
    """The node and cross-node groups as channels beside ``channel`` (a PipelineChannel), named
    ``name`` (the same on every rank, and different for every topology of the channel: every
    optimizer of the process builds its own on the one shared channel, and groups under the same
    keys of its store would meet the earlier groups' entries and never connect).
    Collective: every rank calls it at the same point, with the layouts checked alike
    (:func:`resolve_topology`). The node group is built first on every rank, then the cross one."""
    local = _sub_channel(channel, layout.local_rank, layout.local_size, f"{name}/node{layout.cross_rank}")
    try:
        cross = _sub_channel(channel, layout.cross_rank, layout.cross_size, f"{name}/cross{layout.local_rank}")
    except BaseException:
        local.close()
        raise
    return Topology(layout, local, cross)


def resolve_topology(choice: Any, comm: Communicator, *, name: str = "psgd.topology",
                     settings: Any = None, wanted: bool = True) -> Optional[Topology]:
    """The groups the optimizer's ``hierarchical`` argument asks for, or None (flat reductions).

    ``False``: None. A :class:`Topology`: it, once its size is checked. ``True`` (or "fp16" /
    "bf16", the node stage's dtype, which the caller reads) or ``None`` (the default) on the
    pipeline's channel under Horovod: gathers every rank's layout (one object allgather on
    ``comm``, named ``name``, so every rank decides from the same facts) and builds the groups
    (:func:`channel_topology`); ``None`` builds them only where they help (several ranks on each
    of several hosts), the others always, and raise, naming the fix, where they cannot.
    ``wanted``: a byte codec may run (with a plain all-reduce there is no stage to split).

    Collective on a channel of more than one rank, whatever ``choice``, ``wanted`` and
    ``settings`` are: the gather carries them, and ranks whose values differ all end flat, so
    that a rank set up differently from the others meets them at the pipeline's own cross-rank
    check (which names the setting) instead of in a group only some of them build."""
    if isinstance(choice, Topology):
        if choice.layout.size != comm.size:
            raise ValueError(f"hierarchical= was given a Topology of {choice.layout.local_size} x "
                             f"{choice.layout.cross_size} ranks for a communicator of {comm.size}")
        return choice
    required = choice is True or isinstance(choice, str)  # "fp16"/"bf16": on, 16 bits inside the node
    if choice is not None and choice is not False and not required:
        raise ValueError(f"hierarchical must be None (on where it helps), True, False, 'fp16', 'bf16' or a Topology, "
                         f"got {choice!r}")
    if not _is_channel(comm):
        if required:
            raise ValueError(f"hierarchical={choice!r} builds its node groups on the pipeline's own channel (the "
                             f"default communicator under Horovod), not on {type(comm).__name__}: leave communicator= "
                             "out, pass hierarchical=False, or pass hierarchical=Topology(...) built over your transport")
        return None
    if comm.size == 1:
        return None
    layout = _horovod_layout(choice if required else None)
    mine = [None if layout is None else [layout.local_rank, layout.local_size, layout.cross_rank, layout.cross_size],
            repr(choice), bool(wanted), repr(settings)]
    gathered = comm.allgather_object(mine, name)
    if any(entry[1] != mine[1] for entry in gathered):
        values = ", ".join(f"rank {r}: {entry[1]}" for r, entry in enumerate(gathered))
        raise ValueError(f"hierarchical= differs across ranks ({values}): pass the same value on every rank")
    if any(entry[2:] != mine[2:] for entry in gathered):
        return None  # set up differently: the pipeline's cross-rank check names the difference
    if choice is False or not wanted or layout is None:
        return None
    layouts = [NodeLayout(*entry[0]) for entry in gathered]
    problem = layout_problem(layouts, comm.size)
    if problem is not None:
        if required:
            raise ValueError(f"hierarchical={choice!r} needs the same number of ranks on every host: {problem}; or "
                             "pass hierarchical=False")
        return None
    if not required and not layout.worth_it:
        return None
    return channel_topology(_channel(comm), layout, name)


def _channel(comm: Communicator) -> Any:
    """The channel itself, also when it is the process's shared one (comm/ordered.py wraps it)."""
    return getattr(comm, "inner", comm)


def _is_channel(comm: Communicator) -> bool:
    """Whether ``comm`` is the pipeline's channel, without importing it (and PyTorch) into a
    process that never built one (Keras)."""
    module = sys.modules.get("pipesgd_hvd.comm.pipeline_channel")
    return module is not None and isinstance(_channel(comm), module.PipelineChannel)


def _horovod_layout(required: Any) -> Optional[NodeLayout]:
    """This rank's layout from Horovod; None without it, unless ``required`` (the user's value) asks for it."""
    try:
        import horovod.torch as hvd

        ready = hvd.is_initialized()
    except ImportError:
        ready = False
    if ready:
        return NodeLayout.from_horovod()
    if required is not None:
        raise ValueError(f"hierarchical={required!r} takes the hosts from Horovod (hvd.init() first); without Horovod "
                         "pass hierarchical=Topology(...) or hierarchical=False")
    return None


__all__ = ["NodeLayout", "Topology", "channel_topology", "layout_problem", "resolve_topology"]
