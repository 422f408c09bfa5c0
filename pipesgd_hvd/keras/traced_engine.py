"""The pipeline inside a traced TensorFlow step: pending gradients live in variables.

PyTorch's adapter drives :class:`~pipesgd_hvd.pipeline.engine.PipelineEngine` from Python, step by step.
A Keras ``train_step`` is one ``tf.function``: Python runs once, at trace time, so the pipeline's
state must be variables and its control flow graph ops. The rule (which step applies what, which
slot holds a pending gradient), the collectives' names and seeds, the one reduction function and
the byte accounting are the engine's: :mod:`pipesgd_hvd.pipeline.schedule` and
:func:`pipesgd_hvd.compression.allreduce.reduce_bucket`, here called with the step-counter
variable instead of an int.

Why the reduction of the pending gradient overlaps this step's forward and backward pass: its
inputs are a slot variable and the step counter, nothing this step computes, so TensorFlow's
executor may start it as soon as the step starts. Automatic control dependencies (ACD) in
``tf.function`` order only ops that touch the same resource (plus ops with unknown side
effects, chained in program order); the forward and backward pass touch the model's variables,
the reduction touches our slot and codec variables, so ACD adds no edge between them. Horovod's
ops are asynchronous kernels: they enqueue the tensor with Horovod's background thread and free
the executor thread. The write of this step's gradient into the slot comes after the read in
program order, and ACD orders the two (same resource). ``tests/mp/tf_custom_loop.py`` checks the
traced graph.

A slot can also hold a gradient that is reduced already (``reduced``): after
:meth:`TracedEngine.state_dict` settled it for a checkpoint or an elastic commit, or after
:meth:`TracedEngine.load_state_dict`; the step then applies it as it is.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from ..comm.base import Communicator, DoneHandle, ReduceOp
from ..compression.allreduce import reduce_bucket
from ..compression.codecs import Codec
from ..ops.tensorflow import TensorFlowOps, tf_dtype
from ..pipeline.config import PipelineConfig, WireStats, settings_entries
from ..pipeline.engine import AppliedStep
from ..pipeline.fusion import Bucket, TensorSpec, plan_buckets
from ..pipeline.guards import check_pipeline_agrees
from ..pipeline.schedule import Schedule, Step

# Name scopes of the two reductions in a traced step (tests check the stale one's inputs).
STALE_SCOPE, SYNC_SCOPE = "pipesgd_stale_reduction", "pipesgd_sync_reduction"


class TracedEngine(tf.Module):
    """Width-K pipeline whose state is TensorFlow variables (saved by ``tf.train.Checkpoint``).

    ``check_ranks=False``: built where no collective may run (a worker joining a Horovod elastic
    job while the others sync; the survivors of a lost worker): no cross-rank check, and the
    codec is primed without communicating (:class:`_ShapesOnly`)."""

    def __init__(self, specs: Sequence[TensorSpec], *, comm: Communicator, codec: Codec,
                 config: PipelineConfig, first_step: int = 0, check_ranks: bool = True) -> None:
        super().__init__(name="pipesgd")
        self.specs = list(specs)
        self.comm, self.codec, self.config = comm, codec, config
        self.schedule = Schedule(config)
        self.ops = TensorFlowOps()
        # Gradients arrive all at once in TensorFlow; reverse order still puts the output layer,
        # whose gradient the backward pass finishes first, in the first bucket.
        self.layout = plan_buckets(self.specs, list(range(len(self.specs)))[::-1], config.fusion_threshold_bytes)
        with tf.init_scope():  # eager even when Keras builds the optimizer inside a trace
            if check_ranks:
                check_pipeline_agrees(comm, config, codec.name, self.specs)
            self.step_counter = tf.Variable(first_step, dtype=tf.int64, trainable=False, name="step")
            # First pipelined step since warm-up or the last flush: the pipeline fills from here.
            self.start = tf.Variable(max(first_step, config.warmup_steps), dtype=tf.int64, trainable=False,
                                     name="start")
            slots = max(config.width - 1, 1)
            self.slots = [tf.Variable(tf.zeros((slots, b.numel), tf_dtype(b.dtype)), trainable=False,
                                      name=f"pending_b{b.index}") for b in self.layout.buckets]
            self.reduced = tf.Variable(tf.zeros((slots,), tf.bool), trainable=False, name="pending_reduced")
            # A pending gradient already applied by a call that fed nothing (a staleness
            # correction's first call of a pair takes it; the slot is refilled by the second).
            self.taken = tf.Variable(tf.zeros((slots,), tf.bool), trainable=False, name="pending_taken")
            self.bytes_sent = tf.Variable(0, dtype=tf.int64, trainable=False, name="bytes_sent")
            self.fp32_bytes = tf.Variable(0, dtype=tf.int64, trainable=False, name="fp32_bytes")
            self.codec_state = self._prime_codec(comm if check_ranks else _ShapesOnly(comm))

    # ------------------------------------------------------------------------------ tracing
    def exchange(self, grads: Sequence[Optional[tf.Tensor]], feeds: Any = True,
                 takes: Any = True) -> Tuple[List[Optional[tf.Tensor]], tf.Tensor, Any]:
        """This step's local gradients in, the averaged gradients to apply out (None where the
        local gradient was None), whether to apply them at all (False while filling), and whether
        they are an earlier step's (a bool: taken from the pending slot).
        ``feeds`` (a Python or traced bool): this call hands its gradients to the pipeline and
        counts as a step; ``takes``: it takes the pending gradient (a staleness correction's call
        may do one without the other: :meth:`~pipesgd_hvd.staleness.correction.Correction.feeds`)."""
        schedule = self.schedule
        step = self.step_counter.read_value()
        flats = [self._flatten(bucket, grads) for bucket in self.layout.buckets]
        if self.config.width == 1:
            if feeds is True:
                reduced = self._reduce_all(flats, "sync", step)
            else:
                reduced = tf.cond(feeds, lambda: self._reduce_all(flats, "sync", step), lambda: flats)
            self._count(tf.constant(True) if feeds is True else feeds)
            apply = tf.constant(True) if feeds is True else feeds
            has_stale = False
        else:
            start = self.start.read_value()
            slot = schedule.pending_slot(step, start)
            has_stale = schedule.has_stale(step, start)
            if takes is not True:
                has_stale = tf.logical_and(has_stale, takes)
            has_stale = tf.logical_and(has_stale, tf.logical_not(tf.gather(self.taken, slot)))
            pending = [tf.gather(v, slot) for v in self.slots]
            must_reduce = tf.logical_and(has_stale, tf.logical_not(tf.gather(self.reduced, slot)))
            # No input computed by this step: free to run beside the forward/backward pass.
            with tf.name_scope(STALE_SCOPE):
                # Seeded by the step that computed the gradient, as a flush or the engine seeds it.
                computed_at = step - (self.config.width - 1)
                stale = tf.cond(must_reduce, lambda: self._reduce_all(pending, "stale", computed_at), lambda: pending)
            self._count(must_reduce)
            in_warmup = schedule.in_warmup(step)
            sync_now = in_warmup if feeds is True else tf.logical_and(in_warmup, feeds)
            if self.config.warmup_steps > 0:
                zeros = [tf.zeros_like(f) for f in flats]
                with tf.name_scope(SYNC_SCOPE):
                    current = tf.cond(sync_now, lambda: self._reduce_all(flats, "sync", step), lambda: zeros)
                self._count(sync_now)
                reduced = [tf.where(in_warmup, c, s) for c, s in zip(current, stale)]
            else:
                reduced = stale
            store = tf.logical_not(in_warmup) if feeds is True else tf.logical_and(tf.logical_not(in_warmup), feeds)
            with tf.control_dependencies(reduced):  # the slot is read before it is overwritten
                for v, f in zip(self.slots, flats):
                    tf.cond(store, lambda v=v, f=f: v.scatter_update(
                        tf.IndexedSlices(f[None], tf.reshape(slot, (1,)))).op, tf.no_op)
                for flags in (self.reduced, self.taken):
                    tf.cond(store, lambda flags=flags: flags.scatter_update(
                        tf.IndexedSlices(tf.constant([False]), tf.reshape(slot, (1,)))).op, tf.no_op)
                if takes is not True:  # a call that takes and does not store marks the slot taken
                    tf.cond(tf.logical_and(has_stale, tf.logical_not(store)), lambda: self.taken.scatter_update(
                        tf.IndexedSlices(tf.constant([True]), tf.reshape(slot, (1,)))).op, tf.no_op)
            apply = tf.logical_or(sync_now, has_stale)
        with tf.control_dependencies(reduced):
            self.step_counter.assign_add(1 if feeds is True else tf.cast(feeds, tf.int64))
        return self._unflatten(reduced, grads), apply, has_stale

    def reduce_now(self, grads: Sequence[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
        """Eagerly and collectively: ``grads`` reduced at once, as a step of their own (a
        correction's kept part at ``flush()``; every rank holds one)."""
        step = self.step
        flats = [self._flatten(bucket, grads) for bucket in self.layout.buckets]
        reduced = self._reduce_all(flats, "kept", tf.constant(step, tf.int64))
        self._count(tf.constant(True))
        self.step_counter.assign(step + 1)
        self.start.assign(max(step + 1, self.config.warmup_steps))
        return self._unflatten(reduced, grads)

    # ------------------------------------------------------------------------------- eager
    def flush(self) -> List[AppliedStep]:
        """Eagerly: reduces the gradients still in the pipeline and returns them, oldest first (a
        collective: every rank calls it at the same step). The next step fills the pipeline anew."""
        out = [AppliedStep(s, self._by_index(flats)) for s, flats in self._settled()]
        self.start.assign(max(self.step, self.config.warmup_steps))
        self.reduced.assign(tf.zeros_like(self.reduced))
        self.taken.assign(tf.zeros_like(self.taken))
        return out

    def _pending(self) -> List[Tuple[int, int]]:
        """(step, slot) of each pending gradient not taken yet, oldest first."""
        step, start = self.step, int(self.start.numpy())
        slots = self.schedule.flush_order(step, start)
        taken = self.taken.numpy()
        return [(step - len(slots) + i, slot) for i, slot in enumerate(slots) if not taken[slot]]

    def _settled(self) -> List[Tuple[int, List[tf.Tensor]]]:
        """Eagerly and collectively: each pending gradient reduced (reducing those not reduced
        yet and keeping the result in their slot), oldest first, as (step, flat buckets)."""
        out = []
        for step, slot in self._pending():
            flats = [v[slot] for v in self.slots]
            if not bool(self.reduced[slot].numpy()):
                flats = self._reduce_all(flats, "flush", tf.constant(step, tf.int64))
                self._count(tf.constant(True))
                for v, f in zip(self.slots, flats):
                    v[slot].assign(f)
                self.reduced[slot].assign(True)
            out.append((step, flats))
        return out

    def state_dict(self) -> Dict[str, Any]:
        """The engine's part of the checkpoint entry (:mod:`pipesgd_hvd.optimizer.checkpoint`), eagerly.
        Collective: pending gradients are reduced now (and stay reduced in their slots)."""
        in_flight = [{"step": step, "meta": None,
                      "grads": {self.specs[i].name: g.numpy() for i, g in self._by_index(flats).items()}}
                     for step, flats in self._settled()]
        codec = {"residuals": {k: v.numpy() for k, v in self._residuals().items()}} if self._residuals() else {}
        return {"step": self.step, "settings": self.settings(), "in_flight": in_flight, "codec": codec,
                "stats": vars(self.stats).copy()}

    def reduced_state_dict(self) -> Dict[str, Any]:
        """:meth:`state_dict` without the collective: only the pending gradients reduced already
        (at a change of the world the others cannot be reduced any more: they are dropped)."""
        in_flight = [{"step": step, "meta": None, "grads": {
            self.specs[i].name: g.numpy() for i, g in self._by_index([v[slot] for v in self.slots]).items()}}
            for step, slot in self._pending() if bool(self.reduced[slot].numpy())]
        return {"step": self.step, "settings": self.settings(), "in_flight": in_flight, "codec": {},
                "stats": vars(self.stats).copy()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Loads the engine's part of a checkpoint entry (the caller checked the settings)."""
        step, in_flight = int(state["step"]), list(state["in_flight"])
        start = max(step - len(in_flight), self.config.warmup_steps)
        self.step_counter.assign(step)
        self.start.assign(start)
        self.reduced.assign(tf.zeros_like(self.reduced))
        self.taken.assign(tf.zeros_like(self.taken))
        by_name = {s.name: i for i, s in enumerate(self.specs)}
        for entry in in_flight:
            unknown = sorted(set(entry["grads"]) - set(by_name))
            if unknown:
                raise ValueError(f"checkpoint holds in-flight gradients for unknown tensors {unknown}")
            grads = {by_name[n]: tf.convert_to_tensor(g) for n, g in entry["grads"].items()}
            slot = int(self.schedule.pending_slot(int(entry["step"]), start))
            for bucket, v in zip(self.layout.buckets, self.slots):
                v[slot].assign(self._flatten(bucket, [grads.get(i) for i in range(len(self.specs))]))
            self.reduced[slot].assign(True)
        saved = (state.get("codec") or {}).get("residuals", {})
        for key, variable in self._residuals().items():  # in place: traced steps hold these variables
            value = saved.get(key)
            variable.assign(value if value is not None and tuple(np.shape(value)) == tuple(variable.shape)
                            else tf.zeros_like(variable))
        self.stats = WireStats(**(state.get("stats") or {}))

    def _residuals(self) -> Dict[str, tf.Variable]:
        return dict(self.codec.state_dict().get("residuals", {}))

    @property
    def step(self) -> int:
        """Steps ended so far (eagerly; traced code reads ``step_counter``)."""
        return int(self.step_counter.numpy())

    @property
    def stats(self) -> WireStats:
        return WireStats(steps=self.step, bytes_sent=int(self.bytes_sent.numpy()), fp32_bytes=int(self.fp32_bytes.numpy()))

    @stats.setter
    def stats(self, value: WireStats) -> None:
        self.bytes_sent.assign(value.bytes_sent)
        self.fp32_bytes.assign(value.fp32_bytes)

    def settings(self) -> List[Tuple[str, Any]]:
        return settings_entries(self.config, self.codec.name)

    def abandon(self) -> Dict[str, Any]:
        """At a change of the world: the state of the gradients reduced already; the rest, local
        gradients the old world would have reduced, are dropped (on every rank alike)."""
        return self.reduced_state_dict()

    def close(self) -> None:
        """Nothing runs outside the traced steps: nothing to stop."""

    # ------------------------------------------------------------------------------ helpers
    def _flatten(self, bucket: Bucket, grads: Sequence[Optional[tf.Tensor]]) -> tf.Tensor:
        dtype = tf_dtype(bucket.dtype)
        parts = []
        for m in bucket.members:
            g = grads[m.index]
            parts.append(tf.zeros((m.numel,), dtype) if g is None else tf.reshape(tf.cast(g, dtype), (-1,)))
        return tf.concat(parts, 0) if len(parts) > 1 else parts[0]

    def _by_index(self, flats: Sequence[tf.Tensor]) -> Dict[int, tf.Tensor]:
        out = {}
        for bucket, flat in zip(self.layout.buckets, flats):
            for m in bucket.members:
                out[m.index] = tf.reshape(flat[m.offset:m.offset + m.numel], m.shape)
        return out

    def _unflatten(self, flats: Sequence[tf.Tensor], like: Sequence[Optional[tf.Tensor]]) -> List[Optional[tf.Tensor]]:
        by_index = self._by_index(flats)
        return [by_index[i] if like[i] is not None else None for i in range(len(self.specs))]

    def _reduce_all(self, flats: Sequence[tf.Tensor], tag: str, step: Step,
                    comm: Optional[Communicator] = None) -> List[tf.Tensor]:
        """Every bucket reduced; ``step``: the step whose gradient it is (seeds rounding)."""
        schedule, (prescale, postscale) = self.schedule, self.config.scale_factors()
        out, sent = [], 0
        for bucket, flat in zip(self.layout.buckets, flats):
            reduced, bucket_sent = reduce_bucket(
                self.ops, comm or self.comm, self.codec, flat, name=schedule.op_name(self.layout, bucket.index, tag),
                key=schedule.state_key(self.layout, bucket.index), seed=schedule.seed(bucket.index, self.comm.rank, step),
                op=self.config.op, prescale=prescale, postscale=postscale).wait()
            out.append(reduced)
            sent += bucket_sent
        self._sent = sent  # a Python int known at trace time; the same for every reduction
        return out

    def _count(self, happened: tf.Tensor) -> None:
        """Adds one reduction's bytes to the counters when ``happened`` (a traced bool)."""
        fp32 = self.schedule.fp32_wire_bytes(self.layout, self.comm.size)
        self.bytes_sent.assign_add(tf.where(happened, tf.constant(self._sent, tf.int64), 0))
        self.fp32_bytes.assign_add(tf.where(happened, tf.constant(fp32, tf.int64), 0))

    def _prime_codec(self, comm: Communicator) -> List[tf.Variable]:
        """Creates the codec's state variables (error-feedback residuals) now, by reducing zeros
        once (all ranks do it at build), so they exist before any trace and are checkpointed.
        Also sets the bytes one reduction sends."""
        self._reduce_all([tf.zeros((b.numel,), tf_dtype(b.dtype)) for b in self.layout.buckets], "prime", 0, comm)
        return [v for _, v in sorted(self._residuals().items())]


class _ShapesOnly:
    """``comm``'s rank and size with collectives that send nothing and return results of the right
    shape: enough to prime a codec (its variables' shapes and the bytes a reduction sends depend
    only on the shapes) where no collective may run."""

    def __init__(self, comm: Communicator) -> None:
        self.rank, self.size = comm.rank, comm.size

    def allreduce_async_(self, x: tf.Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> DoneHandle:
        return DoneHandle(x)

    def alltoall_async(self, x: tf.Tensor, name: str) -> DoneHandle:
        return DoneHandle(x)

    def allgather_async(self, x: tf.Tensor, name: str) -> DoneHandle:
        return DoneHandle(tf.tile(x, [self.size] + [1] * (x.shape.rank - 1)))

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        return [obj] * self.size
