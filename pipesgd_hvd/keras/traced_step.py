"""A Keras optimizer's pipeline: the shared life cycle around TensorFlow's traced executor.

:class:`KerasCore` is :class:`~pipesgd_hvd.optimizer.lifecycle.Lifecycle` (name, auto mode,
staleness correction, checkpoint entry, elastic) over a
:class:`~pipesgd_hvd.keras.traced_engine.TracedEngine`, plus the graph ops of one step: the
replica check, the exchange, and the correction's moments around the wrapped optimizer's update
(the same as PyTorch's core, ``optimizer/core.py``). The Keras side the correction reaches (the
variables, the optimizer's state) is :class:`~pipesgd_hvd.keras.framework_side.KerasSide`. The
auto mode needs Python between steps: ``after_steps()`` runs it, called by pipesgd_hvd's Keras
callbacks after each batch of ``model.fit`` (any of them) or by an eager ``apply_gradients``;
when it rebuilds the pipeline, the train function must be traced again.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from ..comm.base import Communicator
from ..compression.codecs import Codec
from ..optimizer import checkpoint
from ..optimizer.lifecycle import Lifecycle
from ..optimizer.options import OptimizerOptions
from ..pipeline.config import PipelineConfig
from ..pipeline.engine import AppliedStep
from ..pipeline.fusion import TensorSpec
from ..staleness.correction import Call
from .framework_side import KerasSide
from .traced_guards import ReplicaCheck, StepProgress
from .traced_engine import TracedEngine

NO_DEADLINE = 2**62
AUTO_DRIVER_MESSAGE = (
    "width='auto' / compression='auto' needs Python between steps to measure and switch, and nothing ran it: "
    "in model.fit, add one of pipesgd_hvd.keras.callbacks (e.g. PipelineFlushCallback()) and keep "
    "steps_per_execution=1; in a custom tf.function loop, call optimizer.after_steps() after each step and "
    "trace the step function again when it returns True")

ApplyFn = Callable[[List[Any], List[Any]], Any]


def variable_name(v: Any) -> str:
    """Keras 3 variables have a unique ``path`` ("dense_1/kernel"); tf.Variables have ``name``."""
    return str(getattr(v, "path", None) or v.name)


class KerasCore(Lifecycle):
    """The pipeline of one Keras optimizer, built when the optimizer is built."""

    def __init__(self, options: OptimizerOptions, variables: Sequence[Any], comm: Communicator,
                 optimizer: Optional[Any] = None) -> None:
        """``optimizer``: the wrapped Keras optimizer (held weakly: it owns this core), whose state
        the staleness correction may read or save."""
        self.variables = list(variables)
        self.specs = [TensorSpec(variable_name(v), tuple(int(d) for d in v.shape), tf.as_dtype(v.dtype).name)
                      for v in self.variables]
        self.progress = StepProgress()  # the watchdog of PIPESGD_TIMEOUT
        # Eager even when Keras builds the optimizer inside a trace; the build's collectives (name,
        # cross-rank check, codec priming) are watched like a step.
        with tf.init_scope(), self.progress.eager_step():
            super().__init__(options, [s.name for s in self.specs], comm, KerasSide(self.variables, optimizer))
        self.replicas = None if not options.check_replicas_every else \
            ReplicaCheck(comm, self.engine.schedule, self.names, self.name)
        with tf.init_scope():
            # The auto mode's guard: a traced step past this index means nothing ran the checks.
            self.auto_deadline = tf.Variable(NO_DEADLINE if self.auto_controller is None else options.auto.measure_steps,
                                             dtype=tf.int64, trainable=False, name="pipesgd_auto_deadline")
        self._driven_to = 0  # steps the auto mode has seen
        self._track_correction()
        self.switched.append(self._track_correction)

    def _track_correction(self) -> None:
        """The staleness correction's variables are checkpointed with the pipeline (tf.train.Checkpoint)."""
        self.engine.correction_state = self.correction.state()

    def build_engine(self, config: PipelineConfig, codec: Codec, *, first_step: int,
                       check_ranks: bool) -> TracedEngine:
        return TracedEngine(self.specs, comm=self.comm, codec=codec, config=config, first_step=first_step,
                             check_ranks=check_ranks)

    # --------------------------------------------------------------------------- the step
    def step(self, grads: List[Any], variables: List[Any], apply: ApplyFn) -> List[tf.Tensor]:
        """The replica check (when due), the exchange and the update (``apply``, the wrapped
        optimizer's), with the staleness correction's moments around it, as in
        ``optimizer/core.py``. Traced, returns the tensors that exist once every collective of the
        step is done (for the watchdog); eagerly, it runs them."""
        graph, correction = self.engine, self.correction
        if self.auto_controller is not None:
            tf.debugging.assert_less(graph.step_counter.read_value(), self.auto_deadline.read_value(),
                                     message=AUTO_DRIVER_MESSAGE)
        checked = None
        if self.replicas is not None:  # the real weights every rank's update starts from
            checked = self.replicas(graph.step_counter.read_value(), correction.real_values())
        step = graph.step_counter.read_value()  # before exchange() counts the step (ordered in the graph)
        feeds, takes = correction.feeds(), correction.takes()
        inputs = list(grads)
        if correction.transforms_input:
            inputs = [None if g is None else correction.local_(i, g) for i, g in enumerate(grads)]
        reduced, should_apply, stale = graph.exchange(inputs, feeds=feeds, takes=takes)
        schedule = graph.schedule
        call = Call(step=step, stale=stale, stale_step=step - (graph.config.width - 1), applies=should_apply,
                    pipelined=tf.logical_not(schedule.in_warmup(step)),
                    local=list(grads) if correction.needs_local else None)
        reduced, applies = correction.before_update(call, list(reduced))

        def apply_now() -> tf.Tensor:
            with correction.around_update(call):
                apply(reduced, variables)
            return tf.constant(True)

        done: List[tf.Tensor] = []
        if tf.executing_eagerly():
            if bool(applies):
                apply_now()
        else:
            # While the pipeline fills there is no averaged gradient yet: the wrapped optimizer
            # does not run at all (its iteration counter, moments and weight decay stay put).
            # A replica check that fails fails the step before anything is applied.
            with tf.control_dependencies([] if checked is None else [checked]):
                done.append(tf.cond(applies, apply_now, lambda: tf.constant(False)))
        correction.after_update(call)
        return done

    def flush(self, apply: ApplyFn) -> int:
        """Eagerly and collectively: applies the averaged gradients still in flight, with the real
        weights put back first, and a part of an update the correction kept as an update of its
        own. Returns how many steps."""
        with self.progress.eager_step():
            pending = self.engine.flush()
            return self._apply_flushed(pending, apply, kept=True)

    def _apply_flushed(self, pending: Sequence[AppliedStep], apply: ApplyFn, kept: bool = False) -> int:
        correction = self.correction
        correction.before_flush()
        for step in pending:
            grads = correction.settle([step.grads.get(i) for i in range(len(self.variables))], step.step)
            apply(grads, self.variables)
        count = len(pending)
        part = correction.pending() if kept else None
        if part is not None:  # every rank holds one: the pairs are in step
            apply(self.engine.reduce_now(part), self.variables)
            count += 1
        correction.flushed()
        return count

    # -------------------------------------------------------------------------- auto mode
    def after_steps(self, apply: ApplyFn) -> bool:
        """Eagerly, after steps ended: feeds the auto mode the compute time of the last step and
        runs its check when due (collective; flushed gradients are applied through ``apply``).
        Returns True when the pipeline was rebuilt: traced step functions must be traced again."""
        controller = self.auto_controller
        ended = self.engine.step
        if controller is None or ended <= self._driven_to:
            return False
        self._driven_to = ended
        seconds = float(self.progress.compute_seconds.numpy())
        if seconds >= 0:
            controller.record_compute(seconds)
        before = self.engine
        with self.progress.eager_step():
            flushed = controller.after_step(before, [])
        if flushed:
            self._apply_flushed(flushed, apply)
        self.auto_deadline.assign(NO_DEADLINE if controller.next_check is None else controller.next_check)
        return self.engine is not before

    # ------------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Dict[str, Any]:
        """Eagerly and collectively: the checkpoint entry (pending gradients reduced now)."""
        with self.progress.eager_step():
            return self.compose_state()

    def load_state_dict(self, entry: Dict[str, Any]) -> None:
        entry, _ = checkpoint.read({checkpoint.KEY: entry})
        with self.progress.eager_step():
            self.load_entry(entry)
        self.load_correction(entry)

    # -------------------------------------------------------------------- Horovod elastic
    # Called by keras/elastic.py's KerasState; the rule is pipesgd_hvd/optimizer/elastic_rule.py's. Each
    # replaces the pipeline: traced steps must be traced again (KerasState does it).
    def elastic_restore(self, entry: Optional[Dict[str, Any]]) -> None:
        """After a lost worker: back to the committed entry (``state_dict()``), no collective."""
        with tf.init_scope():
            # The step that failed never ends: nothing waits on it any more, so neither the
            # watchdog nor the exit handler may count it as a step in progress.
            self.progress.ended.assign(self.progress.begun.read_value())
        super().elastic_restore(entry)
        self._replaced()

    def elastic_sync_from(self, root_state: Callable[[], Any], load_root_state: Callable[[Any], None]) -> None:
        with self.progress.eager_step():
            self.elastic_sync(root_state, load_root_state)
        self.replicas = None if self.replicas is None else \
            ReplicaCheck(self.comm, self.engine.schedule, self.names, self.name)
        self._replaced()

    def _replaced(self) -> None:
        for listener in self.switched:  # the optimizer tracks the new pipeline's variables
            listener()

    def close(self) -> None:
        self.engine.close()
