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

Which ranks still train (Horovod's join semantics, :meth:`OptimizerCore.join`) rides with each
step's last bucket: ``size`` membership flags in a codec block of their own past its gradients
(:func:`~pipesgd_hvd.compression.allreduce.side_region`), 1 from a training rank, 0 from a joined
one, read as "> half the unit" after the reduction. No collective of its own: every rank issues
the same collectives, in the same order, whether or not any rank has joined.

No silent wait: every wait for a reduction goes through the stall inspector
(:mod:`pipesgd_hvd.pipeline.stall`), which warns after ``PIPESGD_STALL_CHECK_TIME_SECONDS`` naming
the missing ranks, and ends the wait with an error at once when a rank it needs can never come.

Failures are final: once a reduction fails (a lost peer, a timeout) or a check finds the ranks
disagreeing, the in-flight steps can no longer be completed consistently, so every later call
raises at once (:attr:`failure` holds the first error) instead of waiting on collectives that
cannot complete. The cure is a restart from the last checkpoint on every rank.
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from ..comm.base import Communicator, ReduceOp, postscale_factor
from ..comm.topology import Topology
from ..compression.allreduce import Reduction, compressed_allreduce, padded_numel, reduce_bucket, side_region
from ..compression.codecs import Codec
from ..compression.hierarchical import hierarchical_allreduce
from ..ops.base import MutableTensorOps, Tensor
from .config import PipelineConfig, WireStats, integer, settings_entries
from .fusion import Bucket, FusionLayout, TensorSpec, plan_buckets
from .guards import check_pipeline_agrees, check_ranks_agree, check_replicas, check_steps_agree, checksum
from .schedule import Schedule
from .stall import StallInspector


@dataclass
class AppliedStep:
    """The averaged gradients of one step, ready to apply. ``grads`` maps spec index -> tensor;
    the tensors may be views of engine buffers, valid until the next step begins, unless
    ``owned``: then nothing of the engine reads or writes their memory again, and they may
    become the framework's gradients without a copy."""

    step: int
    grads: Dict[int, Tensor]
    meta: Any = None
    membership: Optional[Callable[[], List[bool]]] = None  # reads the step's membership flags
    owned: bool = False

    def training(self) -> Optional[List[bool]]:
        """Per rank: was it training (not joined) at this step; None when not known (one rank, a
        step loaded from a checkpoint). Reads the flags (a device sync on a GPU), so it is asked
        only when needed (join)."""
        return self.membership() if self.membership is not None else None


@dataclass
class _Step:
    step: int
    layout: FusionLayout
    buffers: List[Tensor]
    written: List[int]                                   # gradients written, per bucket
    checked: bool = True                                 # the ranks agreed on this tensor set
    seen: set = field(default_factory=set)               # spec indices written
    reductions: List[Optional[Reduction]] = field(default_factory=list)
    grads: Optional[Dict[int, Tensor]] = None            # set once waited (or loaded)
    meta: Any = None
    flags: Any = None                                    # the reduced membership flags (see join)


class PipelineEngine:
    """Width-K pipeline of in-flight gradient reductions over a :class:`Communicator`."""

    def __init__(self, specs: Sequence[TensorSpec], *, ops: MutableTensorOps, comm: Communicator,
                 codec: Codec, config: PipelineConfig = PipelineConfig(),
                 ready_order: Optional[Sequence[int]] = None,
                 device_anchors: Optional[Dict[str, Tensor]] = None, first_step: int = 0,
                 check_ranks: bool = True, topology: Optional[Topology] = None,
                 inspector: Optional[StallInspector] = None) -> None:
        """``ready_order``: spec indices in the order gradients are expected (default: reverse).
        ``device_anchors``: a tensor per device name, next to which that device's buffers go.
        ``first_step``: the index of the first step, for an engine that replaces a flushed one
        mid-training (the auto mode switching width or codec): warm-up, replica checks and
        stochastic-rounding seeds keep counting from there.
        ``check_ranks=False`` skips the cross-rank check of settings and tensors (a collective)
        here, for a caller that has just run it (the optimizer core checks once per optimizer)
        or that may not issue collectives yet (a worker joining a Horovod elastic job builds its
        optimizer while the others are busy syncing, and builds the engine again, checked, once
        every rank can take part).
        ``topology``: the node and cross-node groups a byte codec's buckets are reduced over when
        ``config.hierarchical`` is set (``compression/hierarchical.py``), over all of ``comm``'s ranks.
        ``inspector``: the stall inspector to wait through (an optimizer keeps one across the
        engines it builds); by default the engine makes its own and stops it at :meth:`close`."""
        if (config.hierarchical is None) != (topology is None):
            raise ValueError("a hierarchical pipeline needs both config.hierarchical and a topology, a flat one neither")
        if config.hierarchical is not None and codec.summable:
            raise ValueError(f"codec {codec.name} is reduced by a plain all-reduce: it has no hierarchical form")
        if topology is not None and topology.layout.size != comm.size:
            raise ValueError(f"the topology holds {topology.layout.size} ranks, the communicator {comm.size}")
        self.topology = topology
        self.specs = list(specs)
        self.ops, self.comm, self.codec, self.config = ops, comm, codec, config
        self.schedule = Schedule(config)
        self._ready_order = list(ready_order) if ready_order is not None else list(range(len(self.specs)))[::-1]
        self._layouts: Dict[Tuple[int, ...], FusionLayout] = {}
        self._checked_sets: set = set()  # tensor sets the ranks agreed on (see end_step)
        self._buffers: Dict[Tuple[str, int], List[Tensor]] = {}   # (layout key, slot) -> buffers
        self._queue: Deque[_Step] = collections.deque()
        self._current: Optional[_Step] = None
        self._next_launch = 0
        self._step = integer("first_step", first_step, 0)
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        # A shared communicator's one issue thread (comm/ordered.py), if it has one: this engine's
        # comm jobs then queue there, behind every other optimizer's, in submission order.
        self._issue_thread: Any = getattr(comm, "issue_thread", None)
        self._jobs: List[concurrent.futures.Future] = []  # this engine's jobs on a shared thread
        self._anchors = dict(device_anchors or {})
        self.stats = WireStats()
        self._failure: Optional[BaseException] = None
        # Set on the first failure; the comm thread then runs no further queued reduction (each
        # would wait a full timeout for a peer that is gone, and exit joins that thread).
        self._abort = threading.Event()
        self._replicas_agreed_at = 0
        self.behind = False  # the last flush() found ranks still training, blocked on this rank's share
        self._flag_at: Dict[str, Tuple[int, int]] = {}  # layout key -> (offset, length) of its last bucket
        prescale, postscale = config.scale_factors()
        self._flag_unit = prescale * postscale_factor(config.op, postscale, comm.size)
        self._own_inspector = inspector is None
        self.inspector = inspector if inspector is not None else StallInspector.for_comm(comm, config.name)
        self.inspector.step_begun(self._step - 1)  # starts its monitor where there is a board
        self.inspector.step_ended(self._step)
        # What every step asks, answered once (the step path stays in this file, issue 41): the
        # schedule's width and warm-up, the replica check's period, the world's size, and each
        # fusion layout's float32 ring bytes (_fp32_bytes); the inspector's status is written in place.
        self._width, self._warmup = config.width, config.warmup_steps
        self._replicas_every = config.check_replicas_every
        self._size = comm.size
        self._fp32_bytes: Dict[str, int] = {}
        self._status = self.inspector.status
        if check_ranks:
            check_pipeline_agrees(comm, config, codec.name, self.specs)

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

    @property
    def open_indices(self) -> Sequence[int]:
        """The spec indices the open step reduces (those that required grad when it began)."""
        if self._current is None:
            raise RuntimeError("no step is open")
        return self._current.layout.indices

    @property
    def missing_gradients(self) -> int:
        """How many of the open step's gradients have not been handed in yet."""
        cur = self._current
        return 0 if cur is None else len(cur.layout.indices) - len(cur.seen)

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
            self.inspector.failed(exc)  # the others' waits on this rank end at once, with its words
        self._abort.set()

    def _checked(self, check: Callable[[], None]) -> None:
        """Runs a cross-rank check; its error stops the pipeline (the ranks disagree)."""
        try:
            check()
        except BaseException as exc:
            self._fail(exc)
            raise

    # ------------------------------------------------------------------------------- the step
    def begin_step(self, active: Sequence[int], joined: bool = False) -> None:
        """Open a step over the gradients ``active`` (spec indices; those that require grad now).
        Issues no collective (it may run inside a backward hook). ``joined``: this rank has no
        data left and only takes part (with zeros) so that the others can go on (see
        :meth:`OptimizerCore.join`); its membership flag is 0."""
        self._raise_if_failed()
        if self._current is not None:
            raise RuntimeError("begin_step() called twice without end_step()")
        layout = self.layout_for(active)
        slot = self._step % self.config.width
        buffers = self._buffers.get((layout.key, slot))
        if buffers is None:
            last = len(layout.buckets) - 1
            buffers = [self._new_buffer(b, self._flag_at.get(layout.key) if b.index == last else None)
                       for b in layout.buckets]
            self._buffers[(layout.key, slot)] = buffers
        flags = self._flag_at.get(layout.key)
        if flags is not None:  # rewritten each step: a plain all-reduce sums in place
            size = self.comm.size
            self.ops.fill_(buffers[-1], flags[0], size, 0.0)
            if not joined:
                self.ops.fill_(buffers[-1], flags[0] + self.comm.rank, 1, 1.0)
        self._status.begun, self._status.thread = self._step + 1, threading.get_ident()  # inspector.step_begun
        self._current = _Step(self._step, layout, buffers, [0] * len(layout.buckets),
                              checked=layout.key in self._checked_sets, reductions=[None] * len(layout.buckets))
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
        self._close(cur, meta)
        width = 1 if cur.step < self._warmup else self._width  # schedule.width_at
        applied = []
        while len(self._queue) >= width:
            applied.append(self._finish(self._queue.popleft()))
        self._status.ended, self._status.since = self._step, time.monotonic()  # inspector.step_ended
        return applied

    def _close(self, cur: _Step, meta: Any) -> None:
        """Checks a tensor set the ranks have not agreed on yet (a collective, so here, from the
        training thread at the end of the step, never from a backward hook), launches the rest
        and queues the step."""
        if not cur.checked:
            self._checked(lambda: self._check_trainable_agree(cur.layout))
            self._checked_sets.add(cur.layout.key)
            cur.checked = True
        self._launch_ready(cur, force=True)
        cur.meta = meta
        self._queue.append(cur)
        self._current = None
        self._step += 1

    def flush(self, check_steps: bool = True) -> List[AppliedStep]:
        """Wait for every step in flight (ending an open one first) and return them, oldest first.

        First checks that every rank has run the same number of steps (a rank that ran more would
        wait forever for the others' share of its last reduction), and raises
        :class:`~pipesgd_hvd.pipeline.guards.StepCountMismatchError` on every rank if not. Where
        the transport has a status board (the pipeline channel) that check needs no collective:
        a rank that ran out of data and flushes while others still train, blocked on its share,
        is let through (:attr:`behind` is then True): its ``join()`` serves them. Otherwise it is
        a collective (call flush() on every rank). ``check_steps=False`` skips the check (at
        interpreter exit, where the other ranks may be gone)."""
        self._raise_if_failed()
        self.behind = False
        if check_steps:
            ended = self._step + (1 if self._current is not None else 0)
            if self.inspector.board is not None:
                self._checked(lambda: self._agree_at_flush(ended))
            else:
                with self.inspector.blocking(ended, "the step check of flush()"):
                    self._checked(lambda: check_steps_agree(self.comm, ended, "flush()"))
        if self._current is not None:
            self._close(self._current, None)
        applied = [self._finish(s) for s in self._queue]
        self._queue.clear()
        self.inspector.step_ended(self._step)
        return applied

    def drain(self) -> List[AppliedStep]:
        """Wait for every ended step in flight and return them, oldest first, without ending an
        open step and without the cross-rank check of :meth:`flush` (the caller's calls are in
        step on every rank: a staleness correction's call that reduces nothing of its own)."""
        self._raise_if_failed()
        applied = [self._finish(s) for s in self._queue]
        self._queue.clear()
        return applied

    def _agree_at_flush(self, ended: int) -> None:
        self.behind = self.inspector.agree_at_flush(ended) == "behind"

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
        self._stop_comm_thread(wait=False, cancel=True)
        self._current = None
        # Waits happen oldest first, so the finished steps are a prefix of the queue.
        self._queue = collections.deque(s for s in self._queue if s.grads is not None)
        self._failure = None
        try:
            return self.state_dict()  # no wait: every step left is finished
        finally:
            self._fail(RuntimeError("this pipeline was abandoned at a change of the Horovod world; "
                                    "the optimizer continues on a new one"))

    def close(self, wait: bool = True) -> None:
        """Stops the communication thread once its queued reductions are done (``wait=False``:
        without waiting for them here)."""
        # After a failure, queued reductions would only wait for a peer that is gone.
        failed = self._failure is not None
        self._stop_comm_thread(wait=wait and not failed, cancel=failed)

    def _stop_comm_thread(self, wait: bool, cancel: bool) -> None:
        """This engine's queued comm jobs are cancelled (``cancel``) or left to run, and waited
        for (``wait``). Its own thread is shut down; a shared issue thread serves the others on."""
        if self._worker is not None:
            self._worker.shutdown(wait=wait, cancel_futures=cancel)
            self._worker = None
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            if cancel:
                job.cancel()
        if wait:
            concurrent.futures.wait([j for j in jobs if not j.cancelled()])
        if self._own_inspector:
            self.inspector.close()

    # ------------------------------------------------------------------------- replica check
    def replica_check_due(self) -> bool:
        """Whether the open step is one where :meth:`check_replicas` runs (every
        ``check_replicas_every`` steps; the same answer on every rank)."""
        if not self._replicas_every:
            return False
        return bool(self.schedule.replica_check_due(self._step)) and self._replicas_agreed_at != self._step

    def check_replicas(self, named: Sequence[Tuple[str, Any]], joined: bool = False) -> None:
        """Collective: compares a checksum of each (name, host array) across ranks, and the step
        counts; raises :class:`~pipesgd_hvd.pipeline.guards.ReplicaDriftError` (or StepCountMismatchError)
        on every rank, naming the step and the first tensor that differs. ``joined``: this rank
        has joined (its weights stay behind until the broadcast after ``join()``): it takes part
        with its step count only, and the others' weights are compared among themselves."""
        self._raise_if_failed()
        with self.inspector.blocking(self._step, "the replica check"):
            self._checked(lambda: check_replicas(self.comm, self._step, named, self._replicas_agreed_at, joined=joined))
        self._replicas_agreed_at = self._step

    # ------------------------------------------------------------------------------- layouts
    def layout_for(self, active: Sequence[int]) -> FusionLayout:
        """The buckets for the tensors ``active`` (planned once per set; no collective)."""
        key = tuple(sorted(set(active)))
        layout = self._layouts.get(key)
        if layout is None:
            if not key:
                raise ValueError("no parameter requires a gradient: nothing to reduce")
            chosen = set(key)
            order = [i for i in self._ready_order if i in chosen]
            layout = plan_buckets(self.specs, order, self.config.fusion_threshold_bytes)
            self._layouts[key] = layout
            size = self.comm.size
            if size > 1:  # the membership flags ride with the step's last bucket
                self._flag_at[layout.key] = side_region(self.codec, layout.buckets[-1].numel, size, size)
        return layout

    def _check_trainable_agree(self, layout: FusionLayout) -> None:
        """Ranks that freeze different parameters would issue different collectives. Run for
        every new set, the full one too: a rank that froze something before step 0 is caught."""
        try:
            with self.inspector.blocking(self._step, "the check of the tensors that require grad"):
                check_ranks_agree(self.comm, {"tensors that require grad": [
                    (self.specs[i].name, tuple(self.specs[i].shape), self.specs[i].dtype) for i in layout.indices]},
                    f"{self.config.name}.trainable")
        except ValueError as exc:
            raise ValueError(f"{exc}; here: set requires_grad on the same parameters on every rank, at the same "
                             "step") from None

    def settings(self) -> List[Tuple[str, Any]]:
        return settings_entries(self.config, self.codec.name)

    def _like(self, bucket: Bucket) -> Any:
        return self._anchors.get(bucket.device)

    def _new_buffer(self, bucket: Bucket, flags: Optional[Tuple[int, int]] = None) -> Tensor:
        """A bucket's fusion buffer. A byte codec's float32 bucket gets the room its compressed
        all-reduce's rows take, zero past the gradients and never written there, so the bucket is
        encoded where it lies; without the room the all-reduce copies it into a padded one on
        every step, a whole pass over the gradient on the comm thread (compression/allreduce.py).
        ``flags``: (offset, length) of the membership flags this bucket carries (the step's last)."""
        length = bucket.numel
        if flags is not None:
            length = flags[1]
        elif not self.codec.summable and bucket.dtype == "float32":
            length = padded_numel(self.codec, bucket.numel, self.comm.size)
        buffer = self.ops.empty((length,), bucket.dtype, like=self._like(bucket))
        if length > bucket.numel:
            self.ops.fill_(buffer, bucket.numel, length - bucket.numel, 0.0)
        return buffer

    # ------------------------------------------------------------------------------ launching
    def _launch_ready(self, cur: _Step, force: bool) -> None:
        if not cur.checked:
            return  # nothing starts before the ranks agreed on the tensor set (end of the step)
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

    def _launch(self, cur: _Step, bucket: Bucket, flat: Tensor) -> Reduction:
        cfg, ops, codec, schedule = self.config, self.ops, self.codec, self.schedule
        prescale, postscale = cfg.scale_factors()
        name = schedule.op_name(cur.layout, bucket.index, schedule.slot_tag(cur.step))
        key = schedule.state_key(cur.layout, bucket.index)
        seed = schedule.seed(bucket.index, self.comm.rank, cur.step)
        flags = self._flag_at.get(cur.layout.key) if bucket.index == len(cur.layout.buckets) - 1 else None
        numel = flags[1] if flags is not None else bucket.numel  # flags: keep the rows side_region planned
        if codec.summable:  # a plain all-reduce, started now; waited for when the step is applied
            return reduce_bucket(ops, self.comm, codec, flat, name=name, key=key, seed=seed, op=cfg.op,
                                 prescale=prescale, postscale=postscale)

        # Byte codecs: encode, alltoall, sum, allgather, decode, all on the comm thread (on GPU on
        # its own stream of the bucket's device), so neither the codec work nor the blocking waits
        # hold up compute. Buffers crossing between the streams are recorded on the one that reads
        # them (ops/torch_cuda.py says why).
        marker = ops.ready_marker(flat)
        abort = self._abort
        comm = _AbortableComm(self.comm, abort)
        wrap: Callable[[Communicator], Communicator] = lambda c: _AbortableComm(c, abort)  # noqa: E731
        topology = self.topology.with_comms(wrap) if self.topology is not None else None

        def reduce() -> Tuple[Tensor, int]:
            # The padded buffer (_new_buffer) serves both: the hierarchical layout is the flat one's for N
            # ranks, so the membership flags' block (side_region) is a block of its own in either.
            if topology is not None:
                return hierarchical_allreduce(ops, topology, codec, flat, name=name, key=key, seed=seed, op=cfg.op,
                                              prescale=prescale, postscale=postscale, numel=numel,
                                              local_dtype=cfg.hierarchical)
            return compressed_allreduce(ops, comm, codec, flat, name=name, key=key, seed=seed, op=cfg.op,
                                        prescale=prescale, postscale=postscale, numel=numel)

        def job() -> Tuple[Tensor, int, Any]:
            if abort.is_set():
                raise RuntimeError(f"{name} was not started: an earlier reduction on this rank failed")
            try:
                with ops.stream_guard(flat):
                    ops.wait_marker(marker)
                    ops.record_use(flat)
                    out, sent = reduce()
                    return out, sent, ops.ready_marker(out)
            except BaseException:
                abort.set()  # before the main thread even sees it: the next queued job must not start
                raise

        future = self._submit(job)

        def wait() -> Tuple[Tensor, int]:
            out, sent, done = future.result()
            if done is not None:  # a device's stream (CUDA); nothing to order on the host
                ops.wait_marker(done)
                ops.record_use(out)
            return out, sent

        return Reduction(wait, done=future.done, future=future)

    def _submit(self, job: Callable[[], Any]) -> concurrent.futures.Future:
        """Runs ``job`` on the comm thread: the shared communicator's issue thread, or this engine's own."""
        if self._issue_thread is not None:
            future = self._issue_thread.submit(job)
            self._jobs = [j for j in self._jobs if not j.done()] + [future]
            return future
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pipesgd-comm")
        return self._worker.submit(job)

    def _finish(self, s: _Step) -> AppliedStep:
        if s.grads is None:
            grads: Dict[int, Tensor] = {}
            flags = self._flag_at.get(s.layout.key)
            last = len(s.layout.buckets) - 1
            owned = not self.codec.summable
            for bucket, reduction in zip(s.layout.buckets, s.reductions):
                assert reduction is not None
                flat, sent = self._wait(reduction, s, bucket.index)
                self.stats.bytes_sent += sent
                for m in bucket.members:  # views, as ops.view makes them (numpy and torch slice alike)
                    grads[m.index] = flat[m.offset:m.offset + m.numel].reshape(m.shape)
                if flags is not None and bucket.index == last:
                    # A byte codec's decoded bucket is never written again (past the gradients'
                    # views): its flags are read there; a fusion buffer is reused, so copied.
                    region = flat[flags[0]:flags[0] + self._size]
                    s.flags = region if owned else self.ops.new_state(region)
            fp32 = self._fp32_bytes.get(s.layout.key)
            if fp32 is None:
                fp32 = self._fp32_bytes[s.layout.key] = self.schedule.fp32_wire_bytes(s.layout, self._size)
            self.stats.fp32_bytes += fp32
            self.stats.steps += 1
            s.grads, s.reductions = grads, []
        # A byte codec's reduced bucket is its decode's new output, never a fusion buffer (a
        # summable codec reduces in the buffer itself, which the step after next refills).
        return AppliedStep(s.step, s.grads, s.meta, self._membership(s.flags), owned=not self.codec.summable)

    def _wait(self, reduction: Reduction, s: _Step, bucket: int) -> Tuple[Tensor, int]:
        """A reduction's result: at once where it is there (the usual case when the pipeline
        hides it), else through the stall inspector (no silent wait, a verdict on a lost peer);
        a failure stops the pipeline."""
        try:
            if reduction.done():
                try:
                    return reduction.wait()
                except BaseException:  # noqa: BLE001 - the inspector says why, with the board's words
                    pass
            return self.inspector.wait(reduction, s.step, bucket, "the reduction")
        except BaseException as exc:  # a lost peer, a timeout, a verdict, or an interrupt mid-wait
            self._fail(exc)
            raise

    def _membership(self, flags: Any) -> Optional[Callable[[], List[bool]]]:
        """Reads the reduced flags: a training rank's is ``flag_unit`` (1 times the scale factors),
        a joined rank's 0; "more than half" is robust to a cast's rounding of the unit."""
        if flags is None:
            return None
        ops, half = self.ops, 0.5 * self._flag_unit
        return lambda: [bool(v > half) for v in ops.host_array(flags).tolist()]

    # ------------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Dict[str, Any]:
        """Waits for the steps in flight and returns them reduced, with codec state and counters
        (the engine's part of the checkpoint format of :mod:`pipesgd_hvd.optimizer.checkpoint`).
        Tensors are copies: training may go on after the call."""
        if self._current is not None:
            raise RuntimeError("state_dict() was called between backward() and step(): call step() first, "
                               "so that the current gradients are part of the pipeline")
        return self.resumable_state()

    def resumable_state(self) -> Dict[str, Any]:
        """:meth:`state_dict` of the steps already ended (an open step is not part of it)."""
        self._raise_if_failed()
        in_flight = []
        for s in self._queue:
            applied = self._finish(s)
            in_flight.append({"step": s.step, "meta": s.meta,
                              "grads": {self.specs[i].name: self.ops.new_state(g) for i, g in applied.grads.items()}})
        codec_state = {k: _copy_tree(v, self.ops) for k, v in self.codec.state_dict().items()}
        return {"step": self._step, "settings": self.settings(), "in_flight": in_flight,
                "codec": codec_state, "stats": vars(self.stats).copy()}

    def resume_summary(self) -> Tuple[int, List[int], str]:
        """(steps ended, the steps in flight, a digest of their averaged gradients): equal on every
        rank that resumed from the same checkpoint (or started afresh). Waits for the steps in
        flight. Used once after construction or a load (see OptimizerCore)."""
        digest = hashlib.blake2b(digest_size=8)
        steps = []
        for s in self._queue:
            applied = self._finish(s)
            steps.append(s.step)
            for i in sorted(applied.grads):
                digest.update(checksum(self.ops.host_array(self.ops.read(applied.grads[i]))))
        return self._step, steps, digest.hexdigest()

    def adopt(self, state: Dict[str, Any]) -> None:
        """Takes over another rank's resumed state (its :meth:`state_dict`): its step count and its
        reduced in-flight steps; error-feedback residuals start afresh (they are that rank's
        own quantization errors). Allowed before anything was launched in the open step, which is
        numbered anew."""
        cur = self._current
        if cur is not None and any(r is not None for r in cur.reductions):
            raise RuntimeError("adopt() after reductions of the open step started")
        self._current, self._queue = None, collections.deque()
        self.load_state_dict({**state, "codec": {}})
        if cur is not None:
            cur.step = self._step
            self._current = cur

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Loads :meth:`state_dict`'s entries (the caller checked the settings)."""
        if self._current is not None or self._queue:
            raise RuntimeError("load_state_dict() with gradients in flight: load before training starts")
        by_name = {spec.name: i for i, spec in enumerate(self.specs)}
        self._queue.clear()
        for entry in state["in_flight"]:
            missing = [n for n in entry["grads"] if n not in by_name]
            if missing:
                raise ValueError(f"checkpoint holds in-flight gradients for unknown tensors {missing}")
            # Loaded with map_location="cpu" perhaps: each gradient goes back to its tensor's device.
            grads = {by_name[n]: self.ops.move_like(self.ops.new_state(g), self._anchors.get(self.specs[by_name[n]].device))
                     for n, g in entry["grads"].items()}
            layout = self.layout_for(list(grads))
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
