"""CPU clocks of this process's threads and of the machine (Linux), for the benchmarks.

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
import resource
import threading
import time
from typing import Dict, FrozenSet, Iterable, Tuple


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


class ThreadClock:
    """CPU seconds of this process's main thread and of all its other threads (Horovod's
    background thread, Gloo's, the pipeline's comm thread): where a step's CPU goes. The main
    thread's from ``time.thread_time()``, the whole process's from ``getrusage`` (threads that
    ended included), both to the microsecond: /proc's per-thread counters tick every 10 ms, as
    coarse as the collectives timed here. Read it from the main thread only."""

    def read(self) -> Tuple[float, float]:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("ThreadClock.read() runs on the main thread: it reads that thread's own clock")
        usage = resource.getrusage(resource.RUSAGE_SELF)
        main = time.thread_time()
        return main, usage.ru_utime + usage.ru_stime - main


def machine_busy() -> Tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far (/proc/stat): with our own CPU time
    it tells how much of the two cores other jobs took during the run."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = v[3] + v[4]
    return (sum(v) - idle) / tick, sum(v) / tick


def wait_for_quiet(max_wait: float, idle_cores: float = 1.5, window: float = 2.0) -> Tuple[float, float]:
    """Waits (at most ``max_wait`` s) until other jobs leave ``idle_cores`` idle over ``window`` s, so
    that a launch does not start amid someone's test run (it only lowers the odds); returns (seconds
    waited, busy cores in the last window)."""
    start = time.monotonic()
    while True:
        busy0, total0 = machine_busy()
        time.sleep(window)
        busy1, total1 = machine_busy()
        cores = os.cpu_count() or 1
        busy = (busy1 - busy0) / max(total1 - total0, 1e-9) * cores
        if cores - busy >= idle_cores or time.monotonic() - start >= max_wait:
            return time.monotonic() - start, busy
