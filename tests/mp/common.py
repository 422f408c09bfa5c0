"""Helpers shared by the multi-process scripts (run under horovodrun)."""
from __future__ import annotations

import hashlib
from typing import Iterable

import horovod.torch as hvd
import torch


def weights_digest(params: Iterable[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def assert_replicas_identical(params: Iterable[torch.Tensor], what: str) -> None:
    """Every rank's weights hash the same (gathered from every rank)."""
    digests = hvd.allgather_object(weights_digest(params), name=f"digest.{what}")
    assert len(set(digests)) == 1, f"{what}: replicas differ across ranks: {digests}"


def passed(name: str) -> None:
    print(f"PASS rank{hvd.rank()} {name}", flush=True)
