"""CPU time of chosen threads of this process, to the nanosecond (Linux).

Which threads burn a rank's CPU matters on these machines: Horovod's background loop wakes every
cycle whether or not an op is waiting (docs/transports.md), so a collective timed alone
is billed for it unless its threads are told apart. ``/proc/self/task/<tid>/stat`` ticks every
10 ms, as coarse as the collectives; Linux also gives every thread a CPU clock that
``clock_gettime`` reads from any thread of the same process: the id glibc's
``pthread_getcpuclockid`` builds from the thread's id, ``(~tid << 3) | 6`` (a per-thread
CPUCLOCK_SCHED clock).
"""
from __future__ import annotations

import os
import time
from typing import Dict, FrozenSet, Iterable


def native_thread_ids() -> FrozenSet[int]:
    """The kernel's ids of this process's live threads."""
    return frozenset(int(t) for t in os.listdir("/proc/self/task"))


def thread_cpu_seconds(tid: int) -> float:
    """CPU seconds the thread ``tid`` of this process has run (OSError once it has ended)."""
    return time.clock_gettime((~tid << 3) | 6)


class ThreadGroupClock:
    """CPU seconds of a fixed set of threads together. A thread that ends keeps its last reading,
    so the sum never goes back."""

    def __init__(self, tids: Iterable[int]) -> None:
        self._last: Dict[int, float] = {tid: 0.0 for tid in tids}
        if not self._last:
            raise ValueError("ThreadGroupClock needs at least one thread id")
        self.read()

    def read(self) -> float:
        for tid in self._last:
            try:
                self._last[tid] = thread_cpu_seconds(tid)
            except OSError:
                pass  # ended: its last reading stands
        return sum(self._last.values())
