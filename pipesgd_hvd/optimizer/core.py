"""The pipelined optimizer's per-step policy for frameworks whose step runs in Python (PyTorch),
written once and framework-free: a framework plugs in through
:class:`~pipesgd_hvd.optimizer.framework.TrainingAdapter` and drives the steps itself, as Horovod's
optimizer does (``step -> synchronize -> the wrapped optimizer's step``).

Per call of ``step()``::

    adapter hooks  -> core.gradient_ready(i)        as each local gradient is produced
    framework      -> update = core.synchronize(s)  end the call's communication; the gradients to
                                                    apply now (the average of step t-K+1, as the
                                                    staleness correction hands it), or None
    framework      -> writes update's gradients, then
                      with core.updating(): the wrapped optimizer's step   (or core.no_update())

The framework asks its own tensors once per call (the loss scale ``s``) and passes the values
down; nothing here calls back into it in that steady state. Only the rarer paths (``flush()``,
``join()``, exit) ask the adapter to apply an update (:meth:`TrainingAdapter.apply`).

On top of :class:`~pipesgd_hvd.optimizer.lifecycle.Lifecycle` (the engine's life, auto mode,
checkpoint entry, elastic), the core owns the fill/apply bookkeeping (a call that has nothing to
apply yet, a GradScaler that skipped a step, older steps applied early when the width shrinks),
backward-pass counting, flush-and-apply, the moments at which the staleness correction
(:class:`~pipesgd_hvd.staleness.correction.Correction`) is called, and what happens at exit.
"""
from __future__ import annotations

import contextlib
import copy
import os
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence

from ..comm.base import Communicator, exit_if_stuck
from ..compression.codecs import Codec
from ..ops.base import Tensor
from ..pipeline.config import PipelineConfig
from ..pipeline.engine import AppliedStep, PipelineEngine
from ..pipeline.stall import StallInspector
from ..staleness.correction import Call, Correction, Grads
from . import checkpoint
from .framework import TrainingAdapter
from .elastic_rule import is_elastic_job
from .lifecycle import Lifecycle, call_at_exit
from .options import OptimizerOptions


@dataclass
class Update:
    """The gradients one update applies: ``grads`` by tensor index (a tensor missing: no
    gradient), to be multiplied by ``scale`` (the float 1.0, a float, or a 0-d tensor: the ratio
    of loss scales, now over when they were computed) as they are written. ``owned``: their
    memory is the framework's now (see :class:`~pipesgd_hvd.pipeline.engine.AppliedStep`)."""

    grads: Dict[int, Tensor]
    scale: Any = 1.0
    owned: bool = False


def _dropped(held: List[Any], adapter: TrainingAdapter) -> None:
    engine = held[0]
    steps = engine.in_flight + (1 if engine.step_open else 0)
    if steps and engine.failure is None:
        warnings.warn(f"pipesgd_hvd: a DistributedOptimizer was dropped with {steps} step(s) in flight; their "
                      "averaged gradients were never applied (on any rank). Call optimizer.flush() before dropping "
                      "an optimizer")
    adapter.unwatch_gradients()
    engine.close(wait=False)  # the garbage collector may run this on any thread: never block it
    engine.inspector.close()  # its monitor thread ends at its next tick


def end_process(message: str) -> None:
    """Prints ``message`` and ends the process with status 1 at once (at interpreter exit, where
    nothing can be raised any more; the transport's own shutdown is skipped: the ranks it would
    wait for are stopping with an error)."""
    sys.stdout.flush()
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(1)


# Horovod's own words (horovod/torch/optimizer.py), which code written for Horovod may filter on.
SYNCHRONIZE_THEN_STEP = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                         "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                         "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


