"""Where a rank's CPU goes in one compressed all-reduce: the codec, the collectives, and the rest
(padding, casts, slices, arithmetic in ``compressed_allreduce`` itself).

Ranks are threads of the in-process LocalWorld; each phase is timed with the thread's own CPU
clock (``time.thread_time``), so a rank waiting for its peer costs nothing here. Time is charged to
the outermost phase: the table operations a codec runs count as codec work, and the ones
``compressed_allreduce`` runs itself are listed by name.

    python -m benchmarks.allreduce_cpu [--ranks 1 2] [--mb 16.8] [--repeats 7]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from pipesgd_hvd.comm.local import LocalWorld
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.compression.allreduce import compressed_allreduce, padded_numel
from pipesgd_hvd.ops.torch import TorchOps

CODEC_METHODS = ("encode", "encode_ef", "decode", "decode_sum")


class PhaseClock:
    """Per-thread CPU seconds by phase; a phase entered inside another one is not split out."""

    def __init__(self) -> None:
        self._local = threading.local()

    def totals(self) -> Dict[str, float]:
        return self._local.__dict__.setdefault("totals", defaultdict(float))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if getattr(self._local, "inside", False):
            yield
            return
        self._local.inside = True
        start = time.thread_time()
        try:
            yield
        finally:
            self.totals()[name] += time.thread_time() - start
            self._local.inside = False

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)
        return call


class _Timed:
    """Forwards every attribute of ``inner``; the methods named in ``phases`` run inside a phase."""

    def __init__(self, inner: Any, clock: PhaseClock, phases: Callable[[str], Optional[str]]) -> None:
        self._inner, self._clock, self._phases = inner, clock, phases

    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._inner, attr)
        phase = self._phases(attr) if callable(value) else None
        return self._clock.timed(phase, value) if phase else value


class _TimedHandle:
    def __init__(self, handle: Any, clock: PhaseClock) -> None:
        self._handle, self._clock = handle, clock

    def wait(self) -> Any:
        with self._clock.phase("collectives"):
            return self._handle.wait()


class _TimedComm(_Timed):
    def __getattr__(self, attr: str) -> Any:
        value = getattr(self._inner, attr)
        if attr.endswith("_async"):
            return lambda *a, **k: _TimedHandle(self._clock.timed("collectives", value)(*a, **k), self._clock)
        return value


def path_label(fused: bool, room: bool) -> str:
    return ("fused" if fused else "reference") + (", engine's buffer" if room else "")


def profile(codec_name: str, ranks: int, numel: int, repeats: int, fused: bool, room: bool = False,
            progress: Callable[[str], None] = lambda _: None) -> Dict[str, float]:
    """Median CPU seconds per phase of rank 0 over ``repeats`` all-reduces (after one warm-up),
    plus ``total`` (the whole call), ``rest`` (total minus every named phase) and ``copy`` (a
    plain copy of the bucket, timed by rank 0 right before each all-reduce; not in the total).
    ``room``: each rank's bucket sits in a buffer of ``padded_numel`` values, zero past it, as the
    engine holds it; else it is bare and the all-reduce copies it into a padded one."""
    ops = TorchOps(fused=fused)
    clock = PhaseClock()
    world = LocalWorld(ranks, ops, timeout=600)
    timed_ops = _Timed(ops, clock, lambda attr: f"ops.{attr}")
    codecs = [_Timed(resolve_compression(codec_name), clock,
                     lambda attr: f"codec.{attr}" if attr in CODEC_METHODS else None) for _ in range(ranks)]
    length = padded_numel(resolve_compression(codec_name), numel, ranks) if room else numel
    inputs = [torch.cat([torch.randn(numel), torch.zeros(length - numel)]) for _ in range(ranks)]
    copy_dst = torch.empty(numel)
    samples: List[Dict[str, float]] = []

    def rank_main(rank: int) -> None:
        comm = _TimedComm(world.communicator(rank), clock, lambda _: None)
        for step in range(repeats + 1):
            start = time.thread_time()
            if rank == 0:
                copy_dst.copy_(inputs[0][:numel])
            copied = time.thread_time() - start
            clock.totals().clear()
            start = time.thread_time()
            compressed_allreduce(timed_ops, comm, codecs[rank], inputs[rank], name=f"s{step}", key="b0", seed=step,
                                 numel=numel)
            spent = dict(clock.totals(), total=time.thread_time() - start)
            if rank == 0 and step > 0:
                samples.append(dict(spent, copy=copied))
                progress(f"{codec_name} {path_label(fused, room)} {ranks} rank(s): {step}/{repeats}")

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(samples) != repeats:
        raise RuntimeError("a rank failed; see the traceback above")
    names = sorted({k for s in samples for k in s})
    out = {k: statistics.median(s.get(k, 0.0) for s in samples) for k in names}
    out["rest"] = max(0.0, out["total"] - sum(v for k, v in out.items() if k not in ("total", "copy")))
    return out


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--codecs", nargs="+", default=["int8", "int4", "fp16"])
    parser.add_argument("--mb", type=float, default=16.8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    numel = int(args.mb * 1e6) // 4
    for name in args.codecs:
        for ranks in args.ranks:
            for fused, room in ((False, False), (True, False), (True, True)):
                result = profile(name, ranks, numel, args.repeats, fused, room)
                parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(result.items(), key=lambda kv: -kv[1]))
                print(f"{name} {ranks} rank(s) {path_label(fused, room)} (ms CPU): {parts}", flush=True)


if __name__ == "__main__":
    main()
