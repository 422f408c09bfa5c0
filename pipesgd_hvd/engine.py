"""The pipeline: step t's gradients are reduced while step t+1 computes; updates apply K-1 steps late.

``PipelineEngine`` is framework-free. An adapter hands it each step's local gradients as they
become ready (:meth:`add_gradient_` copies them into fusion buffers, so the next backward pass may
overwrite ``.grad``); a bucket's reduction starts as soon as all its gradients are in and every
lower-numbered bucket has started, so all ranks issue collectives in the same order. At the end
of the step (:meth:`end_step`) the engine waits only for the oldest in-flight step, t-K+1, and
returns its averaged gradients for the adapter to apply.

Update rule with width K (staleness K-1)::

    w_{t+1} = w_t - lr * mean_i g_i(t - K + 1)

K = 1 is synchronous data-parallel SGD. The first ``warmup_steps`` steps run with K = 1; the
first K-1 pipelined steps apply nothing (no stale gradient exists yet). :meth:`flush` waits for
and returns everything in flight; :meth:`state_dict` waits for it too and saves the reduced
gradients, codec state (error-feedback residuals) and step count, so a restart resumes exactly.

Failures are final: once a reduction fails (a lost peer, a timeout) or a check finds the ranks
disagreeing, the in-flight steps can no longer be completed consistently, so every later call
raises at once (:attr:`failure` holds the first error) instead of waiting on collectives that
cannot complete. The cure is a restart from the last checkpoint on every rank.
"""
from __future__ import annotations

import collections
import hashlib
import concurrent.futures
import math
import numbers
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from .comm.base import Communicator, ReduceOp
from .compression.allreduce import allreduce_wire_bytes, compressed_allreduce, derive_seed
from .compression.codecs import Codec
from .consistency import check_ranks_agree, settings_entries
from .fusion import DEFAULT_FUSION_THRESHOLD, Bucket, FusionLayout, TensorSpec, plan_buckets
from .guards import check_replicas, check_steps_agree
from .tensor_ops import MutableTensorOps, Tensor


def _integer(name: str, value: Any, minimum: int, hint: str = "") -> int:
    """``value`` as an int >= ``minimum`` (numpy ints too), or a ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{hint}, got {value!r}")
    return int(value)


def pipeline_name(tensor_names: Sequence[str]) -> str:
    """The prefix of one optimizer's collective names: the same on every rank (a digest of the
    tensor names). Horovod refuses two tensors in flight under one name, so two optimizers over
    identically named parameters must not have reductions in flight at the same time (flush one
    before stepping the other) or their parameters must be named apart."""
    digest = hashlib.blake2b(repr(list(tensor_names)).encode(), digest_size=3).hexdigest()
    return f"psgd.{digest}"


@dataclass(frozen=True)
class PipelineConfig:
    """Settings of one pipeline (the same on every rank; checked at construction).

    ``check_replicas_every``: compare a checksum of every parameter across ranks every that many
    steps (0: never); see :mod:`pipesgd_hvd.guards`."""

    width: int = 2
    warmup_steps: int = 0
    fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD
    op: ReduceOp = ReduceOp.AVERAGE
    gradient_predivide_factor: float = 1.0
    name: str = "psgd"
    seed: int = 0
    check_replicas_every: int = 0

    def __post_init__(self) -> None:
        # Frozen: normalised values (numpy ints -> int) are written through object.__setattr__.
        fix = lambda field_name, value: object.__setattr__(self, field_name, value)  # noqa: E731
        fix("width", _integer("width", self.width, 1, " (1 = synchronous, 2 = Pipe-SGD)"))
        fix("warmup_steps", _integer("warmup_steps", self.warmup_steps, 0))
        fix("fusion_threshold_bytes", _integer("fusion threshold", self.fusion_threshold_bytes, 0, " bytes"))
        fix("seed", _integer("seed", self.seed, 0, " (the same on every rank)"))
        fix("check_replicas_every", _integer("check_replicas_every", self.check_replicas_every, 0,
                                             " steps (0 or None: never)"))
        if not isinstance(self.op, ReduceOp):
            raise ValueError(f"op must be Average or Sum, got {self.op!r}")
        factor = self.gradient_predivide_factor
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0 < factor < math.inf:
            raise ValueError(f"gradient_predivide_factor must be a finite number > 0, got {factor!r}")
        fix("gradient_predivide_factor", float(factor))
        if self.gradient_predivide_factor != 1.0 and self.op is not ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor is only supported with op=Average (as in Horovod)")
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a str, got {self.name!r}")

    def width_at(self, step: int) -> int:
        return 1 if step < self.warmup_steps else self.width

    def scale_factors(self) -> Tuple[float, float]:
        """(prescale, postscale) as Horovod splits an average around the sum."""
        if self.op is ReduceOp.AVERAGE:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0


@dataclass
class WireStats:
    """Bytes this rank sent, next to what a float32 ring all-reduce would have sent."""

    steps: int = 0
    bytes_sent: int = 0
    fp32_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.bytes_sent / self.fp32_bytes if self.fp32_bytes else 1.0


@dataclass
class AppliedStep:
    """The averaged gradients of one step, ready to apply. ``grads`` maps spec index -> tensor;
    the tensors may be views of engine buffers, valid until the next step begins."""

    step: int
    grads: Dict[int, Tensor]
    meta: Any = None


class _Reduction:
    """One bucket's reduction in flight: a plain all-reduce handle or a comm-thread future."""

    def __init__(self, wait: Callable[[], Tuple[Tensor, int]]) -> None:
        self._wait = wait

    def wait(self) -> Tuple[Tensor, int]:
        return self._wait()


