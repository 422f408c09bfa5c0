"""The pipeline inside a traced TensorFlow step: pending gradients live in variables.

PyTorch's adapter drives :class:`~pipesgd_hvd.engine.PipelineEngine` from Python, step by step.
A Keras ``train_step`` is one ``tf.function``: Python runs once, at trace time, so the pipeline's
state must be variables and its control flow graph ops. Same update rule, same codecs, same
compressed all-reduce (written once, against ``TensorOps``); only the bookkeeping differs.

Per step s, with width K and warm-up W (staleness K-1)::

    stale   = reduce(slot[(s - W) % (K-1)])   if s >= W + K - 1   # step s-K+1's gradient
    current = reduce(flatten(grads))          if s <  W           # warm-up: synchronous
    slot[(s - W) % (K-1)] = flatten(grads)    if s >= W
    apply stale (or current); nothing while the pipeline fills (W <= s < W + K - 1)

Why the reduction of ``stale`` overlaps this step's forward and backward pass: its inputs are a
slot variable and the step counter, nothing this step computes, so TensorFlow's executor may start
it as soon as the step starts. Automatic control dependencies (ACD) in ``tf.function`` order only
ops that touch the same resource (plus ops with unknown side effects, chained in program order);
the forward and backward pass touch the model's variables, the reduction touches our slot and
codec variables, so ACD adds no edge between them. Horovod's ops are asynchronous kernels: they
enqueue the tensor with Horovod's background thread and free the executor thread. The write of
this step's gradient into the slot comes after the read in program order, and ACD orders the two
(same resource). ``tests/test_keras_multiprocess.py`` measures the overlap (step time against
compute and communication alone).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import tensorflow as tf

from ..comm.base import Communicator
from ..compression.allreduce import allreduce_wire_bytes, compressed_allreduce, derive_seed
from ..compression.codecs import Codec
from ..consistency import check_ranks_agree, settings_entries
from ..engine import PipelineConfig
from ..fusion import Bucket, TensorSpec, plan_buckets
from .tf_ops import TensorFlowOps, tf_dtype


# Name scopes of the two reductions in a traced step (tests check the stale one's inputs).
STALE_SCOPE, SYNC_SCOPE = "pipesgd_stale_reduction", "pipesgd_sync_reduction"


def reduce_bucket(ops: TensorFlowOps, comm: Communicator, codec: Codec, config: PipelineConfig,
                  flat: tf.Tensor, *, name: str, key: str, seed: int) -> Tuple[tf.Tensor, int]:
    """One bucket's average across ranks (blocking: a graph op). Returns it and the bytes sent."""
    prescale, postscale = config.scale_factors()
    if codec.summable:
        payload, ctx = codec.encode(ops, flat, key=key, seed=seed)
        reduced = comm.allreduce_async_(payload, name, config.op, prescale, postscale).wait()
        sent = allreduce_wire_bytes(ops.numel(payload), ops.dtype_name(payload), comm.size)
        return codec.decode(ops, reduced, ctx), sent
    return compressed_allreduce(ops, comm, codec, flat, name=name, key=key, seed=seed, op=config.op,
                                prescale=prescale, postscale=postscale)