class OptimizerCore(Lifecycle):
    """One pipelined optimizer's state and per-step policy (see the module docstring)."""

    eager_steps = True

    def __init__(self, options: OptimizerOptions, names: Sequence[str], adapter: TrainingAdapter,
                 comm: Communicator, comm_factory: Optional[Callable[[], Communicator]] = None) -> None:
        self.adapter = adapter
        self._inspector: Optional[StallInspector] = None  # one per transport, kept across engines
        super().__init__(options, names, comm, adapter, comm_factory)
        self._passes = [0] * len(self.names)
        self._call_open = False          # a gradient of this call arrived (its hooks ran)
        self._handed: set = set()        # tensors whose gradient this call handed in
        self._feeds = True               # this call hands its gradients to the pipeline
        self._synchronized = False       # synchronize() ran; step() has not
        self._apply_pending = False      # synchronize() prepared an update that step() must run
        self._call: Optional[Call] = None  # the correction's view of the synchronized call
        self.should_synchronize = True   # False inside skip_synchronize()
        self._resume_checked = False     # the ranks compared their pipeline state since the last load
        self._last_membership: Optional[Callable[[], List[bool]]] = None  # of the latest step applied
        self._agreed_at: Optional[int] = None  # steps ended at the last flush() every rank agreed on
        self._watched: Sequence[int] = ()  # the tensors whose gradients the hooks report
        adapter.watch_gradients(self.gradient_ready)
        # Nothing computed is lost: gradients still in flight when the interpreter exits are applied.
        call_at_exit(self, OptimizerCore.finish_at_exit)
        # An optimizer dropped with steps in flight: every rank drops it at the same point of the
        # program, after issuing the same reductions, so they complete on their own and are
        # abandoned alike everywhere; say so, and stop its hooks.
        weakref.finalize(self, _dropped, self._held, adapter).atexit = False

    def build_engine(self, config: PipelineConfig, codec: Codec, *, first_step: int,
                       check_ranks: bool) -> PipelineEngine:
        return PipelineEngine(self.adapter.tensor_specs(), ops=self.adapter.ops, comm=self.comm, codec=codec,
                              config=config, device_anchors=self.adapter.device_anchors(), first_step=first_step,
                              check_ranks=check_ranks, inspector=self.inspector,
                              topology=self.topology if config.hierarchical else None)

    @property
    def inspector(self) -> StallInspector:
        """The stall inspector of this optimizer's transport (a new one when the transport is
        rebuilt, at a Horovod elastic reset); the auto mode's engines share it."""
        if self._inspector is None or self._inspector.comm is not self.comm:
            if self._inspector is not None:
                self._inspector.close()
            self._inspector = StallInspector.for_comm(self.comm, self.name)
        return self._inspector

    def check_tensors_can_change(self) -> None:
        """Raises once training has started: the tensor list is fixed from the first step on."""
        if self.engine.step > 0 or self.engine.step_open or self._call_open:
            raise RuntimeError("add_param_group() after training started is not supported by pipesgd_hvd: add all "
                               "parameter groups before the first step, and freeze or unfreeze parameters with "
                               "requires_grad instead")

    def tensors_changed(self, names: Sequence[str]) -> None:
        """The tensor list changed (a parameter group was added) before training started:
        build the pipeline again over ``names``. Collective (the cross-rank check)."""
        self.check_tensors_can_change()
        self.names = list(names)
        self._passes = [0] * len(self.names)
        self.rebuild()
        self.adapter.watch_gradients(self.gradient_ready)
        self._watched = ()

    # ------------------------------------------------------------------------ the step itself
    def gradient_ready(self, index: int) -> None:
        """Tensor ``index``'s local gradient was produced (a backward-pass hook). Issues no
        collective, so it may run inside the framework's backward pass."""
        if not self._call_open:
            self._open_call()
        passes = self._passes[index] + 1
        if passes > self.options.backward_passes_per_step:
            raise RuntimeError(f"gradients of '{self.names[index]}' were computed more than "
                               f"backward_passes_per_step={self.options.backward_passes_per_step} times before "
                               "step(); increase backward_passes_per_step to accumulate gradients locally")
        self._passes[index] = passes
        if passes == self.options.backward_passes_per_step:
            self._hand_in(index, self.adapter.local_gradient(index))

    def _open_call(self) -> None:
        """The call's first gradient: a synchronized call whose step() never came was skipped
        (GradScaler.step() skips optimizer.step() when the gradient, identical on every rank or
        this rank's own, is not finite); the correction says where this call's gradients go."""
        if self._synchronized:
            self._synchronized = self._apply_pending = False
            if self._call is not None:
                with self.adapter.weights_guard():
                    self.correction.update_skipped(self._call)
                self._call = None
        self._call_open = True
        self._handed = set()
        correction = self.correction
        self._feeds = bool(correction.feeds())
        if correction.transforms_input:
            correction.begin_call(self.adapter.loss_scale())

    def _hand_in(self, index: int, grad: Tensor) -> None:
        self._handed.add(index)
        correction = self.correction
        if correction.transforms_input:
            with self.adapter.weights_guard():
                grad = correction.local_(index, grad)
        if self._feeds:
            engine = self.engine
            if not engine.step_open:
                engine.begin_step(self.adapter.trainable())
            engine.add_gradient_(index, grad)

    def synchronize(self, loss_scale: Any = None) -> Optional[Update]:
        """End this call's communication and return the update to apply now (None: nothing
        while the pipeline fills; the framework writes zero gradients then, and step() applies
        nothing). ``loss_scale``: the AMP loss scale now (None without one), read by the
        framework once per call. Calling it again before step() returns None."""
        if self._synchronized:
            return None
        if self.auto_controller is not None:
            self.auto_controller.reduction_started()
        engine = self.engine
        if engine.replica_check_due():  # the real weights after the previous update, on every rank
            with self.real_weights():
                engine.check_replicas(self.adapter.replica_fingerprints())
        if not self._call_open:
            trainable = self.adapter.trainable()
            if not any(self.adapter.has_local_gradient(i) for i in trainable):
                raise RuntimeError("step()/synchronize() was called without a backward pass since the last step: "
                                   "call loss.backward() before every step() on every rank (to skip a batch, skip "
                                   "both on all ranks)")
            self._open_call()
        self._hand_in_missing(engine)
        self._passes = [0] * len(self.names)
        if not self._resume_checked:
            self._agree_on_resumed_state()
        this_step = engine.step
        if self._feeds:
            applied = engine.end_step(meta=loss_scale)
        else:
            applied = engine.drain() if self.correction.takes() else []
        self._call_open = False
        if self.auto_controller is not None:  # at a check: flushed steps to apply; maybe a new engine
            applied = applied + self.auto_controller.after_step(engine, applied)
        if applied and applied[-1].membership is not None:
            self._last_membership = applied[-1].membership
        for early in applied[:-1]:  # only when the width shrinks: apply older steps right away
            self.adapter.apply(self._settled(early, loss_scale), False)
        last = applied[-1] if applied else None
        pipelined = self._feeds and (last is None or last.step != this_step)
        call = Call(step=this_step, stale=last is not None and last.step != this_step,
                    stale_step=last.step if last is not None else this_step, applies=last is not None,
                    pipelined=pipelined, local=self._local_gradients() if self.correction.needs_local else None,
                    loss_scaled=loss_scale is not None)
        self._call = call
        self._synchronized = True
        if type(self.correction) is Correction:  # the identity: the pipeline's average, as it is
            self._apply_pending = last is not None
            return None if last is None else Update(last.grads, self._ratio(last, loss_scale), owned=last.owned)
        grads: Grads = [None] * len(self.names) if last is None else [last.grads.get(i) for i in range(len(self.names))]
        with self.adapter.weights_guard():
            grads, applies = self.correction.before_update(call, grads)
        self._apply_pending = bool(applies)
        if not self._apply_pending:
            return None
        if last is not None and all(g is last.grads.get(i) for i, g in enumerate(grads)):
            return Update(last.grads, self._ratio(last, loss_scale), owned=last.owned)
        return Update({i: g for i, g in enumerate(grads) if g is not None}, self._ratio(last, loss_scale))

    def _hand_in_missing(self, engine: PipelineEngine) -> None:
        """Gradients whose hook did not fire (set by hand, or a tensor unfrozen since the hooks
        were registered) are taken as they are, as Horovod's synchronize() does; a correction
        may hand in what it kept of an earlier call for a tensor without a gradient in this one."""
        if self._feeds and not engine.step_open:
            engine.begin_step(self.adapter.trainable())
        if self._feeds:
            trainable = engine.open_indices
        elif self._watched and self._handed.issuperset(self._watched):
            trainable = self._watched  # every watched tensor reported: nothing to ask the framework
        else:
            trainable = tuple(self.adapter.trainable())
        if len(self._handed) < len(trainable):
            for i in trainable:
                if i in self._handed:
                    continue
                if self.adapter.has_local_gradient(i):
                    self._hand_in(i, self.adapter.local_gradient(i))
                elif self._feeds and self.correction.transforms_input:
                    kept = self.correction.kept_gradient(i)
                    if kept is not None:
                        engine.add_gradient_(i, kept)
        if tuple(trainable) != tuple(self._watched):  # tensors unfrozen since: their hooks start now
            self.adapter.watch_gradients(self.gradient_ready)
            self._watched = tuple(trainable)

    def _local_gradients(self) -> Grads:
        adapter = self.adapter
        trainable = set(adapter.trainable())
        return [adapter.local_gradient(i) if i in trainable and adapter.has_local_gradient(i) else None
                for i in range(len(self.names))]

    @staticmethod
    def _ratio(applied: Optional[AppliedStep], scale_now: Any) -> Any:
        """The ratio of loss scales a step's gradients are multiplied by (1.0 without a scale);
        floats, or device tensors divided on the device (no sync)."""
        if applied is None or applied.meta is None or scale_now is None:
            return 1.0
        return scale_now / applied.meta

    def _settled(self, applied: AppliedStep, scale_now: Any) -> Update:
        """An in-flight step applied on its own (flush, or older steps when the width shrinks)."""
        with self.adapter.weights_guard():
            grads = self.correction.settle([applied.grads.get(i) for i in range(len(self.names))], applied.step)
        if all(g is applied.grads.get(i) for i, g in enumerate(grads)):
            return Update(applied.grads, self._ratio(applied, scale_now), owned=applied.owned)
        return Update({i: g for i, g in enumerate(grads) if g is not None}, self._ratio(applied, scale_now))

    @property
    def synchronized(self) -> bool:
        return self._synchronized

    @property
    def apply_pending(self) -> bool:
        """synchronize() prepared an update that step() has not run yet."""
        return self._apply_pending

    def updating(self) -> ContextManager[Any]:
        """Wraps the wrapped optimizer's step of the synchronized call: the correction's
        moments around it, and the call is over afterwards. Yields None, or the stateless step
        to run instead of the ordinary one (an update that leaves the optimizer's state alone)."""
        if not self._synchronized:
            raise RuntimeError("step() inside skip_synchronize() needs optimizer.synchronize() first")
        return self._updating(self._call)

    @contextlib.contextmanager
    def _updating(self, call: Optional[Call]) -> Iterator[Any]:
        """Yields the framework's stateless step where this update must leave the optimizer's
        state alone (the framework runs it instead of the ordinary step),
        else None."""
        self._synchronized = self._apply_pending = False
        self._call = None
        correction = self.correction
        if call is None or type(correction) is Correction:  # nothing to wrap
            yield None
            return
        with self.adapter.weights_guard():
            wrapper = correction.around_update(call)
        with wrapper as stateless:
            yield stateless
        with self.adapter.weights_guard():
            correction.after_update(call)

    def no_update(self) -> None:
        """step() after a synchronize() that prepared nothing (the pipeline fills): the call is
        over; the correction still takes its moment after the update."""
        call, self._call = self._call, None
        self._synchronized = self._apply_pending = False
        if call is not None:
            with self.adapter.weights_guard():
                self.correction.after_update(call)

    def is_state_initialization(self) -> bool:
        """True for the step() with which ``hvd.broadcast_optimizer_state`` makes an optimizer
        without state create it: no backward pass since the last step, every gradient zero (it
        sets them), the wrapped optimizer's state empty (it calls step() only then). Any rank may
        make this call alone (one that loaded a checkpoint has state and does not), and zero
        gradients give the same result on every rank that makes it, so it runs locally."""
        if self._call_open or self._synchronized or self.engine.step_open or self.adapter.optimizer_has_state():
            return False
        return self.adapter.gradients_all_zero()

    def check_step(self, closure: Optional[Callable[[], Any]]) -> None:
        """What ``step()`` refuses before it synchronizes."""
        if self.should_synchronize and self._synchronized:
            warnings.warn(SYNCHRONIZE_THEN_STEP)
        if closure is not None and self.engine.config.width > 1:
            raise ValueError("step(closure) re-evaluates the loss, which a pipelined optimizer cannot do; "
                             "compute the loss before step(), or use width=1")
        if not self.should_synchronize and not self._synchronized:
            raise RuntimeError("step() inside skip_synchronize() needs optimizer.synchronize() first")

    def _agree_on_resumed_state(self) -> None:
        """At the first step after construction or a load (collective; the open step has launched
        nothing yet): the ranks compare their pipeline state. Ranks that started afresh next to
        ranks that loaded one checkpoint (Horovod's pattern: load on rank 0, then
        broadcast_parameters / broadcast_optimizer_state) take the loaded state: its step count and
        its averaged in-flight gradients, so every rank applies the same; anything else is ranks
        resumed from different checkpoints, an error on every rank."""
        engine = self.engine
        summaries = self.comm.allgather_object(engine.resume_summary(), f"{self.name}.resume")
        self._resume_checked = True
        if all(s == summaries[0] for s in summaries):
            return
        fresh = [r for r, (step, in_flight, _) in enumerate(summaries) if step == 0 and not in_flight]
        loaded = [r for r in range(len(summaries)) if r not in fresh]
        if self.correction.per_rank_state and fresh:
            raise ValueError(f"staleness_correction={self.correction.name!r} keeps per-rank state of the steps in "
                             "flight, which ranks that did not load the checkpoint lack: load the same checkpoint "
                             "on every rank")
        if not fresh or any(summaries[r] != summaries[loaded[0]] for r in loaded):
            states = ", ".join(f"rank {r}: step {s}, in flight {f}" for r, (s, f, _) in enumerate(summaries))
            raise ValueError(f"ranks resumed from different checkpoints ({states}): load the same checkpoint on "
                             "every rank, or on one rank only before the first step (the others then take its "
                             "pipeline state)")
        source = loaded[0]
        state = engine.resumable_state() if self.comm.rank == source else None
        state = self.comm.allgather_object(state, f"{self.name}.resume.state")[source]
        if self.comm.rank in fresh:
            engine.adopt(state)

    # ------------------------------------------------------------------------ flush and join
    def flush(self, check_steps: bool = True) -> int:
        """Apply every gradient still in flight (call once training ends, on every rank); returns
        how many steps. Collective: first checks that every rank ran the same number of steps.
        With a loss scale, gradients are unscaled here and a non-finite one is skipped."""
        engine = self.engine
        in_flight = engine.flush(check_steps=check_steps)  # checks the ranks agree before it waits
        agreed = check_steps and not engine.behind  # every rank flushed here
        if in_flight and in_flight[-1].membership is not None:
            self._last_membership = in_flight[-1].membership
        applied_count = 0
        if self._apply_pending:  # synchronize() ran, step() not yet: that update first (written)
            with self._updating(self._call) as stateless:
                self.adapter.apply(None, False, stateless)
            applied_count += 1
        elif self._synchronized:
            self.no_update()
        with self.adapter.weights_guard():
            self.correction.before_flush()
        checked = self.adapter.loss_scale() is not None
        for applied in in_flight:
            if self.adapter.apply(self._settled(applied, 1.0), checked):
                applied_count += 1
        kept = self.correction.pending()
        if kept is not None:  # a part of an update nothing reduces yet: an update of its own
            applied_count += self._reduce_and_apply(kept, checked)
        with self.adapter.weights_guard():
            self.correction.flushed()
        if agreed:
            self._agreed_at = self.engine.step  # nobody needs this rank's later share
        self._passes = [0] * len(self.names)
        return applied_count

    def _reduce_and_apply(self, grads: Grads, checked: bool) -> int:
        """Reduces ``grads`` (every rank holds such a part: the correction's pairs are in step)
        synchronously, and applies the average as an update of its own."""
        engine = self.engine
        engine.begin_step([i for i, g in enumerate(grads) if g is not None] or self.adapter.trainable())
        for i, g in enumerate(grads):
            if g is not None:
                engine.add_gradient_(i, g)
        steps = engine.end_step() + engine.drain()  # in warm-up end_step() returns it already
        return sum(1 for s in steps if self.adapter.apply(Update(s.grads, owned=s.owned), checked))

    def join(self, outer_join: Optional[Callable[[], Any]] = None) -> int:
        """This rank has no data left (uneven data per rank), as ``hvd.join()`` in Horovod: apply
        what is in flight (every rank issued those reductions), then take part in the others'
        remaining steps with zero gradients, applying nothing, until every rank has joined; the
        others' averages still divide by the number of ranks, as with Horovod's join. Returns the
        rank that joined last (broadcast the model from it, as Horovod's documentation says).
        The pipeline then refills at the next step. ``outer_join``: starts the transport's own
        join (Horovod's, for the user's own collectives) and returns a handle waited for at the end.

        Who still trains rides with each step's last bucket (the engine's membership flags). The
        collectives a training rank runs between steps run here too, at the same steps: the replica
        check (``check_replicas_every``; this rank's weights, which no longer follow the others',
        are left out of the comparison) and the auto mode's checks (``width``/``compression=
        "auto"``: measurements, timed reductions, and a rebuilt engine if the choice changes).
        Works after ``flush()`` too."""
        if self._apply_pending or self.engine.step_open:
            raise RuntimeError("join() between backward() and step(): call step() first")
        self.flush(check_steps=False)
        self.inspector.set_phase("join", joined_at=self.engine.step)
        try:
            pending = outer_join() if outer_join is not None else None
            active = self.adapter.trainable()
            while self.comm.size > 1:
                engine = self.engine
                if engine.replica_check_due():
                    engine.check_replicas(self.adapter.replica_fingerprints(), joined=True)
                if self.auto_controller is not None:
                    self.auto_controller.reduction_started()
                engine.begin_step(active, joined=True)
                done = engine.end_step()
                if self.auto_controller is not None:  # a check: flushed steps, maybe a new engine
                    done = done + self.auto_controller.after_step(engine, done)
                done = done + self.engine.flush(check_steps=False)  # this step's flags: who still trains
                if not any(done[-1].training() or []):
                    break
                if done[-1].membership is not None:
                    self._last_membership = done[-1].membership
            if pending is not None:
                pending.wait()
        finally:
            self.inspector.set_phase("train")
        self._agreed_at = self.engine.step  # every rank has joined: nobody needs this rank's share
        # The last to join: those training at the latest step anyone trained (the same step, hence
        # the same answer, on every rank).
        training = self._last_membership() if self._last_membership is not None else None
        return max(r for r, t in enumerate(training) if t) if training and any(training) else self.comm.rank

    # ------------------------------------------------------------------------ real weights
    @contextlib.contextmanager
    def real_weights(self) -> Iterator[None]:
        """The real weights inside the block, and after it again the weights the correction keeps
        in the model between calls, bit for bit."""
        with self.adapter.weights_guard():
            token = self.correction.show_real()
        try:
            yield
        finally:
            if token is not None:
                with self.adapter.weights_guard():
                    self.correction.show_back(token)

    # ------------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Dict[str, Any]:
        """The checkpoint entry (:mod:`pipesgd_hvd.optimizer.checkpoint`): waits for the steps in flight."""
        if self._apply_pending:
            raise RuntimeError("state_dict() between synchronize() and step(): call step() first")
        return self.compose_state()

    def load_state_dict(self, entry: Optional[Dict[str, Any]]) -> None:
        """Loads an entry (format 2, as :func:`checkpoint.read` returns it; None: the checkpoint
        has none), after the wrapped optimizer's state and the model's weights were loaded."""
        if entry is not None:
            self.load_entry(entry)
            self._resume_checked = False
        self.load_correction(entry)

    # -------------------------------------------------------------------- Horovod elastic
    # Called through the framework's elastic state handler; the rule is pipesgd_hvd/optimizer/elastic_rule.py's.
    def elastic_restore(self, committed: Dict[str, Any]) -> None:  # type: ignore[override]
        """After HorovodInternalError: back to the last commit (the framework's state dict)."""
        # A copy: the framework's load may keep the given tensors, and training would then change
        # the commit in place before the next restore.
        entry, rest = checkpoint.read(copy.deepcopy(committed))
        self._reset_step_flags()
        self.adapter.load_optimizer_state_dict(rest)
        super().elastic_restore(entry)
        self.load_correction(entry)

    def elastic_sync(self) -> None:  # type: ignore[override]
        self._reset_step_flags()
        super().elastic_sync(self.adapter.optimizer_state_dict, self.adapter.load_optimizer_state_dict)
        self._resume_checked = True  # every rank took rank 0's state

    def _reset_step_flags(self) -> None:
        self._synchronized = self._apply_pending = self._call_open = False
        self._call = None
        self._passes = [0] * len(self.names)

    # ------------------------------------------------------------------------------ exit
    def finish_at_exit(self) -> None:
        """At interpreter exit: apply what is in flight (nothing computed is lost), or, after a
        failure, make sure the transport's own shutdown cannot keep the process alive."""
        engine = self.engine
        if engine.failure is None and (engine.in_flight or self._apply_pending or self.correction.pending() is not None):
            try:  # no step-count check: other ranks may be gone already
                count = self.flush(check_steps=False)
                warnings.warn(f"pipesgd_hvd: applied {count} in-flight step(s) at exit; call optimizer.flush() "
                              "when training ends, before saving the model")
            except Exception as exc:  # the transport may already be gone at exit
                warnings.warn(f"pipesgd_hvd: could not apply in-flight gradients at exit: {exc}")
        board = self.inspector.board
        if engine.failure is None and self._agreed_at != engine.step and board is not None and board.process_exit \
                and not is_elastic_job():
            # Did this rank leave while others still need its share (no join() with uneven data)?
            # They are told first; then this rank says so and ends with status 1.
            message = self.inspector.check_at_exit(engine.step)
            if message is not None:
                end_process(f"pipesgd_hvd: error: {message}")
        if engine.failure is not None:
            # Nothing can be applied consistently; the transport's shutdown (run after this
            # handler: Horovod registered its handler earlier) must not keep the process alive.
            exit_if_stuck(f"the pipeline stopped at {type(engine.failure).__name__}")
        engine.close()
        self.inspector.close()
        self.close_comm(at_exit=True)
