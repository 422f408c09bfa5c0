"""Codec speed on one core: encode + decode of each byte codec, the fused kernels next to the unfused
tensor-op reference, each against a plain copy of the same tensor timed beside it (the memory
limit), in a process with glibc's default allocator settings and in one where freed memory stays
mapped. Writes the "codec_speed" section of docs/benchmarks.md (which says how to read it).

    OMP_NUM_THREADS=1 python -m benchmarks.codec_speed [--repeats 7] [--mib 16 64] [--no-write]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch

from benchmarks.thread_cpu import wait_for_quiet
from benchmarks.throughput_worker import timed
from pipesgd_hvd.compression import Cast, Codec, ErrorFeedback, Quantize, Truncate, kernels
from pipesgd_hvd.ops.torch import TorchOps

CODECS: Dict[str, Callable[[], Codec]] = {
    "fp16": lambda: Cast("float16"),
    "bf16": lambda: Cast("bfloat16"),
    "truncate16": lambda: Truncate(16),
    "int8+EF": lambda: ErrorFeedback(Quantize(8)),
    "int4+EF": lambda: ErrorFeedback(Quantize(4)),
}
PATHS = {"fused": TorchOps(), "reference": TorchOps(fused=False)}
# glibc maps every allocation above its mmap threshold (dynamic, 32 MiB at most) afresh and gives
# freed heap tops back to the OS: each new large tensor is then page-faulted again.
MALLOC_MODES = {
    "default malloc": {},
    "freed memory kept": {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 31)},
}
MARKER = "CODEC_SPEED_RESULT "
Results = Dict[int, Dict[Tuple[str, str], Dict[str, float]]]


def log(message: str) -> None:
    print(f"[codec_speed] {message}", file=sys.stderr, flush=True)


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
            samples[case]["copy"].append(timed(lambda: copy_dst.copy_(x)))
            samples[case]["encode"].append(timed(lambda: got.update(enc=codec.encode(ops, x, key="b", seed=rep))))
            payload, ctx = got["enc"]  # type: ignore[misc]
            samples[case]["decode"].append(timed(lambda: codec.decode(ops, payload, ctx)))
        clones["copy"].append(timed(lambda: copy_dst.copy_(x)))
        clones["clone"].append(timed(lambda: x.clone()))
        log(f"{numel * 4 / 2 ** 20:.0f} MiB: {rep + 1}/{repeats}")
    out = {case: {k: statistics.median(v) for k, v in s.items()} for case, s in samples.items()}
    out["clone", "-"] = {k: statistics.median(v) for k, v in clones.items()}
    return out


TF_PATHS = {"TensorFlow (tf.function)": True, "TensorFlow reference (tf.function)": False}  # label -> fused


def tensorflow_times(numel: int, repeats: int) -> Dict[Tuple[str, str], Dict[str, float]]:
    """The same codecs on TensorFlow, inside ``tf.function``: the kernels (``tf_kernels.py``, one
    ``tf.numpy_function`` per pass) and the tensor-op composition (``fused=False``), each next to a
    PyTorch copy of the same bytes."""
    import tensorflow as tf

    from pipesgd_hvd.ops.tensorflow import TensorFlowOps

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    x_torch = torch.randn(1, numel)
    copy_dst = torch.empty_like(x_torch)
    x = tf.constant(x_torch.numpy())
    out: Dict[Tuple[str, str], Dict[str, float]] = {}
    for name, make in CODECS.items():
        for label, fused in TF_PATHS.items():
            codec, ops, cols = make(), TensorFlowOps(fused=fused), numel
            encode = tf.function(lambda t: codec.encode(ops, t, key="b", seed=0)[0])
            decode = tf.function(lambda p: codec.decode(ops, p, cols))
            decode(encode(x))  # trace both (and create the residual variable)
            times: Dict[str, List[float]] = {"encode": [], "decode": [], "copy": []}
            for _ in range(repeats):
                # No .numpy(): it copies (a whole copy for decode's float32), and eager TensorFlow
                # returns a function's outputs computed, so the call alone is the codec's time.
                got: Dict[str, object] = {}
                times["copy"].append(timed(lambda: copy_dst.copy_(x_torch)))
                times["encode"].append(timed(lambda: got.update(p=encode(x))))
                payload = got["p"]
                times["decode"].append(timed(lambda: decode(payload)))
            out[name, label] = {k: statistics.median(v) for k, v in times.items()}
        log(f"TensorFlow {name}: done")
    return out


def codec_table(by_mode: Dict[str, Results]) -> str:
    """One row per codec and path; per size, encode+decode in plain copies under each allocator
    setting (encode + decode in brackets), and GB/s with freed memory kept."""
    from benchmarks.report import table

    modes = list(by_mode)
    sizes = sorted(by_mode[modes[0]])
    header = ["codec", "path"]
    for numel in sizes:
        header += [f"x copies, {mode}, {numel * 4 / 2 ** 20:.0f} MiB" for mode in modes]
        header.append(f"GB/s, {modes[-1]}, {numel * 4 / 2 ** 20:.0f} MiB")
    cases = list(dict.fromkeys(case for numel in sizes for case in by_mode[modes[0]][numel]))
    rows = []
    for name, path in cases:
        row = [name if path != "-" else "plain copy into a new tensor (`x.clone()`)", path]
        for numel in sizes:
            for mode in modes:
                t = by_mode[mode][numel].get((name, path))
                if t is None:
                    row.append("-")
                elif path == "-":
                    row.append(f"{t['clone'] / t['copy']:.2f}")
                else:
                    both = t["encode"] + t["decode"]
                    row.append(f"{both / t['copy']:.2f} ({t['encode'] / t['copy']:.2f} + {t['decode'] / t['copy']:.2f})")
            t = by_mode[modes[-1]][numel].get((name, path))
            row.append("-" if t is None else f"{numel * 4 / (t['clone'] if path == '-' else t['encode'] + t['decode']) / 1e9:.1f}")
        rows.append(row)
    return table(header, rows)


def run_worker(args: argparse.Namespace, extra_env: Dict[str, str]) -> Results:
    """The codec timings in a fresh process with ``extra_env`` (the allocator settings)."""
    cmd = [sys.executable, "-m", "benchmarks.codec_speed", "--worker", "--repeats", str(args.repeats),
           "--max-quiet-wait", str(args.max_quiet_wait), "--mib", *map(str, args.mib)]
    cmd += ["--tensorflow"] if args.tensorflow else []
    proc = subprocess.run(cmd, env=dict(os.environ, **extra_env), stdout=subprocess.PIPE, text=True, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith(MARKER))
    results: Results = {}
    for numel, name, path, times in json.loads(line[len(MARKER):]):
        results.setdefault(numel, {})[name, path] = times
    return results


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    results: Results = {}
    for mib in args.mib:
        quiet(args.max_quiet_wait)
        results[mib * 2 ** 18] = codec_times(mib * 2 ** 18, args.repeats)
    if args.tensorflow:
        quiet(args.max_quiet_wait)
        results[min(results)].update(tensorflow_times(min(results), args.repeats))
    print(MARKER + json.dumps([[n, *case, t] for n, cases in results.items() for case, t in cases.items()]), flush=True)


def quiet(max_wait: float) -> None:
    """Waits (up to ``max_wait`` s) for other jobs to leave a core idle, and says how it went."""
    waited, busy = wait_for_quiet(max_wait)
    log(f"waited {waited:.0f} s for other jobs; {busy:.1f} cores busy")


def main(argv: Optional[List[str]] = None) -> None:
    from benchmarks.report import machine_line, write_section

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--mib", type=int, nargs="+", default=[16, 64], help="tensor sizes in MiB")
    parser.add_argument("--max-quiet-wait", type=float, default=60.0,
                        help="seconds to wait for an idle core before each measurement")
    parser.add_argument("--tensorflow", action="store_true",
                        help="also TensorFlow inside tf.function (kernels and reference), smallest size only")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 7:
        parser.error("--repeats must be >= 7 (medians of fewer runs are too noisy on a shared machine)")
    if not kernels.available():
        raise SystemExit(kernels.UNAVAILABLE)
    if args.worker:
        worker(args)
        return
    torch.set_num_threads(1)
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    load_before = os.getloadavg()
    by_mode = {mode: run_worker(args, env) for mode, env in MALLOC_MODES.items()}
    text = (f"## Codec speed (`benchmarks/codec_speed.py`)\n\n{machine_line()}, one core (torch threads 1, "
            f"OMP_NUM_THREADS={threads}), PyTorch CPU tensors, load average {load_before[0]:.1f} before the run, "
            f"{os.getloadavg()[0]:.1f} after; medians of {args.repeats}.\n\n" + codec_table(by_mode))
    print(text)
    if not args.no_write:
        write_section("codec_speed", text)
        log("wrote the codec_speed section of docs/benchmarks.md")


if __name__ == "__main__":
    main()
