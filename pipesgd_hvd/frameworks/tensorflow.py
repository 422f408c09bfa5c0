"""Keras 3 / TensorFlow adapter: a pipelined ``DistributedOptimizer`` for ``model.fit`` and custom loops.

``DistributedOptimizer(keras_optimizer, ...)`` returns an instance of a subclass of the user's
optimizer class, made on the fly with the same name and module (Horovod's Keras lesson): Keras
serializes it as the original class, so a model saved with it loads without pipesgd_hvd. The
subclass only overrides ``build`` (to create the pipeline) and ``apply`` (to swap this step's
local gradients for the averaged, one-step-stale ones); the update itself is the original class's.
The pipeline's state is in :class:`~pipesgd_hvd.frameworks.tf_pipeline.GraphPipeline`'s variables,
tracked by ``tf.train.Checkpoint`` but not listed in ``optimizer.variables`` (so ``.keras`` files
stay loadable by plain Keras).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Type

import keras
import tensorflow as tf

from ..compression import Compression, resolve_compression
from ..engine import PipelineConfig, WireStats, pipeline_name
from ..fusion import DEFAULT_FUSION_THRESHOLD, TensorSpec
from ..options import (check_backward_passes, check_global_process_set, check_no_auto, check_staleness_correction,
                       fusion_threshold_bytes, resolve_reduce_op)
from ..staleness import WeightPrediction
from .tf_guards import ReplicaCheck, StepProgress
from .tf_pipeline import GraphPipeline

try:
    import horovod.tensorflow as _hvd
except ImportError:  # pragma: no cover - exercised only without Horovod
    _hvd = None


def variable_name(v: Any) -> str:
    """Keras 3 variables have a unique ``path`` ("dense_1/kernel"); tf.Variables have ``name``."""
    return str(getattr(v, "path", None) or v.name)


class _PipelinedOptimizer:
    """Methods mixed in front of the user's optimizer class (see :func:`DistributedOptimizer`)."""

    _pipesgd_settings: Dict[str, Any]
    _pipesgd: Optional[GraphPipeline]
    _pipesgd_progress: Optional[StepProgress]
    _pipesgd_replicas: Optional[ReplicaCheck]

    def build(self, variables: Sequence[Any]) -> None:
        super().build(variables)  # type: ignore[misc]
        self._pipesgd_build(list(variables))

    def _pipesgd_build(self, variables: List[Any]) -> None:
        s = self._pipesgd_settings
        specs = [TensorSpec(variable_name(v), tuple(int(d) for d in v.shape), tf.as_dtype(v.dtype).name)
                 for v in variables]
        comm = s["communicator"]
        if comm is None:
            from ..comm.horovod_tensorflow import HorovodTensorFlowCommunicator

            comm = HorovodTensorFlowCommunicator()
        config = PipelineConfig(**{k: s[k] for k in _CONFIG_KEYS}, name=pipeline_name([spec.name for spec in specs]))
        self._pipesgd_variables = [variable_name(v) for v in variables]
        # Plain attributes (not tracked by Keras or checkpointed): the watchdog thread and counters.
        progress = StepProgress()
        object.__setattr__(self, "_pipesgd_progress", progress)
        with progress.eager_step():  # the build's collectives (cross-rank check, codec priming) too
            pipeline = GraphPipeline(specs, comm=comm, codec=resolve_compression(s["compression"]), config=config)
        replicas = None
        if config.check_replicas_every:
            replicas = ReplicaCheck(comm, config.check_replicas_every, self._pipesgd_variables, config.name)
        object.__setattr__(self, "_pipesgd_replicas", replicas)
        prediction = None
        if s["staleness_correction"]:
            prediction = WeightPrediction(pipeline.ops, variables)
            pipeline.prediction_state = prediction.state()  # checkpointed with the pipeline
        object.__setattr__(self, "_pipesgd_prediction", prediction)
        self._pipesgd = pipeline

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> None:
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError("the optimizer is not built: pass the variables with the gradients, "
                                 "as apply_gradients(zip(grads, variables)) does")
            trainable_variables = list(self._trainable_variables)
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
                self.built = True
        pipeline = self._pipesgd
        if [variable_name(v) for v in trainable_variables] != self._pipesgd_variables:
            raise ValueError(
                "pipesgd_hvd's DistributedOptimizer must get gradients for the same variables, in the same "
                f"order, at every step (built for {len(self._pipesgd_variables)} variables, got "
                f"{len(trainable_variables)}): pass all trainable variables, with None where a gradient is missing")
        if len(grads) != len(trainable_variables):
            raise ValueError(f"got {len(grads)} gradients for {len(trainable_variables)} variables")
        grads = [_dense(g, v) for g, v in zip(grads, trainable_variables)]
        progress = self._pipesgd_progress
        if tf.executing_eagerly():
            with progress.eager_step():
                self._pipesgd_step(grads, trainable_variables)
        else:
            begun = progress.begin(after=grads)
            progress.end(after=[begun] + self._pipesgd_step(grads, trainable_variables))

    def _pipesgd_step(self, grads: List[Any], variables: List[Any]) -> List[tf.Tensor]:
        """The replica check (when due), the exchange and the update. Traced, returns the tensors
        that exist once every collective of the step is done (for the watchdog)."""
        pipeline = self._pipesgd
        checked = None
        if self._pipesgd_replicas is not None:  # the weights every rank's forward pass just used
            checked = self._pipesgd_replicas(pipeline.step.read_value(), variables)
        reduced, should_apply = pipeline.exchange(grads)
        inner_apply = super().apply  # type: ignore[misc]
        prediction = self._pipesgd_prediction
        if prediction is not None:  # the gradients were computed at predicted weights
            prediction.restore(variables)

        def apply_now() -> tf.Tensor:
            inner_apply(reduced, variables)
            return tf.constant(True)

        done: List[tf.Tensor] = []
        if tf.executing_eagerly():
            if bool(should_apply):
                apply_now()
        else:
            # While the pipeline fills there is no averaged gradient yet: the wrapped optimizer
            # does not run at all (its iteration counter, moments and weight decay stay put).
            # A replica check that fails fails the step before anything is applied.
            with tf.control_dependencies([] if checked is None else [checked]):
                done.append(tf.cond(should_apply, apply_now, lambda: tf.constant(False)))
        if prediction is not None:
            prediction.predict(variables)
        return done

    def flush(self) -> int:
        """Applies the averaged gradients still in flight (call on every rank, eagerly, e.g. after
        ``fit``). Returns how many steps were applied. The next step fills the pipeline anew."""
        if self._pipesgd is None:
            return 0
        with self._pipesgd_progress.eager_step():
            pending = self._pipesgd.flush()
        variables = list(self._trainable_variables)
        if self._pipesgd_prediction is not None:
            self._pipesgd_prediction.reset(variables)  # the real weights, for evaluation or saving
        for grads in pending:
            super().apply(grads, variables)  # type: ignore[misc]
        return len(pending)

    @property
    def stats(self) -> WireStats:
        """Wire bytes this rank sent, next to a float32 ring all-reduce's (see WireStats)."""
        p = self._pipesgd
        if p is None:
            return WireStats()
        return WireStats(steps=int(p.step.numpy()), bytes_sent=int(p.bytes_sent.numpy()),
                         fp32_bytes=int(p.fp32_bytes.numpy()))

    @property
    def pipeline(self) -> Optional[GraphPipeline]:
        return self._pipesgd


