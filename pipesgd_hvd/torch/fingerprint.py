"""Replica fingerprints computed where the weights live: one small host copy per check.

The replica check (``check_replicas_every``) compares every parameter's bits across ranks. Copying
every weight to the host for that stalls a GPU and moves the whole model over PCIe; instead each
tensor is reduced on its own device to one 64-bit number, and the numbers of all tensors come to
the host in one copy per device.

The fingerprint of a tensor whose elements have raw bits ``v_i`` (as unsigned integers) is
``sum_i v_i * m_i mod 2**64`` with odd multipliers ``m_i`` that depend on the position. Integer
sums are exact and associative modulo ``2**64``, so the result does not depend on the order a
device adds in: equal bits give equal fingerprints on every rank. A single differing element
always changes it (``d * m`` with ``0 < |d| < 2**32`` and ``m`` odd is not a multiple of
``2**64``); several differing elements cancel with probability about ``2**-64``.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

# A 64-bit LCG multiplier and increment (Knuth's MMIX), both below 2**63 so that they are int64.
_MULT = 6364136223846793005
_ADD = 1442695040888963407
_CHUNK = 1 << 22  # elements per pass: bounds the temporaries at ~100 MB whatever the tensor's size
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw_bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s elements as integers of the same width (bit patterns, no conversion), flat."""
    flat = x.detach().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.contiguous().view(_INT_VIEW[flat.element_size()])


def fingerprint(x: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 tensor on ``x``'s device: the fingerprint of the module docstring. No host sync."""
    bits = _raw_bits(x)
    mask = (1 << (8 * bits.element_size())) - 1  # sign-extended narrow ints back to unsigned
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start:start + _CHUNK].to(torch.int64)
        if bits.dtype != torch.int64:
            part = part & mask
        where = torch.arange(start, start + part.numel(), dtype=torch.int64, device=x.device)
        # int64 arithmetic wraps modulo 2**64 on CPU and CUDA alike
        total += (part * ((where * _MULT + _ADD) | 1)).sum()
    return total


def host_fingerprints(named: Sequence[Tuple[str, torch.Tensor]]) -> List[Tuple[str, np.ndarray]]:
    """(name, 8-byte host array) per tensor: fingerprints computed on each tensor's device, brought
    to the host in one copy per device."""
    by_device: Dict[torch.device, List[int]] = {}
    prints = [fingerprint(p) for _, p in named]
    for i, (_, p) in enumerate(named):
        by_device.setdefault(p.device, []).append(i)
    host: Dict[int, np.ndarray] = {}
    for indices in by_device.values():
        values = torch.stack([prints[i] for i in indices]).cpu().numpy()
        host.update({i: values[j:j + 1] for j, i in enumerate(indices)})
    return [(name, host[i]) for i, (name, _) in enumerate(named)]
