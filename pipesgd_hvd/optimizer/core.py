"""The pipelined optimizer's per-step policy for frameworks whose step runs in Python (PyTorch),
written once and framework-free: a framework plugs in through
:class:`~pipesgd_hvd.optimizer.adapter.TrainingAdapter`.

Per step::

    adapter hooks  -> core.gradient_ready(i)    as each local gradient is produced (backward pass)
    user / adapter -> core.synchronize()         end the step's communication; the gradient to
                                                 apply now (step t-K+1's average) is written
    user / adapter -> core.step(closure)         run the wrapped optimizer's update on it, or
                                                 nothing while the pipeline fills

On top of :class:`~pipesgd_hvd.optimizer.lifecycle.PipelineLifecycle` (the engine's life, auto mode,
checkpoint entry, elastic), the core owns the fill/apply bookkeeping (a step that has nothing
to apply yet, a GradScaler that skipped a step, older steps applied early when the width
shrinks), backward-pass counting, flush-and-apply, the sequencing of weight prediction around
the update, and what happens at interpreter exit.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys
import warnings
import weakref
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Sequence

from ..comm.base import Communicator, exit_if_stuck
from ..compression.codecs import Codec
from ..ops.base import Tensor
from ..pipeline.config import PipelineConfig
from ..pipeline.engine import AppliedStep, PipelineEngine
from ..pipeline.stall import StallInspector
from . import checkpoint
from .adapter import TrainingAdapter
from .elastic import is_elastic_job
from .lifecycle import PipelineLifecycle, call_at_exit
from .options import PipelineOptions


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


class OptimizerCore(PipelineLifecycle):
    """One pipelined optimizer's state and per-step policy (see the module docstring)."""

    eager_steps = True

    def __init__(self, options: PipelineOptions, names: Sequence[str], adapter: TrainingAdapter,
                 comm: Communicator, comm_factory: Optional[Callable[[], Communicator]] = None) -> None:
        self.adapter = adapter
        self._inspector: Optional[StallInspector] = None  # one per transport, kept across engines
        super().__init__(options, names, comm, adapter, comm_factory)
        self._weights_predicted = False  # the tensors hold the prediction, not the real weights
        self._passes = [0] * len(self.names)
        self._synchronized = False       # synchronize() ran; step() has not
        self._apply_pending = False      # synchronize() wrote a gradient that step() must apply
        self._stepped = False            # a pipelined step has happened
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

    def build_pipeline(self, config: PipelineConfig, codec: Codec, *, first_step: int,
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

    @property
    def engine(self) -> PipelineEngine:
        return self.pipeline  # type: ignore[return-value]

    def check_tensors_can_change(self) -> None:
        """Raises once training has started: the tensor list is fixed from the first step on."""
        if self.engine.step > 0 or self.engine.step_open:
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
        engine = self.engine  # (a post-accumulate hook: the tensor has its gradient)
        if not engine.step_open:
            if self._synchronized:
                # The last synchronized step was never applied: GradScaler.step() skips
                # optimizer.step() when the (identical on every rank) gradient is not finite.
                self._synchronized = self._apply_pending = False
            engine.begin_step(self.adapter.trainable())
        passes = self._passes[index] + 1
        if passes > self.options.backward_passes_per_step:
            raise RuntimeError(f"gradients of '{self.names[index]}' were computed more than "
                               f"backward_passes_per_step={self.options.backward_passes_per_step} times before "
                               "step(); increase backward_passes_per_step to accumulate gradients locally")
        self._passes[index] = passes
        if passes == self.options.backward_passes_per_step:
            engine.add_gradient_(index, self.adapter.local_gradient(index))

    def synchronize(self) -> None:
        """End this step's communication and write the gradient to apply now: the average of step
        t-K+1 (zeros while the pipeline fills; step() then applies nothing)."""
        if self._synchronized:
            return
        if self.auto_controller is not None:
            self.auto_controller.reduction_started()
        engine = self.engine
        if engine.replica_check_due():  # weights after the previous step's update, on every rank
            engine.check_replicas(self.adapter.replica_fingerprints())
        if not engine.step_open:
            trainable = self.adapter.trainable()
            if not any(self.adapter.has_local_gradient(i) for i in trainable):
                raise RuntimeError("step()/synchronize() was called without a backward pass since the last step: "
                                   "call loss.backward() before every step() on every rank (to skip a batch, skip "
                                   "both on all ranks)")
            engine.begin_step(trainable)
        trainable = engine.open_indices
        if engine.missing_gradients:
            # Gradients whose hook did not fire (set by hand, or a tensor unfrozen since the hooks
            # were registered) are taken as they are, as Horovod's synchronize() does.
            for i in trainable:
                if not engine.has_gradient(i) and self.adapter.has_local_gradient(i):
                    engine.add_gradient_(i, self.adapter.local_gradient(i))
        self._passes = [0] * len(self.names)
        if trainable != self._watched:  # tensors unfrozen since: their hooks start now
            self.adapter.watch_gradients(self.gradient_ready)
            self._watched = trainable
        if not self._resume_checked:
            self._agree_on_resumed_state()
        this_step = engine.step
        scale = self.adapter.loss_scale()  # read once: the step's meta and the rescale of older steps
        applied = engine.end_step(meta=scale)
        if self.auto_controller is not None:  # at a check: flushed steps to apply; maybe a new engine
            applied = applied + self.auto_controller.after_step(engine, applied)
        self._note_training(applied)
        self._restore_real_weights()  # the gradients were computed at the prediction: update the real weights
        if self.correction is not None:  # before _write: .grad still holds this step's local gradients
            applied = self._corrected(this_step, applied)
        if self.split is not None and applied:  # a real step writes theta_t back first
            with self.adapter.weights_guard():
                last = applied[-1]
                applied[-1] = self._with_grads(last, self.split.gradients(
                    self._grad_list(last), self.adapter.weights(), stale=last.step != this_step))
        for early in applied[:-1]:  # only when the width shrinks: apply older steps right away
            self._write(early, scale)
            self.adapter.apply_update()
        self._apply_pending = bool(applied)
        if applied:
            self._write(applied[-1], scale)
        else:
            # Nothing to apply while the pipeline fills: zero gradients (not None, so that code run
            # between synchronize() and step(), e.g. GradScaler.unscale_, sees finite gradients);
            # step() will not run the wrapped optimizer on them.
            self.adapter.zero_gradients()
        self._synchronized = True
        self._stepped = True

    @property
    def synchronized(self) -> bool:
        return self._synchronized

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """``optimizer.step()``: synchronize (unless inside skip_synchronize), then the wrapped
        optimizer's update on the averaged gradient, or nothing while the pipeline fills."""
        if self.is_state_initialization():
            return self.adapter.apply_update(closure)
        if self.should_synchronize and self._synchronized:
            warnings.warn(SYNCHRONIZE_THEN_STEP)
        if closure is not None and self.engine.config.width > 1:
            raise ValueError("step(closure) re-evaluates the loss, which a pipelined optimizer cannot do; "
                             "compute the loss before step(), or use width=1")
        if self.should_synchronize:
            self.synchronize()
        elif not self._synchronized:
            raise RuntimeError("step() inside skip_synchronize() needs optimizer.synchronize() first")
        self._synchronized = False
        self._restore_real_weights()  # done by synchronize() already; a no-op then
        if not self._apply_pending:
            self._predict_weights()  # a fill step updates nothing, but the prediction starts here
            return None
        self._apply_pending = False
        with self._around_update():
            loss = self.adapter.apply_update(closure)
        self._predict_weights()
        return loss

    def _around_update(self) -> ContextManager[Any]:
        """The split-batch rule's virtual update is undone on the optimizer's state."""
        return self.split.around_update() if self.split is not None else contextlib.nullcontext()

    def is_state_initialization(self) -> bool:
        """True for the step() with which ``hvd.broadcast_optimizer_state`` makes an optimizer
        without state create it: no backward pass since the last step, every gradient zero (it
        sets them), the wrapped optimizer's state empty (it calls step() only then). Any rank may
        make this call alone (one that loaded a checkpoint has state and does not), and zero
        gradients give the same result on every rank that makes it, so it runs locally."""
        if self.engine.step_open or self._synchronized or self.adapter.optimizer_has_state():
            return False
        return self.adapter.gradients_all_zero()

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
        if self.correction is not None and fresh:
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
        self._stepped = True

    def _write(self, applied: AppliedStep, scale_now: Any) -> None:
        """The gradients of ``applied``, rescaled by the ratio of loss scales (``scale_now`` / the
        scale they were computed with; ``scale_now`` 1.0: the caller wants them unscaled)."""
        ratio: Any = 1.0
        if applied.meta is not None:  # floats, or device tensors divided on the device (no sync)
            ratio = scale_now / applied.meta
        self.adapter.write_gradients(applied.grads, ratio, owned=applied.owned)

    def flush(self, check_steps: bool = True) -> int:
        """Apply every gradient still in flight (call once training ends, on every rank); returns
        how many steps. Collective: first checks that every rank ran the same number of steps.
        With a loss scale, gradients are unscaled here and a non-finite one is skipped."""
        in_flight = self.engine.flush(check_steps=check_steps)  # checks the ranks agree before it waits
        if check_steps and not self.engine.behind:
            self._agreed_at = self.engine.step  # every rank flushed here: nobody needs this rank's later share
        self._note_training(in_flight)
        if self.prediction is not None:  # the real weights first; prediction starts afresh next step
            with self.adapter.weights_guard():
                if self._weights_predicted:
                    self.prediction.reset(self.adapter.weights())
                else:  # restored by synchronize(), perhaps updated since: leave the weights alone
                    self.prediction.stop()
            self._weights_predicted = False
        applied_count = 0
        if self._apply_pending:
            with self._around_update():
                self.adapter.apply_update()
            self._apply_pending, self._synchronized = False, False
            applied_count += 1
        scaled = self.adapter.loss_scale() is not None
        for applied in in_flight:
            if self.correction is not None:
                with self.adapter.weights_guard():
                    applied = self._with_grads(applied, self.correction.settle(
                        self._grad_list(applied), self.adapter.weights(), applied.step))
            if self.split is not None:
                with self.adapter.weights_guard():
                    applied = self._with_grads(applied, self.split.settle(self._grad_list(applied),
                                                                           self.adapter.weights()))
            self._write(applied, 1.0)
            if not scaled or self.adapter.gradients_finite():
                self.adapter.apply_update()
                applied_count += 1
        self._passes = [0] * len(self.names)
        return applied_count

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
                self._note_training(done)
            if pending is not None:
                pending.wait()
        finally:
            self.inspector.set_phase("train")
        self._agreed_at = self.engine.step  # every rank has joined: nobody needs this rank's share
        # The last to join: those training at the latest step anyone trained (the same step, hence
        # the same answer, on every rank).
        training = self._last_membership() if self._last_membership is not None else None
        return max(r for r, t in enumerate(training) if t) if training and any(training) else self.comm.rank

    def _note_training(self, steps: Sequence[AppliedStep]) -> None:
        """Keeps how to read the latest applied step's membership flags, for join() (lazily:
        reading them is a device sync on a GPU; not the step itself, whose gradients it would
        keep alive). A training rank's own flag is set at every step it runs, so that step had
        someone training."""
        if steps and steps[-1].membership is not None:
            self._last_membership = steps[-1].membership

    # ------------------------------------------------- staleness corrections (staleness/corrections.py)
    def _corrected(self, step: int, applied: List[AppliedStep]) -> List[AppliedStep]:
        """The averages that step ``step`` applies, corrected (a synchronous step's own fresh
        gradient is not), and step ``step``'s state kept when its gradient is in flight."""
        correction, adapter = self.correction, self.adapter
        local = None
        if correction.needs_local:
            trainable = set(adapter.trainable())
            local = [adapter.local_gradient(i) if i in trainable and adapter.has_local_gradient(i) else None
                     for i in range(len(self.names))]
        pipelined = all(a.step != step for a in applied)
        out = []
        with adapter.weights_guard():
            weights = adapter.weights()
            for a in applied:
                out.append(a if a.step == step else
                           self._with_grads(a, correction.correct(self._grad_list(a), weights, a.step, True, local)))
            correction.remember(step, weights, local, pipelined, applies=pipelined and bool(applied))
        return out

    def _grad_list(self, applied: AppliedStep) -> List[Optional[Tensor]]:
        return [applied.grads.get(i) for i in range(len(self.names))]

    @staticmethod
    def _with_grads(applied: AppliedStep, grads: List[Optional[Tensor]]) -> AppliedStep:
        # not owned: a correction may keep what it returns (its state of the steps in flight)
        return dataclasses.replace(applied, grads={i: g for i, g in enumerate(grads) if g is not None},
                                   owned=False)

    # ------------------------------------------------------- staleness correction (prediction)
    def _restore_real_weights(self) -> None:
        if self._weights_predicted:
            with self.adapter.weights_guard():
                self.prediction.restore(self.adapter.weights())
            self._weights_predicted = False

    def _predict_weights(self) -> None:
        if self.prediction is not None:
            with self.adapter.weights_guard():
                self.prediction.predict(self.adapter.weights())
            self._weights_predicted = True

    @contextlib.contextmanager
    def real_weights(self) -> Iterator[None]:
        """The real weights inside the block, the prediction (or the split-batch rule's
        look-ahead) again after it (bit for bit)."""
        if self.split is not None:
            with self.adapter.weights_guard():
                look_ahead = self.split.show_real(self.adapter.weights())
            try:
                yield
            finally:
                if look_ahead is not None:
                    with self.adapter.weights_guard():
                        self.split.show_look_ahead(self.adapter.weights(), look_ahead)
            return
        if not self._weights_predicted:
            yield
            return
        self._restore_real_weights()
        try:
            yield
        finally:
            with self.adapter.weights_guard():
                self.prediction.reapply(self.adapter.weights())  # a no-op if flush() ran inside the block
            self._weights_predicted = self.prediction.is_started()

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
            self._stepped = self.engine.step > 0
            self._resume_checked = False
        self._weights_predicted = self.load_prediction(None if entry is None else entry.get("prediction"))
        self.load_correction(None if entry is None else entry.get("corrections"))

    # -------------------------------------------------------------------- Horovod elastic
    # Called through the framework's elastic state handler; the rule is pipesgd_hvd/optimizer/elastic.py's.
    def elastic_restore(self, committed: Dict[str, Any]) -> None:  # type: ignore[override]
        """After HorovodInternalError: back to the last commit (the framework's state dict)."""
        # A copy: the framework's load may keep the given tensors, and training would then change
        # the commit in place before the next restore.
        entry, rest = checkpoint.read(copy.deepcopy(committed))
        self._reset_step_flags()
        self.adapter.load_optimizer_state_dict(rest)
        super().elastic_restore(entry)
        self._stepped = self.engine.step > 0

    def elastic_sync(self) -> None:  # type: ignore[override]
        self._reset_step_flags()
        super().elastic_sync(self.adapter.optimizer_state_dict, self.adapter.load_optimizer_state_dict)
        self._stepped = self.engine.step > 0
        self._resume_checked = True  # every rank took rank 0's state

    def _reset_step_flags(self) -> None:
        self._synchronized = self._apply_pending = False
        self._passes = [0] * len(self.names)

    # ------------------------------------------------------------------------------ exit
    def finish_at_exit(self) -> None:
        """At interpreter exit: apply what is in flight (nothing computed is lost), or, after a
        failure, make sure the transport's own shutdown cannot keep the process alive."""
        engine = self.engine
        if engine.failure is None and (engine.in_flight or self._apply_pending):
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
