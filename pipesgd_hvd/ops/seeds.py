"""Seeds of stochastic rounding, the same on eager and traced steps.

Every tensor-op table draws its noise from a :class:`Seed`; the pipeline derives one per bucket,
rank, phase and step (``pipeline/schedule.py``), so a rank's noise is reproducible and ranks'
noises differ.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

Step = Any  # a Python int, or a traced integer tensor


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from a few ints/strings (stable across processes, unlike ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFFFFFFFFFF


@dataclass(frozen=True)
class Seed:
    """Seeds stochastic rounding: ``base`` (a Python int, fixed per pipeline, bucket, rank and
    phase) and ``step`` (an int, or a traced step counter, so a traced step draws fresh noise
    each time it runs). Each rank rounds its own data with its own noise, so the rank is part of
    ``base``; every rank decodes the same bytes, so replicas stay identical regardless."""

    base: int
    step: Step = 0

    def child(self, tag: str) -> "Seed":
        """A seed for one phase of a reduction (``"send"``, ``"reduced"``), the same step."""
        return Seed(derive_seed(self.base, tag), self.step)


def eager_seed(seed: Any) -> int:
    """A seed as one int, for the eager tables' generators: a :class:`Seed` with an int step, or
    a plain int (codec tests pass those)."""
    if isinstance(seed, Seed):
        return derive_seed(seed.base, int(seed.step))
    return int(seed) & 0x7FFFFFFFFFFFFFFF
