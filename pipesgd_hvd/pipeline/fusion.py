"""Fusion buckets: many gradients packed into a few flat buffers, so each collective is large.

Tensors are placed in the order they are expected to become ready (the reverse of registration
order, as a backward pass produces them), per (dtype, device). The engine launches a bucket as
soon as all of its gradients are in, so the plan decides when the wire starts:

* ``threshold_bytes`` is a hard cap, Horovod's ``HOROVOD_FUSION_THRESHOLD``: a tensor that would
  push the open bucket past it opens a new one (a tensor larger than the cap goes alone; 0 gives
  one bucket per tensor).
* Within the cap a bucket closes as soon as it holds its *target* (PyTorch DDP's rule): the first
  bucket of a group at ``FIRST_BUCKET_BYTES``, the later ones at ``1/SPREAD`` of the group's
  gradient. Why: with one 64 MiB cap a 17 MB gradient is one bucket, sent only once the whole
  backward pass is done, while Horovod starts each tensor as it becomes ready; a small first
  bucket puts the wire to work after the first layers' backward, and several later buckets let
  the rest follow the backward pass. Not per tensor: each collective has a fixed cost (two
  phases for the compressed all-reduce), so the later buckets stay a sizeable share of the whole.

The plan depends only on the specs, the order and the threshold, never on timing, so every rank
gets the same buckets; they are numbered in the order they are opened, which is the order the
engine launches them on every rank.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from ..ops.base import ITEMSIZE

DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024  # Horovod's default
#: The first bucket closes once it holds this much (DDP's ``bucket_cap_mb`` for its first bucket).
FIRST_BUCKET_BYTES = 1024 * 1024
#: Later buckets close at 1/SPREAD of their group's gradient: at most about SPREAD + 1 collectives
#: a step. Measured on the emulated cluster (2 hosts, 4 x Linear(1024), one launch, 4 buckets
#: against 1, step ratios): width 1 against Horovod 1.33 -> 0.97 (620 Mbit) and 1.06 -> 0.88
#: (155 Mbit); width 2 float32 0.72x (155 Mbit); int8 / int4 0.99 / 1.03 at 155 Mbit, 0.90 / 1.18
#: at 620 Mbit where the codec's CPU, not the wire, bounds the step (more calls, more CPU).
SPREAD = 4


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

    @functools.cached_property
    def indices(self) -> Tuple[int, ...]:
        """The spec indices it covers, sorted (asked at every step: computed once)."""
        return tuple(sorted(self.placement))


def bucket_targets(group_bytes: int, threshold_bytes: int) -> Tuple[int, int]:
    """(first, later): the sizes at which a group's first and later buckets close, never above
    the threshold. ``group_bytes`` is the group's whole gradient."""
    first = min(threshold_bytes, FIRST_BUCKET_BYTES)
    later = min(threshold_bytes, max(first, -(-group_bytes // SPREAD)))
    return first, later


def plan_buckets(specs: Sequence[TensorSpec], ready_order: Sequence[int],
                 threshold_bytes: int = DEFAULT_FUSION_THRESHOLD) -> FusionLayout:
    """Place the tensors ``ready_order`` (indices into ``specs``) into buckets (module docstring:
    the threshold caps a bucket, the targets close it early)."""
    if threshold_bytes < 0:
        raise ValueError(f"fusion threshold must be >= 0 bytes, got {threshold_bytes}")
    group_bytes: Dict[Tuple[str, str], int] = {}
    for index in ready_order:
        spec = specs[index]
        group = (spec.dtype, spec.device)
        group_bytes[group] = group_bytes.get(group, 0) + spec.nbytes
    building: List[List[int]] = []                   # bucket -> member indices, in open order
    open_bucket: Dict[Tuple[str, str], int] = {}     # (dtype, device) -> position in `building`
    open_bytes: Dict[Tuple[str, str], int] = {}
    opened: Dict[Tuple[str, str], int] = {}          # buckets opened so far per group
    for index in ready_order:
        spec = specs[index]
        group = (spec.dtype, spec.device)
        pos = open_bucket.get(group)
        if pos is None or open_bytes[group] + spec.nbytes > threshold_bytes:
            pos = len(building)
            building.append([])
            open_bucket[group], open_bytes[group] = pos, 0
            opened[group] = opened.get(group, 0) + 1
        building[pos].append(index)
        open_bytes[group] += spec.nbytes
        first, later = bucket_targets(group_bytes[group], threshold_bytes)
        if open_bytes[group] >= (first if opened[group] == 1 else later):
            del open_bucket[group]                   # full: the group's next tensor opens a bucket

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
