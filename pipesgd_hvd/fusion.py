"""Fusion buckets: many gradients packed into a few flat buffers, so each collective is large.

Tensors are placed in the order they are expected to become ready (the reverse of registration
order, as a backward pass produces them), per (dtype, device), a new bucket starting when the
next tensor would push the current one past ``threshold_bytes`` (Horovod's
``HOROVOD_FUSION_THRESHOLD`` idea; 0 gives one bucket per tensor). Buckets are numbered in the
order they are opened, which is the order the engine launches them on every rank.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from .tensor_ops import ITEMSIZE

DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024  # Horovod's default


@dataclass(frozen=True)
class TensorSpec:
    """What the engine knows of one gradient: a name (the same on every rank), shape, dtype, device."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    device: str = "cpu"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE.get(self.dtype, 4)


@dataclass(frozen=True)
class Member:
    index: int           # position of the tensor in the engine's spec list
    offset: int          # element offset inside the bucket's flat buffer
    numel: int
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class Bucket:
    index: int
    dtype: str
    device: str
    members: Tuple[Member, ...]

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.members)


@dataclass(frozen=True)
class FusionLayout:
    buckets: Tuple[Bucket, ...]
    names: Tuple[str, ...]                           # names of the tensors it covers, in spec order
    placement: Dict[int, Tuple[int, Member]] = field(compare=False, repr=False)
    key: str = ""                                    # short, rank-independent id (used in op names)

    @property
    def indices(self) -> Tuple[int, ...]:
        return tuple(sorted(self.placement))


def plan_buckets(specs: Sequence[TensorSpec], ready_order: Sequence[int],
                 threshold_bytes: int = DEFAULT_FUSION_THRESHOLD) -> FusionLayout:
    """Place the tensors ``ready_order`` (indices into ``specs``) into buckets."""
    if threshold_bytes < 0:
        raise ValueError(f"fusion threshold must be >= 0 bytes, got {threshold_bytes}")
    building: List[List[int]] = []                   # bucket -> member indices, in open order
    open_bucket: Dict[Tuple[str, str], int] = {}     # (dtype, device) -> position in `building`
    open_bytes: Dict[Tuple[str, str], int] = {}
    for index in ready_order:
        spec = specs[index]
        group = (spec.dtype, spec.device)
        pos = open_bucket.get(group)
        if pos is None or open_bytes[group] + spec.nbytes > threshold_bytes:
            pos = len(building)
            building.append([])
            open_bucket[group], open_bytes[group] = pos, 0
        building[pos].append(index)
        open_bytes[group] += spec.nbytes

    buckets: List[Bucket] = []
    placement: Dict[int, Tuple[int, Member]] = {}
    for b, indices in enumerate(building):
        offset, members = 0, []
        for index in indices:
            member = Member(index, offset, specs[index].numel, specs[index].shape)
            members.append(member)
            placement[index] = (b, member)
            offset += member.numel
        first = specs[indices[0]]
        buckets.append(Bucket(b, first.dtype, first.device, tuple(members)))

    names = tuple(specs[i].name for i in sorted(placement))
    signature = repr([(b.dtype, [(specs[m.index].name, m.shape) for m in b.members]) for b in buckets])
    key = hashlib.blake2b(signature.encode(), digest_size=4).hexdigest()
    return FusionLayout(tuple(buckets), names, placement, key)
