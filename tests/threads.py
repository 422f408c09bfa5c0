"""Runs N in-process ranks as threads (for engine unit tests): over pipesgd_hvd's LocalWorld, or
any per-rank function."""
from __future__ import annotations

import threading
from typing import Any, Callable, List

from pipesgd_hvd.testing import LocalCommunicator, LocalWorld


def run_rank_threads(size: int, fn: Callable[[int], Any], timeout: float = 60) -> List[Any]:
    """``fn(rank)`` on ``size`` threads at once; returns the results in rank order, re-raises the
    first error, and fails where a rank is still running after ``timeout`` s (a collective hangs)."""
    results: List[Any] = [None] * size
    errors: List[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread below
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"ranks still running after {timeout} s (a collective hangs)")
    return results


def run_threads(world: LocalWorld, fn: Callable[[int, LocalCommunicator], Any], timeout: float = 60) -> List[Any]:
    """``fn(rank, comm)`` on every rank of ``world``: :func:`run_rank_threads`."""
    return run_rank_threads(world.size, lambda rank: fn(rank, world.communicator(rank)), timeout)