@dataclass
class _Step:
    step: int
    layout: FusionLayout
    buffers: List[Tensor]
    written: List[int]                                   # gradients written, per bucket
    seen: set = field(default_factory=set)               # spec indices written
    reductions: List[Optional[_Reduction]] = field(default_factory=list)
    grads: Optional[Dict[int, Tensor]] = None            # set once waited (or loaded)
    meta: Any = None


class PipelineEngine:
    """Width-K pipeline of in-flight gradient reductions over a :class:`Communicator`."""

    def __init__(self, specs: Sequence[TensorSpec], *, ops: MutableTensorOps, comm: Communicator,
                 codec: Codec, config: PipelineConfig = PipelineConfig(),
                 ready_order: Optional[Sequence[int]] = None,
                 device_anchors: Optional[Dict[str, Tensor]] = None, first_step: int = 0,
                 check_ranks: bool = True) -> None:
        """``ready_order``: spec indices in the order gradients are expected (default: reverse).
        ``device_anchors``: a tensor per device name, next to which that device's buffers go.
        ``first_step``: the index of the first step, for an engine that replaces a flushed one
        mid-training (the auto mode switching width or codec): warm-up, replica checks and
        stochastic-rounding seeds keep counting from there.
        ``check_ranks=False`` skips the cross-rank check of settings and tensors (a collective)
        here; for a process that may not issue collectives yet (a worker joining a Horovod
        elastic job builds its optimizer while the others are busy syncing), which builds the
        engine again, checked, once every rank can take part."""
        self.specs = list(specs)
        self.ops, self.comm, self.codec, self.config = ops, comm, codec, config
        self._ready_order = list(ready_order) if ready_order is not None else list(range(len(self.specs)))[::-1]
        self._layouts: Dict[Tuple[int, ...], FusionLayout] = {}
        self._buffers: Dict[Tuple[str, int], List[Tensor]] = {}   # (layout key, slot) -> buffers
        self._queue: Deque[_Step] = collections.deque()
        self._current: Optional[_Step] = None
        self._next_launch = 0
        self._step = _integer("first_step", first_step, 0)
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._anchors = dict(device_anchors or {})
        self.stats = WireStats()
        self._failure: Optional[BaseException] = None
        # Set on the first failure; the comm thread then runs no further queued reduction (each
        # would wait a full timeout for a peer that is gone, and exit joins that thread).
        self._abort = threading.Event()
        self._replicas_agreed_at = 0
        if check_ranks:
            check_ranks_agree(comm, {
                "settings": self._settings(),
                "tensors": [(spec.name, tuple(spec.shape), spec.dtype) for spec in self.specs]})

    # ----------------------------------------------------------------------------- properties
    @property
    def step(self) -> int:
        """Steps ended so far (the index of the next step)."""
        return self._step

    @property
    def in_flight(self) -> int:
        return len(self._queue)

    @property
    def step_open(self) -> bool:
        """Gradients of the current step have been handed in and the step has not ended."""
        return self._current is not None

    def has_gradient(self, index: int) -> bool:
        """Spec ``index``'s gradient was handed in during the open step."""
        return self._current is not None and index in self._current.seen

    @property
    def failure(self) -> Optional[BaseException]:
        """The error that stopped this pipeline, or None while it runs."""
        return self._failure

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError(
                f"the pipeline stopped at an earlier error on this rank ({type(self._failure).__name__}: "
                f"{self._failure}); its in-flight steps cannot complete consistently. Restart every rank from "
                "the last checkpoint") from self._failure

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._abort.set()

    def _checked(self, check: Callable[[], None]) -> None:
        """Runs a cross-rank check; its error stops the pipeline (the ranks disagree)."""
        try:
            check()
        except BaseException as exc:
            self._fail(exc)
            raise

    # ------------------------------------------------------------------------------- the step
    def begin_step(self, active: Sequence[int]) -> None:
        """Open a step over the gradients ``active`` (spec indices; those that require grad now)."""
        self._raise_if_failed()
        if self._current is not None:
            raise RuntimeError("begin_step() called twice without end_step()")
        layout = self.layout_for(active)
        slot = self._step % self.config.width
        buffers = self._buffers.get((layout.key, slot))
        if buffers is None:
            buffers = [self.ops.empty((b.numel,), b.dtype, like=self._like(b)) for b in layout.buckets]
            self._buffers[(layout.key, slot)] = buffers
        self._current = _Step(self._step, layout, buffers, [0] * len(layout.buckets),
                              reductions=[None] * len(layout.buckets))
        self._next_launch = 0

    def add_gradient_(self, index: int, grad: Tensor) -> None:
        """Copy spec ``index``'s local gradient of this step into its bucket; launch what is ready."""
        self._raise_if_failed()
        cur = self._current
        if cur is None:
            raise RuntimeError("add_gradient_() before begin_step()")
        placed = cur.layout.placement.get(index)
        if placed is None:
            raise ValueError(f"gradient of '{self.specs[index].name}' arrived, but that tensor did not "
                             "require grad when this step began")
        if index in cur.seen:
            raise RuntimeError(f"gradient of '{self.specs[index].name}' was handed in twice in one step; "
                               "use backward_passes_per_step to accumulate several backward passes")
        b, member = placed
        self.ops.copy_into_(cur.buffers[b], member.offset, grad)
        cur.seen.add(index)
        cur.written[b] += 1
        self._launch_ready(cur, force=False)

    def end_step(self, meta: Any = None) -> List[AppliedStep]:
        """End the open step: launch what is left (missing gradients count as zeros), then wait for
        the steps that fall out of the pipeline and return them, oldest first (usually one; none
        while the pipeline fills)."""
        self._raise_if_failed()
        cur = self._current
        if cur is None:
            raise RuntimeError("end_step() without an open step")
        self._launch_ready(cur, force=True)
        cur.meta = meta
        self._queue.append(cur)
        self._current = None
        self._step += 1
        width = self.config.width_at(cur.step)
        applied = []
        while len(self._queue) >= width:
            applied.append(self._finish(self._queue.popleft()))
        return applied

    def flush(self, check_steps: bool = True) -> List[AppliedStep]:
        """Wait for every step in flight (ending an open one first) and return them, oldest first.

        Collective: first checks that every rank has run the same number of steps (a rank that
        ran more would wait forever for the others' share of its last reduction), and raises
        :class:`~pipesgd_hvd.guards.StepCountMismatchError` on every rank if not.
        ``check_steps=False`` skips that (at interpreter exit, where the other ranks may be gone)."""
        self._raise_if_failed()
        if check_steps:
            ended = self._step + (1 if self._current is not None else 0)
            self._checked(lambda: check_steps_agree(self.comm, ended, "flush()"))
        if self._current is not None:
            self._launch_ready(self._current, force=True)
            self._queue.append(self._current)
            self._current = None
            self._step += 1
        applied = [self._finish(s) for s in self._queue]
        self._queue.clear()
        return applied

    def abandon(self) -> Dict[str, Any]:
        """Stop this engine at a change of the world (Horovod elastic) without waiting on anything,
        and return :meth:`state_dict` of what it holds already reduced.

        The collectives in flight belong to a world that is gone (or about to be: Horovod shuts
        down and re-initializes), so they are never waited on: the open step and every step not
        yet waited for are dropped, and the comm thread starts no further reduction. Steps
        already waited for (by ``end_step``, or by ``state_dict`` at a commit) are kept: every
        rank waits for them at the same point of the program, so they are the same on every
        rank. The engine is unusable afterwards; build a new one for the new world."""
        self._abort.set()  # queued comm-thread jobs must not start a collective in the new world
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None
        self._current = None
        # Waits happen oldest first, so the finished steps are a prefix of the queue.
        self._queue = collections.deque(s for s in self._queue if s.grads is not None)
        self._failure = None
        try:
            return self.state_dict()  # no wait: every step left is finished
        finally:
            self._fail(RuntimeError("this pipeline was abandoned at a change of the Horovod world; "
                                    "the optimizer continues on a new one"))

    def close(self) -> None:
        if self._worker is not None:
            # After a failure, queued reductions would only wait for a peer that is gone.
            failed = self._failure is not None
            self._worker.shutdown(wait=not failed, cancel_futures=failed)
            self._worker = None

    # ------------------------------------------------------------------------- replica check
    def replica_check_due(self) -> bool:
        """Whether the open step is one where :meth:`check_replicas` runs (every
        ``check_replicas_every`` steps; the same answer on every rank)."""
        every = self.config.check_replicas_every
        return bool(every) and self._step > 0 and self._step % every == 0 and self._replicas_agreed_at != self._step

    def check_replicas(self, named: Sequence[Tuple[str, Any]]) -> None:
        """Collective: compares a checksum of each (name, host array) across ranks, and the step
        counts; raises :class:`~pipesgd_hvd.guards.ReplicaDriftError` (or StepCountMismatchError)
        on every rank, naming the step and the first tensor that differs."""
        self._raise_if_failed()
        self._checked(lambda: check_replicas(self.comm, self._step, named, self._replicas_agreed_at))
        self._replicas_agreed_at = self._step

    # ------------------------------------------------------------------------------- layouts
    def layout_for(self, active: Sequence[int], check: bool = True) -> FusionLayout:
        """The buckets for the tensors ``active``. A set not seen before is checked against the
        other ranks (collective; ``check=False`` when restoring a checkpoint, which ranks may do
        alone): ranks that freeze different parameters would issue different collectives."""
        key = tuple(sorted(set(active)))
        layout = self._layouts.get(key)
        if layout is None:
            if not key:
                raise ValueError("no parameter requires a gradient: nothing to reduce")
            chosen = set(key)
            order = [i for i in self._ready_order if i in chosen]
            layout = plan_buckets(self.specs, order, self.config.fusion_threshold_bytes)
            if check:  # also for the full set: a rank that froze something before step 0 is caught
                self._checked(lambda: self._check_trainable_agree(key))
            self._layouts[key] = layout
        return layout

    def _check_trainable_agree(self, key: Tuple[int, ...]) -> None:
        try:
            check_ranks_agree(self.comm, {"tensors that require grad": [
                (self.specs[i].name, tuple(self.specs[i].shape), self.specs[i].dtype) for i in key]})
        except ValueError as exc:
            raise ValueError(f"{exc}; here: set requires_grad on the same parameters on every rank, at the same "
                             "step") from None

    def _settings(self) -> List[Tuple[str, Any]]:
        return settings_entries(self.config, self.codec.name) + [
            ("check_replicas_every", self.config.check_replicas_every)]

    def _like(self, bucket: Bucket) -> Any:
        return self._anchors.get(bucket.device)

    # ------------------------------------------------------------------------------ launching
    def _launch_ready(self, cur: _Step, force: bool) -> None:
        buckets = cur.layout.buckets
        while self._next_launch < len(buckets):
            b = self._next_launch
            bucket = buckets[b]
            if cur.written[b] < len(bucket.members):
                if not force:
                    return
                for m in bucket.members:  # ranks that computed no gradient for it contribute zeros
                    if m.index not in cur.seen:
                        self.ops.fill_(cur.buffers[b], m.offset, m.numel, 0.0)
            cur.reductions[b] = self._launch(cur, bucket, cur.buffers[b])
            self._next_launch += 1

    def _launch(self, cur: _Step, bucket: Bucket, flat: Tensor) -> _Reduction:
        cfg, ops, codec, comm = self.config, self.ops, self.codec, self.comm
        prescale, postscale = cfg.scale_factors()
        name = f"{cfg.name}.{cur.layout.key}.b{bucket.index}.s{cur.step % cfg.width}"
        key = f"{cur.layout.key}.b{bucket.index}"
        seed = derive_seed(cfg.seed, cur.step, bucket.index, comm.rank)
        if codec.summable:
            payload, ctx = codec.encode(ops, flat, key=key, seed=seed)
            handle = comm.allreduce_async_(payload, name, cfg.op, prescale, postscale)
            sent = allreduce_wire_bytes(ops.numel(payload), ops.dtype_name(payload), comm.size)
            return _Reduction(lambda: (codec.decode(ops, handle.wait(), ctx), sent))

        # Byte codecs: encode, alltoall, sum, allgather, decode, all on the comm thread (on GPU on
        # its own stream), so neither the codec work nor the blocking waits hold up compute.
        marker = ops.ready_marker(flat)

        abort = self._abort
        comm = _AbortableComm(comm, abort)

        def job() -> Tuple[Tensor, int, Any]:
            if abort.is_set():
                raise RuntimeError(f"{name} was not started: an earlier reduction on this rank failed")
            try:
                with ops.stream_guard():
                    ops.wait_marker(marker)
                    out, sent = compressed_allreduce(ops, comm, codec, flat, name=name, key=key, seed=seed,
                                                     op=cfg.op, prescale=prescale, postscale=postscale)
                    return out, sent, ops.ready_marker(out)
            except BaseException:
                abort.set()  # before the main thread even sees it: the next queued job must not start
                raise

        future = self._comm_thread().submit(job)

        def wait() -> Tuple[Tensor, int]:
            out, sent, done = future.result()
            ops.wait_marker(done)
            return out, sent

        return _Reduction(wait)

    def _comm_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pipesgd-comm")
        return self._worker

    def _finish(self, s: _Step) -> AppliedStep:
        if s.grads is None:
            grads: Dict[int, Tensor] = {}
            for bucket, reduction in zip(s.layout.buckets, s.reductions):
                assert reduction is not None
                try:
                    flat, sent = reduction.wait()
                except BaseException as exc:  # a lost peer, a timeout, or an interrupt mid-wait
                    self._fail(exc)
                    raise
                self.stats.bytes_sent += sent
                self.stats.fp32_bytes += allreduce_wire_bytes(bucket.numel, "float32", self.comm.size)
                for m in bucket.members:
                    grads[m.index] = self.ops.view(flat, m.offset, m.numel, m.shape)
            self.stats.steps += 1
            s.grads, s.reductions = grads, []
        return AppliedStep(s.step, s.grads, s.meta)

    # ------------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Dict[str, Any]:
        """Waits for the steps in flight and returns them reduced, with codec state and counters.
        Tensors are copies: training may go on after the call."""
        self._raise_if_failed()
        if self._current is not None:
            raise RuntimeError("state_dict() was called between backward() and step(): call step() first, "
                               "so that the current gradients are part of the pipeline")
        in_flight = []
        for s in self._queue:
            applied = self._finish(s)
            in_flight.append({"step": s.step, "meta": s.meta,
                              "grads": {self.specs[i].name: self.ops.new_state(g) for i, g in applied.grads.items()}})
        codec_state = {k: _copy_tree(v, self.ops) for k, v in self.codec.state_dict().items()}
        return {"format": 1, "step": self._step, "settings": self._settings(), "in_flight": in_flight,
                "codec": codec_state, "stats": vars(self.stats).copy()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("format") != 1:
            raise ValueError("not a pipesgd_hvd engine state (missing format 1)")
        saved = [tuple(x) for x in state["settings"]]
        mine = self._settings()
        if [s for s in saved if s[0] in ("width", "warmup_steps")] != [s for s in mine if s[0] in ("width", "warmup_steps")]:
            raise ValueError(f"checkpoint was written with {saved}, this pipeline has {mine}: width and "
                             "warmup_steps must match to resume the in-flight gradients exactly")
        if self._current is not None or self._queue:
            raise RuntimeError("load_state_dict() with gradients in flight: load before training starts")
        by_name = {spec.name: i for i, spec in enumerate(self.specs)}
        self._queue.clear()
        for entry in state["in_flight"]:
            missing = [n for n in entry["grads"] if n not in by_name]
            if missing:
                raise ValueError(f"checkpoint holds in-flight gradients for unknown tensors {missing}")
            grads = {by_name[n]: self.ops.new_state(g) for n, g in entry["grads"].items()}
            layout = self.layout_for(list(grads), check=False)
            self._queue.append(_Step(entry["step"], layout, [], [], grads=grads, meta=entry["meta"]))
        self._step = int(state["step"])
        self.codec.load_state_dict(state["codec"], self.ops)
        self.stats = WireStats(**state.get("stats", {}))


class _AbortableComm:
    """The communicator as a comm-thread job sees it: once the engine aborts (a failure, or
    :meth:`PipelineEngine.abandon` at a change of the world), a job cut between its alltoall and
    its allgather starts no further collective, which could otherwise land in the next world."""

    def __init__(self, comm: Communicator, abort: threading.Event) -> None:
        self._comm, self._abort = comm, abort

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def size(self) -> int:
        return self._comm.size

    def _check(self, name: str) -> None:
        if self._abort.is_set():
            raise RuntimeError(f"{name} was not started: this pipeline stopped (an earlier failure or a world change)")

    def allreduce_async_(self, x: Tensor, name: str, op: ReduceOp = ReduceOp.SUM,
                         prescale: float = 1.0, postscale: float = 1.0) -> Any:
        self._check(name)
        return self._comm.allreduce_async_(x, name, op, prescale, postscale)

    def alltoall_async(self, x: Tensor, name: str) -> Any:
        self._check(name)
        return self._comm.alltoall_async(x, name)

    def allgather_async(self, x: Tensor, name: str) -> Any:
        self._check(name)
        return self._comm.allgather_async(x, name)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        self._check(name)
        return self._comm.allgather_object(obj, name)


def _copy_tree(value: Any, ops: MutableTensorOps) -> Any:
    if isinstance(value, dict):
        return {k: _copy_tree(v, ops) for k, v in value.items()}
    if isinstance(value, (int, float, str, type(None))):
        return value
    return ops.new_state(ops.read(value))