class GraphPipeline(tf.Module):
    """Width-K pipeline whose state is TensorFlow variables (saved by ``tf.train.Checkpoint``)."""

    def __init__(self, specs: Sequence[TensorSpec], *, comm: Communicator, codec: Codec,
                 config: PipelineConfig) -> None:
        super().__init__(name="pipesgd")
        self.specs = list(specs)
        self.comm, self.codec, self.config = comm, codec, config
        self.ops = TensorFlowOps()
        # Gradients arrive all at once in TensorFlow; reverse order still puts the output layer,
        # whose gradient the backward pass finishes first, in the first bucket.
        self.layout = plan_buckets(self.specs, list(range(len(self.specs)))[::-1], config.fusion_threshold_bytes)
        with tf.init_scope():  # eager even when Keras builds the optimizer inside a trace
            check_ranks_agree(comm, {  # the same entries as PipelineEngine's (PyTorch) check
                "settings": settings_entries(config, codec.name) + [
                    ("check_replicas_every", config.check_replicas_every)],
                "tensors": [(s.name, tuple(s.shape), s.dtype) for s in self.specs]})
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            # First pipelined step since warm-up or the last flush: the pipeline fills from here.
            self.start = tf.Variable(config.warmup_steps, dtype=tf.int64, trainable=False, name="start")
            self.ops.step = self.step
            slots = max(config.width - 1, 1)
            self.slots = [tf.Variable(tf.zeros((slots, b.numel), tf_dtype(b.dtype)), trainable=False,
                                      name=f"pending_b{b.index}") for b in self.layout.buckets]
            self.bytes_sent = tf.Variable(0, dtype=tf.int64, trainable=False, name="bytes_sent")
            self.fp32_bytes = tf.Variable(0, dtype=tf.int64, trainable=False, name="fp32_bytes")
            self.codec_state = self._prime_codec()

    # ------------------------------------------------------------------------------ tracing
    def exchange(self, grads: Sequence[Optional[tf.Tensor]]) -> Tuple[List[Optional[tf.Tensor]], tf.Tensor]:
        """This step's local gradients in, the averaged gradients to apply out (None where the
        local gradient was None), and whether to apply them at all (False while filling)."""
        width, warmup = self.config.width, self.config.warmup_steps
        step = self.step.read_value()
        flats = [self._flatten(bucket, grads) for bucket in self.layout.buckets]
        if width == 1:
            reduced = self._reduce_all(flats, "sync")
            apply = tf.constant(True)
        else:
            zeros = [tf.zeros_like(f) for f in flats]
            start = self.start.read_value()
            slot = tf.math.floormod(step - start, width - 1)
            has_stale = step >= start + width - 1
            # No input computed by this step: free to run beside the forward/backward pass.
            with tf.name_scope(STALE_SCOPE):
                stale = tf.cond(has_stale, lambda: self._reduce_all([tf.gather(v, slot) for v in self.slots],
                                                                    "stale"), lambda: zeros)
            in_warmup = step < warmup
            if warmup > 0:
                with tf.name_scope(SYNC_SCOPE):
                    current = tf.cond(in_warmup, lambda: self._reduce_all(flats, "sync"), lambda: zeros)
                reduced = [tf.where(in_warmup, c, s) for c, s in zip(current, stale)]
            else:
                reduced = stale
            with tf.control_dependencies(reduced):  # the slot is read before it is overwritten
                for v, f in zip(self.slots, flats):
                    tf.cond(in_warmup, tf.no_op, lambda v=v, f=f: v.scatter_update(
                        tf.IndexedSlices(f[None], tf.reshape(slot, (1,)))).op)
            apply = tf.logical_or(in_warmup, has_stale)
        self._count(apply)
        with tf.control_dependencies(reduced):
            self.step.assign_add(1)
        return self._unflatten(reduced, grads), apply

    def flush(self) -> List[List[tf.Tensor]]:
        """Eagerly: reduces the gradients still in the pipeline and returns them, oldest first (a
        collective: every rank calls it at the same step). The next step fills the pipeline anew."""
        width, warmup = self.config.width, self.config.warmup_steps
        step, start = int(self.step.numpy()), int(self.start.numpy())
        out = []
        for age in range(min(step - start, width - 1), 0, -1):  # oldest first
            slot = (step - age - start) % (width - 1)
            reduced = self._reduce_all([v[slot] for v in self.slots], "flush")
            self._count(tf.constant(True))
            out.append(self._unflatten(reduced, [tf.zeros(s.shape) for s in self.specs]))
        self.start.assign(max(step, warmup))
        return out

    # ------------------------------------------------------------------------------ helpers
    def _flatten(self, bucket: Bucket, grads: Sequence[Optional[tf.Tensor]]) -> tf.Tensor:
        dtype = tf_dtype(bucket.dtype)
        parts = []
        for m in bucket.members:
            g = grads[m.index]
            parts.append(tf.zeros((m.numel,), dtype) if g is None else tf.reshape(tf.cast(g, dtype), (-1,)))
        return tf.concat(parts, 0) if len(parts) > 1 else parts[0]

    def _unflatten(self, flats: Sequence[tf.Tensor], like: Sequence[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
        out: List[Optional[tf.Tensor]] = [None] * len(self.specs)
        for bucket, flat in zip(self.layout.buckets, flats):
            for m in bucket.members:
                if like[m.index] is not None:
                    out[m.index] = tf.reshape(flat[m.offset:m.offset + m.numel], m.shape)
        return out

    def _reduce_all(self, flats: Sequence[tf.Tensor], tag: str) -> List[tf.Tensor]:
        out, sent = [], 0
        for bucket, flat in zip(self.layout.buckets, flats):
            reduced, bucket_sent = reduce_bucket(
                self.ops, self.comm, self.codec, self.config, flat,
                name=f"{self.config.name}.{self.layout.key}.b{bucket.index}.{tag}",
                key=f"{self.layout.key}.b{bucket.index}",
                seed=derive_seed(self.config.seed, bucket.index, self.comm.rank))
            out.append(reduced)
            sent += bucket_sent
        self._sent = sent  # a Python int known at trace time; the same for every reduction
        return out

    def _count(self, happened: tf.Tensor) -> None:
        """Adds one reduction's bytes to the counters when ``happened`` (a traced bool)."""
        fp32 = sum(allreduce_wire_bytes(b.numel, "float32", self.comm.size) for b in self.layout.buckets)
        self.bytes_sent.assign_add(tf.where(happened, tf.constant(self._sent, tf.int64), 0))
        self.fp32_bytes.assign_add(tf.where(happened, tf.constant(fp32, tf.int64), 0))

    def _prime_codec(self) -> List[tf.Variable]:
        """Creates the codec's state variables (error-feedback residuals) now, by reducing zeros
        once (all ranks do it at build), so they exist before any trace and are checkpointed.
        Also sets the bytes one reduction sends."""
        self._reduce_all([tf.zeros((b.numel,), tf_dtype(b.dtype)) for b in self.layout.buckets], "prime")
        return [v for _, v in sorted(self.codec.state_dict().get("residuals", {}).items())]
