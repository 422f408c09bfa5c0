"""The model-zoo kind of the emulated-cluster study (``python -m benchmarks.throughput --models``):
ResNet-50, BERT-base and GPT-2 small (``benchmarks/models.py``) at their real size, compute off the
cores at a published GPU step time, on 2 and 4 hosts, links shaped for comm/compute about 1x and 5x.

What is planned here: each launch's link rate and the memory the launches need. The rate comes
without calibration launches (a launch of BERT-base costs a minute): Horovod's ring all-reduce of
the model's gradient over the hosts should take ``aim`` x compute, compute being the device step
plus the update the host runs (timed here, once per model), the link reaching ``EFFICIENCY`` of its
rate after a fixed cost. The fixed cost is guessed (``FIXED_GUESS``) for a model's first launch, its
largest aim (where the guess matters least), and taken from that launch's measurement for its
smaller aims. Each launch reports the comm/compute it measured (within 20% of the aim: met).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .throughput_plan import MAX_RATE, rate_bps, tc_rate, wire_bits

#: The configurations of every model-zoo launch: Horovod against width 2 with none, int8 and int4
#: (error feedback with both) and the accurate mode with int8.
CONFIGS = ("horovod", "w2", "w2-int8", "w2-int4", "w2-split-int8")
AIMS = (1.0, 5.0)
HOSTS = (2, 4)
#: Share of a shaped link's rate a float32 all-reduce reaches (952 Mbit/s at 1gbit: shared/CLUSTER.md;
#: the throughput study's calibration found 97%).
EFFICIENCY = 0.97
#: Seconds a float32 all-reduce takes beyond its wire time on these links, guessed for a model's first
#: launch (the throughput study's calibration found 22 ms for 16.8 MB on 2 hosts).
FIXED_GUESS = 0.03
#: Bytes of memory a rank of a model-zoo launch holds at most, in gradients: what the launches are
#: checked against. Measured, not summed from the parts: a bert-base rank of a 4-host launch reached
#: 5.9 GB resident (13.5 gradients; its ranks keep freed memory mapped, KEEP_FREED) when the kernel
#: killed it for memory on this 24 GB machine (2026-12-08); 8, the parts' sum, had let it start.
RANK_MEMORY_GRADIENTS = 14.0
#: Malloc settings of a model-zoo rank: freed memory stays mapped, as a GPU's caching allocator keeps
#: it, so that a step's new gradient tensors are not page-faulted afresh each time (on a GPU they are not).
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**31)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a model's launches are planned from: its gradient, its device step and the host's update."""

    model: str
    grad_bytes: int
    device_s: float
    update_s: float

    @property
    def compute_s(self) -> float:
        """What a launch's compute alone should measure: the device step and the host's update."""
        return self.device_s + self.update_s


def host_update_seconds(name: str, repeats: int = 3) -> Tuple[int, float]:
    """(gradient bytes, seconds of one SGD update on this host) for model ``name``: the median of
    ``repeats`` after one, one thread, as a rank runs it."""
    import torch

    from . import models

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = models.build(name)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        opt.step()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        return models.gradient_bytes(model), statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def rate_for(plan: Plan, hosts: int, aim: float, fixed_s: float) -> str:
    """The tc rate at which the ring all-reduce of ``plan``'s gradient over ``hosts`` takes ``aim`` x
    its compute: ``fixed + wire / (EFFICIENCY R) = aim x compute``; ``MAX_RATE`` (the launch then
    reports how far it landed from its aim) where the fixed cost alone takes that long (4 ranks on
    2 cores: the reduction's CPU is most of it)."""
    if not aim > 0:
        raise ValueError(f"an aim must be > 0, got {aim}")
    room = aim * plan.compute_s - fixed_s
    bps = MAX_RATE if room <= 0 else min(MAX_RATE, wire_bits(hosts, plan.grad_bytes) / (EFFICIENCY * room))
    return tc_rate(bps)


def measured_fixed(hosts: int, grad_bytes: int, rate: str, comm_s: float) -> float:
    """A launch's fixed cost: its float32 all-reduce beyond the wire time at ``EFFICIENCY`` (>= 0)."""
    return max(0.0, comm_s - wire_bits(hosts, grad_bytes) / (EFFICIENCY * rate_bps(rate)))


def order(aims: Sequence[float]) -> List[float]:
    """A model's aims in the order they run: the largest first (its rate least sensitive to the guess)."""
    return sorted(set(aims), reverse=True)


def rank_memory(grad_bytes: int) -> float:
    return RANK_MEMORY_GRADIENTS * grad_bytes


def memory_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(model: str, grad_bytes: int, ranks: int, available: Optional[int]) -> None:
    """Refuses a launch whose ranks would not fit in the memory available now, naming the fix."""
    need = ranks * rank_memory(grad_bytes)
    if available is not None and need > available:
        raise RuntimeError(f"{model} on {ranks} hosts needs about {need / 2**30:.1f} GiB ({ranks} ranks x "
                           f"{RANK_MEMORY_GRADIENTS:g} x {grad_bytes / 1e6:.0f} MB of gradient), {available / 2**30:.1f} GiB "
                           "are available: wait for other jobs to end, or leave it out (--hosts 2, or fewer --models)")


def describe(plan: Plan) -> str:
    return f"{plan.model}: device step {plan.device_s * 1e3:.0f} ms + host update {plan.update_s * 1e3:.0f} ms"


def worker_settings(model: str) -> Dict[str, Any]:
    """What a model-zoo launch's worker is given beyond the study's settings: the model and its
    device times (forward, backward)."""
    from . import models

    return {"model": model, "device_times": list(models.zoo(model).device_step.forward_backward),
            "offload_compute": True}


__all__ = ["AIMS", "CONFIGS", "HOSTS", "Plan", "check_memory", "describe", "host_update_seconds", "measured_fixed",
           "memory_available", "order", "rate_for", "worker_settings"]
