"""Check (g.5) of tools/gpu_check.py: the Keras codecs on a GPU, measured (issue 34).

On a GPU, TensorFlow runs a byte codec as its tensor-op composition (``TensorFlowOps.kernel_device``
names no kernels for GPU tensors: a ``numpy_function`` would copy them to the host): about ten
TensorFlow ops per pass, on TensorFlow's one compute stream, so their time is taken from the
training step. Nothing of this had run on a GPU. This check measures it, for the decision between
fused GPU kernels as TensorFlow ops and a stream of the pipeline's own:

* every codec's payload, decode and decode-sum on the GPU, bit for bit against the CPU reference;
* encode+decode time of a 64 MiB float32 bucket on the GPU, as a share of TensorFlow's copy
  bandwidth there (the time the compute stream loses per pass).

Where TensorFlow sees no GPU (the CPU run, or a machine without TensorFlow's GPU build), it
reports why and checks the same bits on the CPU, so the code cannot rot. An XLA-compiled
composition (``tf.function(jit_compile=True)``) was tried on the CPU first and is not a drop-in:
its block maximum does not carry a NaN (the non-finite block's scale came out finite) and 2,643
of 8,192 decoded values differed in their bits from the reference.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

CODECS = ("fp16", "bf16", "truncate16", "int8", "int4")


def _timed(fn: Callable[[], Any], sync: Callable[[Any], Any], repeats: int = 5) -> float:
    sync(fn())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def keras_codecs(report: Any) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        import numpy as np
        import tensorflow as tf
    except ImportError as exc:
        report.add("SKIP", "g.keras-codecs", f"TensorFlow is not importable ({exc})")
        return
    from pipesgd_hvd.compression import resolve_compression
    from pipesgd_hvd.ops.tensorflow import TensorFlowOps

    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:  # share the GPU with torch's allocator instead of taking all of its memory
        tf.config.experimental.set_memory_growth(gpu, True)
    where = "/GPU:0" if gpus else "/CPU:0"
    ops, reference = TensorFlowOps(), TensorFlowOps(fused=False)
    rng = np.random.default_rng(7)
    rows = (rng.standard_normal((8, 4096)) * np.logspace(-3, 2, 8)[:, None]).astype(np.float32)
    for name in CODECS:
        codec, ref = resolve_compression(name), resolve_compression(name)
        with tf.device(where):
            x = tf.constant(rows)
            payload, ctx = codec.encode(ops, x, key="k", seed=0)
            outs = [payload, codec.decode(ops, payload, ctx), codec.decode_sum(ops, payload, ctx, 0.125)]
        with tf.device("/CPU:0"):
            rp, rc = ref.encode(reference, tf.constant(rows), key="k", seed=0)
            refs = [rp, ref.decode(reference, rp, rc), ref.decode_sum(reference, rp, rc, 0.125)]
        equal = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                    for a, b in zip(outs, refs))
        report.check(equal, f"g.keras-codecs.bitwise.{name}",
                     f"payload, decode, decode-sum on {where} {'equal' if equal else 'DIFFER from'} the CPU reference")
    if not gpus:
        report.add("SKIP", "g.keras-codecs.speed", "TensorFlow sees no GPU here: the speed on a GPU is the next GPU "
                   "run's to measure (TensorFlow's GPU build on that machine)")
        return
    n = (64 << 20) // 4
    with tf.device(where):
        big = tf.random.normal((8, n // 8))
        copy_s = _timed(lambda: tf.identity(big) + 0.0, lambda t: t[0, 0].numpy())
        copy_gbs = 4 * n / copy_s / 1e9
        for name in CODECS:
            codec = resolve_compression(name)

            def encode_decode() -> Any:
                payload, ctx = codec.encode(ops, big, key="speed", seed=0)
                return codec.decode(ops, payload, ctx)

            seconds = _timed(encode_decode, lambda t: t[0, 0].numpy())
            gbs = 4 * n / seconds / 1e9
            report.add("INFO", f"g.keras-codecs.speed.{name}",
                       f"encode+decode {gbs:.1f} GB/s = {gbs / copy_gbs:.0%} of TensorFlow's copy ({copy_gbs:.0f} GB/s, "
                       f"64 MiB) on TensorFlow's compute stream, eager")
