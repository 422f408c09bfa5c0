"""Codec speed on one core: encode+decode of each byte codec, the fused kernels next to the unfused
tensor-op reference, each against a plain copy of the same tensor timed right beside it (the
memory limit); then where a rank's CPU goes in one compressed all-reduce. Writes the
"codec_speed" section of docs/benchmarks.md.

    OMP_NUM_THREADS=1 python -m benchmarks.codec_speed [--repeats 7] [--mib 16 64] [--no-write]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from benchmarks.allreduce_cpu import profile
from benchmarks.throughput import wait_for_quiet
from pipesgd_hvd.compression import Cast, Codec, ErrorFeedback, Quantize, Truncate, kernels
from pipesgd_hvd.frameworks.torch_ops import TorchOps

CODECS: Dict[str, Callable[[], Codec]] = {
    "fp16": lambda: Cast("float16"),
    "bf16": lambda: Cast("bfloat16"),
    "truncate16": lambda: Truncate(16),
    "int8+EF": lambda: ErrorFeedback(Quantize(8)),
    "int4+EF": lambda: ErrorFeedback(Quantize(4)),
}
PATHS = {"fused": TorchOps(), "reference": TorchOps(fused=False)}
ALLREDUCE_CODECS = {"int8": "int8+EF", "int4": "int4+EF", "fp16": "fp16"}  # resolve_compression names


def log(message: str) -> None:
    print(f"[codec_speed] {message}", file=sys.stderr, flush=True)


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def codec_times(numel: int, repeats: int) -> Dict[Tuple[str, str], Dict[str, float]]:
    """(codec, path) -> median seconds of encode, decode, and of the plain copy timed beside them;
    (``clone``, ``-``) -> a copy into a new tensor (what allocating an output costs on top)."""
    x = torch.randn(1, numel)
    copy_dst = torch.empty_like(x)
    clones: Dict[str, List[float]] = {"clone": [], "copy": []}
    cases = {(name, path): (make(), PATHS[path]) for name, make in CODECS.items() for path in PATHS}
    samples: Dict[Tuple[str, str], Dict[str, List[float]]] = {
        case: {"encode": [], "decode": [], "copy": []} for case in cases}
    for codec, ops in cases.values():  # warm-up: error feedback holds a residual from here on
        payload, ctx = codec.encode(ops, x, key="b", seed=0)
        codec.decode(ops, payload, ctx)
    for rep in range(repeats):  # interleaved: drift on the machine hits every case alike
        for case, (codec, ops) in cases.items():
            got: Dict[str, object] = {}
            samples[case]["copy"].append(seconds(lambda: copy_dst.copy_(x)))
            samples[case]["encode"].append(seconds(lambda: got.update(enc=codec.encode(ops, x, key="b", seed=rep))))
            payload, ctx = got["enc"]  # type: ignore[misc]
            samples[case]["decode"].append(seconds(lambda: codec.decode(ops, payload, ctx)))
        clones["copy"].append(seconds(lambda: copy_dst.copy_(x)))
        clones["clone"].append(seconds(lambda: x.clone()))
        log(f"{numel * 4 / 2 ** 20:.0f} MiB: {rep + 1}/{repeats}")
    out = {case: {k: statistics.median(v) for k, v in s.items()} for case, s in samples.items()}
    out["clone", "-"] = {k: statistics.median(v) for k, v in clones.items()}
    return out


def codec_table(results: Dict[int, Dict[Tuple[str, str], Dict[str, float]]]) -> str:
    sizes = sorted(results)
    header = ["codec", "path"] + [f"{label} at {numel * 4 / 2 ** 20:.0f} MiB" for numel in sizes
                                  for label in ("encode+decode x copies", "GB/s")]
    rows = []
    for name in CODECS:
        for path in PATHS:
            row = [name, path]
            for numel in sizes:
                t = results[numel][name, path]
                both = t["encode"] + t["decode"]
                row += [f"{both / t['copy']:.2f} ({t['encode'] / t['copy']:.2f} + {t['decode'] / t['copy']:.2f})",
                        f"{numel * 4 / both / 1e9:.1f}"]
            rows.append(row)
    row = ["plain copy into a new tensor (`x.clone()`)", "-"]
    for numel in sizes:
        t = results[numel]["clone", "-"]
        row += [f"{t['clone'] / t['copy']:.2f}", f"{numel * 4 / t['clone'] / 1e9:.1f}"]
    from benchmarks.report import table

    return table(header, rows + [row])


def allreduce_rows(numel: int, ranks: List[int], repeats: int, max_wait: float) -> List[List[str]]:
    rows = []
    for name, label in ALLREDUCE_CODECS.items():
        for size in ranks:
            for path in PATHS:
                quiet(max_wait)
                spent = profile(name, size, numel, repeats, fused=path == "fused", progress=log)
                copy = spent["copy"]
                codec = sum(v for k, v in spent.items() if k.startswith("codec."))
                table_ops = sum(v for k, v in spent.items() if k.startswith("ops."))
                rows.append([label, str(size), path, f"{spent['total'] * 1e3:.1f}", f"{spent['total'] / copy:.1f}",
                             f"{codec * 1e3:.1f}", f"{spent.get('collectives', 0.0) * 1e3:.1f}",
                             f"{table_ops * 1e3:.1f}", f"{spent['rest'] * 1e3:.1f}",
                             f"{spent['total'] / codec:.2f}"])
    return rows


def quiet(max_wait: float) -> None:
    """Waits (up to ``max_wait`` s) for other jobs to leave a core idle, and says how it went."""
    waited, busy = wait_for_quiet(max_wait)
    log(f"waited {waited:.0f} s for other jobs; {busy:.1f} cores busy")


def main(argv: Optional[List[str]] = None) -> None:
    from benchmarks.report import machine_line, table, write_section

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mib", type=int, nargs="+", default=[16, 64], help="tensor sizes in MiB")
    parser.add_argument("--allreduce-mb", type=float, default=16.8, help="bucket of the all-reduce profile (MB)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-quiet-wait", type=float, default=60.0,
                        help="seconds to wait for an idle core before each measurement")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)
    if args.repeats < 7:
        parser.error("--repeats must be >= 7 (medians of fewer runs are too noisy on a shared machine)")
    if not kernels.available():
        raise SystemExit(kernels.UNAVAILABLE)
    torch.set_num_threads(1)
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    load_before = os.getloadavg()
    results = {}
    for mib in args.mib:
        quiet(args.max_quiet_wait)
        results[mib * 2 ** 18] = codec_times(mib * 2 ** 18, args.repeats)
    numel = int(args.allreduce_mb * 1e6) // 4
    breakdown = allreduce_rows(numel, args.ranks, args.repeats, args.max_quiet_wait)
    load = f"load average {load_before[0]:.1f} before the run, {os.getloadavg()[0]:.1f} after"
    text = (
        f"## Codec speed (`benchmarks/codec_speed.py`)\n\n{machine_line()}, one core (torch threads 1, "
        f"OMP_NUM_THREADS={threads}), PyTorch CPU tensors, {load}; medians of {args.repeats}. Each encode and "
        "decode is timed right after a plain copy of the same float32 tensor into an existing one "
        "(`dst.copy_(x)`, the memory limit); \"x copies\" is the ratio of the medians, encode + decode. "
        "`fused` runs the kernels of `pipesgd_hvd/compression/_kernels.c`, `reference` the unfused "
        "tensor-op composition (a table built with `fused=False`); both give the same bytes "
        "(tests/test_codec_kernels.py). `+EF`: with error feedback, after a first step (a residual "
        "is held). GB/s: float32 bytes in, over encode + decode. The last row is the price of a new "
        "output: above glibc's mmap threshold (32 MiB at most) every new tensor is mapped afresh and "
        "page-faulted, which the decodes pay too (they return new tensors).\n\n"
        + codec_table(results)
        + f"\n\n### CPU of one compressed all-reduce\n\n`benchmarks/allreduce_cpu.py`: `compressed_allreduce` "
        f"of a {numel * 4 / 1e6:.1f} MB float32 bucket ({numel} values, so rows are padded) on the "
        "in-process LocalWorld, ranks as threads; CPU time of rank 0 (its thread's clock, so waiting "
        "for the peer is free), median of the same runs, in ms. `codec`: encode (with error feedback), "
        "decode+sum, re-encode, decode. `collectives`: LocalWorld's alltoall and allgather (their "
        "concatenations). `table ops`: the table calls `compressed_allreduce` makes itself (the "
        "padding `concat`). `rest`: everything else in the call (slices, the scale multiply where the "
        "codec does not fuse it). \"x copies\": the total over a plain copy of the bucket.\n\n"
        + table(["codec", "ranks", "path", "total", "x copies", "codec", "collectives", "table ops", "rest",
                 "total / codec"], breakdown))
    print(text)
    if not args.no_write:
        write_section("codec_speed", text)
        log("wrote the codec_speed section of docs/benchmarks.md")


if __name__ == "__main__":
    main()
