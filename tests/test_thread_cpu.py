"""benchmarks/thread_cpu.py: another thread's CPU clock, read from this one, is that thread's own."""
from __future__ import annotations

import threading
import time

import pytest

from benchmarks.thread_cpu import ThreadGroupClock, native_thread_ids, thread_cpu_seconds


def test_a_group_clock_counts_its_threads_cpu_and_no_other():
    spun = threading.Event()
    done = threading.Event()
    ids = {}
    own = {}

    def spin() -> None:
        ids["spin"] = threading.get_native_id()
        start = time.thread_time()
        while time.thread_time() - start < 0.2:
            pass
        own["spin"] = time.thread_time()
        spun.set()
        done.wait(10)

    def sleep() -> None:
        ids["sleep"] = threading.get_native_id()
        done.wait(10)

    threads = [threading.Thread(target=spin), threading.Thread(target=sleep)]
    for t in threads:
        t.start()
    try:
        assert spun.wait(30)
        assert {ids["spin"], ids["sleep"]} <= native_thread_ids()
        # the spinner's clock read from here is what the spinner read on its own
        assert thread_cpu_seconds(ids["spin"]) == pytest.approx(own["spin"], abs=0.02)
        assert ThreadGroupClock([ids["sleep"]]).read() < 0.05
        both = ThreadGroupClock([ids["spin"], ids["sleep"]])
        assert both.read() >= 0.2
    finally:
        done.set()
        for t in threads:
            t.join()
    # join() returns before the kernel has reaped the thread: wait until it has left the process
    deadline = time.monotonic() + 10
    while {ids["spin"], ids["sleep"]} & native_thread_ids() and time.monotonic() < deadline:
        time.sleep(0.01)
    # ended threads keep their last reading: the sum does not go back
    assert both.read() >= 0.2
    with pytest.raises(OSError):
        thread_cpu_seconds(ids["spin"])