def _dense(grad: Any, variable: Any) -> Any:
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):  # embeddings: reduce dense, like Horovod's sparse_as_dense
        return tf.convert_to_tensor(grad)
    dtype = tf.as_dtype(grad.dtype)
    if not dtype.is_floating:
        raise TypeError(f"the gradient of {variable_name(variable)} has dtype {dtype.name}: only floating-point "
                        "gradients can be averaged; make the variable non-trainable or cast it to a float dtype")
    return grad


_CLASSES: Dict[Type[Any], Type[Any]] = {}
# The DistributedOptimizer arguments that are PipelineConfig fields (checked there).
_CONFIG_KEYS = ("width", "warmup_steps", "fusion_threshold_bytes", "op", "gradient_predivide_factor", "seed",
                "check_replicas_every")


def _pipelined_class(cls: Type[Any]) -> Type[Any]:
    """The subclass of ``cls`` with the pipeline mixed in, named and placed like ``cls`` so Keras
    saves it as ``cls`` (made once per class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_PipelinedOptimizer, cls),
                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                              "__doc__": cls.__doc__})
    return _CLASSES[cls]


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0, op: Any = None,
                         backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                         num_groups: int = 0, groups: Any = None, process_set: Any = None,
                         scale_local_gradients: bool = True, *, width: int = 2, warmup_steps: int = 0,
                         fusion_threshold_mb: float = DEFAULT_FUSION_THRESHOLD / 2**20, seed: int = 0,
                         communicator: Any = None, staleness_correction: bool = False,
                         check_replicas_every: Optional[int] = None) -> Any:
    """Wraps a Keras 3 optimizer so that gradients are averaged across ranks, pipelined.

    Horovod's arguments keep their meaning: ``compression`` (ours such as
    ``psgd.Compression.int8``, or Horovod's ``hvd.Compression.none`` / ``.fp16``), ``op``
    (``hvd.Average`` or ``hvd.Sum``), ``gradient_predivide_factor``. Accepted and without effect,
    as there is nothing for them to do here: ``name`` (the optimizer keeps its own name),
    ``device_dense``/``device_sparse`` (Horovod places the ops), ``sparse_as_dense`` (sparse
    gradients are always reduced dense), ``num_groups``/``groups`` (use ``fusion_threshold_mb``),
    ``scale_local_gradients``. ``backward_passes_per_step`` > 1: use Keras's own
    ``gradient_accumulation_steps=N`` on the wrapped optimizer instead.

    Ours, keyword-only: ``width`` (2 = Pipe-SGD, staleness 1; 1 = synchronous, Horovod's rule),
    ``warmup_steps`` (run synchronously first), ``fusion_threshold_mb``, ``seed`` (stochastic
    rounding), ``communicator`` (default Horovod's TensorFlow ops), ``staleness_correction``
    (weight prediction, see ``pipesgd_hvd.staleness``: gradients are computed at the weights
    extrapolated with the last update; between steps the variables hold that prediction, and
    ``flush()`` / ``PipelineFlushCallback`` put the real weights back), ``check_replicas_every``
    (every that many steps, compare a fingerprint of every variable the optimizer updates across
    ranks, one small allgather, and fail on every rank with ``ReplicaDriftError: replicas differ at
    step S: parameter 'dense/kernel' ...`` naming the first that differs; default None: never.
    Inside ``model.fit`` or a ``tf.function`` TensorFlow raises it as ``tf.errors.UnknownError``
    with that message).

    ``width="auto"`` and ``compression="auto"`` are PyTorch-only for now.

    A step that waits for its peers longer than ``PIPESGD_TIMEOUT`` seconds (default 600; 0: no
    limit) ends the process with status 1 and a ``PeerLostError`` message: a collective inside a
    traced step cannot be interrupted, and a frozen peer would otherwise hang the job
    (``docs/reliability.md``, Keras).

    The first step after warm-up applies nothing (no averaged gradient exists yet); call
    ``optimizer.flush()`` after training to apply the last in-flight gradient. Use
    ``tf.train.Checkpoint(model=model, optimizer=optimizer)`` for an exact restart (it saves the
    in-flight gradient and error-feedback residuals); ``model.save("x.keras")`` saves a model any
    Keras can load, without them.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a Keras 3 optimizer (keras.optimizers.Optimizer), got "
                        f"{type(optimizer).__name__}; for legacy tf.keras optimizers use horovod.tensorflow.keras")
    if isinstance(optimizer, _PipelinedOptimizer):
        raise TypeError("optimizer is already a pipesgd_hvd DistributedOptimizer")
    if check_backward_passes(backward_passes_per_step) > 1:
        raise ValueError("backward_passes_per_step > 1 is not supported for Keras: set Keras's own "
                         "gradient_accumulation_steps=N on the optimizer you wrap instead")
    check_global_process_set(process_set, _hvd)
    check_no_auto(width, compression, "Keras/TensorFlow")
    settings = {
        "width": width, "warmup_steps": warmup_steps, "fusion_threshold_bytes": fusion_threshold_bytes(fusion_threshold_mb),
        "op": resolve_reduce_op(op, _hvd), "gradient_predivide_factor": gradient_predivide_factor,
        "seed": seed, "communicator": communicator, "compression": resolve_compression(compression),
        "staleness_correction": check_staleness_correction(staleness_correction),
        "check_replicas_every": check_replicas_every or 0,
    }
    PipelineConfig(**{k: settings[k] for k in _CONFIG_KEYS})  # checks them now, before any collective
    if optimizer.built:
        raise ValueError("wrap the optimizer before it is used (DistributedOptimizer(keras.optimizers.SGD(...)) "
                         "before model.compile / the first apply_gradients)")
    cls = _pipelined_class(type(optimizer))
    wrapped = cls.from_config(optimizer.get_config())
    # Plain attributes: Keras's tracker would wrap the dict (and the codec inside) as state.
    object.__setattr__(wrapped, "_pipesgd_settings", settings)
    wrapped._pipesgd = None
    for attribute in ("_pipesgd_prediction", "_pipesgd_progress", "_pipesgd_replicas"):
        object.__setattr__(wrapped, attribute, None)
    return wrapped


def load_model(filepath: str, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None, compression: Any = Compression.none,
               **pipeline: Any) -> Any:
    """Horovod's ``load_model``: loads a Keras model and wraps its optimizer in
    :func:`DistributedOptimizer` (``compression`` and ``pipeline`` keywords such as ``width``
    passed on), keeping the optimizer's state (iterations, moments). Call it on every rank."""
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects)
    loaded = getattr(model, "optimizer", None)
    if loaded is None:
        return model
    wrapped = DistributedOptimizer(type(loaded).from_config(loaded.get_config()), compression=compression, **pipeline)
    if loaded.built:
        wrapped.build(model.trainable_variables)
        for mine, theirs in zip(wrapped.variables, loaded.variables):
            mine.assign(theirs)
    model.optimizer = wrapped
    model.train_function = None  # retrace with the wrapped optimizer
    return model
