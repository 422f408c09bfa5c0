"""Keras 3 / TensorFlow adapter: a pipelined ``DistributedOptimizer`` for ``model.fit`` and custom loops.

``DistributedOptimizer(keras_optimizer, ...)`` returns an instance of a subclass of the user's
optimizer class, made on the fly with the same name and module (Horovod's Keras lesson; Keras
forces the subclass: it serializes an optimizer by its class, so a model saved with it loads
without pipesgd_hvd). The subclass overrides ``build`` (to create the pipeline) and ``apply``
(to swap this step's local gradients for the averaged, one-step-stale ones); the update itself
is the original class's. Translation only: the pipeline is :class:`~pipesgd_hvd.keras.traced_step.KerasCore`'s,
whose variables ``tf.train.Checkpoint`` tracks but ``optimizer.variables`` does not list (so
``.keras`` files stay loadable by plain Keras).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Type

import keras
import tensorflow as tf

from ..compression import Compression
from ..optimizer.options import OptimizerOptions
from ..pipeline.config import WireStats
from ..pipeline.fusion import DEFAULT_FUSION_THRESHOLD
from ..staleness.formulas import DEFAULT_DC_LAMBDA
from ..staleness.split_batch import DEFAULT_FRESH_FRACTION
from ..staleness.choice import family_by_class
from .traced_step import KerasCore, variable_name
from .traced_engine import TracedEngine
from .xla import calling_model, check_not_xla_compiled

try:
    import horovod.tensorflow as _hvd
except ImportError:  # pragma: no cover - exercised only without Horovod
    _hvd = None


class _PipelinedOptimizer:
    """Methods mixed in front of the user's optimizer class (see :func:`DistributedOptimizer`)."""

    _pipesgd_options: OptimizerOptions
    _pipesgd_core: Optional[KerasCore]
    _pipesgd: Optional[TracedEngine]  # tracked, so tf.train.Checkpoint saves the pipeline's variables

    def build(self, variables: Sequence[Any]) -> None:
        model = calling_model()  # fit() builds the optimizer: refuse an XLA-compiled step now, with the fix
        if model is not None:
            check_not_xla_compiled(model)
        super().build(variables)  # type: ignore[misc]
        comm = self._pipesgd_options.communicator
        if comm is None:
            from ..comm.horovod_tensorflow import HorovodTensorFlowCommunicator

            comm = HorovodTensorFlowCommunicator()
        core = KerasCore(self._pipesgd_options, list(variables), comm, optimizer=self)
        object.__setattr__(self, "_pipesgd_core", core)  # plain: Keras must not track it as state
        self._pipesgd = core.engine
        core.switched.append(lambda: setattr(self, "_pipesgd", core.engine))  # the auto mode's new one

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
        core = self._pipesgd_core
        if [variable_name(v) for v in trainable_variables] != core.names:
            raise ValueError(
                "pipesgd_hvd's DistributedOptimizer must get gradients for the same variables, in the same "
                f"order, at every step (built for {len(core.names)} variables, got "
                f"{len(trainable_variables)}): pass all trainable variables, with None where a gradient is missing")
        if len(grads) != len(trainable_variables):
            raise ValueError(f"got {len(grads)} gradients for {len(trainable_variables)} variables")
        grads = [_dense(g, v) for g, v in zip(grads, trainable_variables)]
        inner_apply = super().apply  # type: ignore[misc]
        progress = core.progress
        if tf.executing_eagerly():
            with progress.eager_step():
                core.step(grads, trainable_variables, inner_apply)
            self.after_steps()
        else:
            begun = progress.begin(after=grads)
            progress.end(after=[begun] + core.step(grads, trainable_variables, inner_apply))

    def flush(self) -> int:
        """Applies the averaged gradients still in flight (call on every rank, eagerly, e.g. after
        ``fit``). Returns how many steps were applied. The next step fills the pipeline anew."""
        if self._pipesgd_core is None:
            return 0
        return self._pipesgd_core.flush(super().apply)  # type: ignore[misc]

    def after_steps(self) -> bool:
        """With ``width``/``compression="auto"``: measures and switches between steps (collective;
        pipesgd_hvd's Keras callbacks call it after each batch of ``fit``). Returns True when the
        pipeline was rebuilt: a traced step function must be traced again."""
        if self._pipesgd_core is None:
            return False
        return self._pipesgd_core.after_steps(super().apply)  # type: ignore[misc]

    def pipeline_state_dict(self) -> Dict[str, Any]:
        """The checkpoint entry of :mod:`pipesgd_hvd.optimizer.checkpoint` (eager, collective: pending
        gradients are reduced now; the same format as PyTorch's ``state_dict()["pipesgd"]``).
        ``tf.train.Checkpoint(model=model, optimizer=opt)`` saves the same state as variables."""
        if self._pipesgd_core is None:
            raise ValueError("the optimizer is not built yet: nothing to save")
        return self._pipesgd_core.state_dict()

    def load_pipeline_state_dict(self, entry: Dict[str, Any]) -> None:
        """Loads :meth:`pipeline_state_dict` (after the model's and the optimizer's own variables)."""
        if self._pipesgd_core is None:
            raise ValueError("build the optimizer first: optimizer.build(model.trainable_variables)")
        self._pipesgd_core.load_state_dict(entry)

    @property
    def stats(self) -> WireStats:
        """Wire bytes this rank sent, next to a float32 ring all-reduce's (see WireStats)."""
        return WireStats() if self._pipesgd_core is None else self._pipesgd_core.stats

    @property
    def engine(self) -> Optional[TracedEngine]:
        """The pipeline engine inside the traced step (rebuilt by the auto mode and elastic)."""
        return self._pipesgd

    @property
    def core(self) -> Optional[KerasCore]:
        return self._pipesgd_core

    @property
    def auto_decision(self) -> Any:
        """The latest auto-mode decision (``.describe()`` says why); None without it or while measuring."""
        core = self._pipesgd_core
        return None if core is None or core.auto_controller is None else core.auto_controller.decision


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


# Per-coordinate step sizes: staleness_correction="auto" treats these alike (staleness/choice.py).
_ADAPTIVE = ("Adam", "AdamW", "Nadam", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Adafactor")


def optimizer_family(optimizer: Any) -> str:
    """The wrapped Keras optimizer's family for ``staleness_correction="auto"``: Keras's own
    classes and their subclasses by their Keras base class; anything else is "other"."""
    return family_by_class(optimizer, "keras", _ADAPTIVE)


_CLASSES: Dict[Type[Any], Type[Any]] = {}


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
                         scale_local_gradients: bool = True, *, width: Any = 2, warmup_steps: int = 0,
                         fusion_threshold_mb: float = DEFAULT_FUSION_THRESHOLD / 2**20, seed: int = 0,
                         communicator: Any = None, staleness_correction: Any = False,
                         dc_lambda: float = DEFAULT_DC_LAMBDA, fresh_fraction: float = DEFAULT_FRESH_FRACTION,
                         check_replicas_every: Optional[int] = None,
                         auto_measure_steps: int = 10,
                         auto_recheck_every: Optional[int] = 500) -> Any:
    """Wraps a Keras 3 optimizer so that gradients are averaged across ranks, pipelined.

    Horovod's arguments keep their meaning: ``compression`` (ours such as
    ``psgd.Compression.int8``, or Horovod's ``hvd.Compression.none`` / ``.fp16``), ``op``
    (``hvd.Average`` or ``hvd.Sum``), ``gradient_predivide_factor``. Accepted and without effect,
    as there is nothing for them to do here: ``name``, ``device_dense``/``device_sparse``,
    ``sparse_as_dense`` (sparse gradients are always reduced dense), ``num_groups``/``groups``
    (use ``fusion_threshold_mb``), ``scale_local_gradients``. ``backward_passes_per_step`` > 1:
    use Keras's own ``gradient_accumulation_steps=N`` on the wrapped optimizer instead.

    Ours, keyword-only, as for PyTorch (``docs/options.md``): ``width`` (2 = Pipe-SGD, 1 =
    synchronous, or ``"auto"``), ``warmup_steps``, ``fusion_threshold_mb``, ``seed``,
    ``communicator``, ``staleness_correction`` (and ``dc_lambda``, ``fresh_fraction``; with ``"split_batch"``, the
    accurate mode, two calls make one update: halve ``fit``'s ``batch_size``), ``check_replicas_every``,
    ``auto_measure_steps``,
    ``auto_recheck_every``. With ``"auto"`` in ``model.fit``, keep one of pipesgd_hvd's Keras
    callbacks in the list (e.g. ``PipelineFlushCallback()``): they run its checks between steps.

    The first step after warm-up applies nothing (no averaged gradient exists yet); call
    ``optimizer.flush()`` after training to apply the last in-flight gradient. Use
    ``tf.train.Checkpoint(model=model, optimizer=optimizer)`` for an exact restart (it saves the
    in-flight gradient and error-feedback residuals); ``model.save("x.keras")`` saves a model any
    Keras can load, without them. ``docs/reliability.md`` lists every error.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a Keras 3 optimizer (keras.optimizers.Optimizer), got "
                        f"{type(optimizer).__name__}; for legacy tf.keras optimizers use horovod.tensorflow.keras")
    if isinstance(optimizer, _PipelinedOptimizer):
        raise TypeError("optimizer is already a pipesgd_hvd DistributedOptimizer")
    options = OptimizerOptions.from_arguments(
        width=width, compression=compression, warmup_steps=warmup_steps, fusion_threshold_mb=fusion_threshold_mb,
        op=op, gradient_predivide_factor=gradient_predivide_factor, seed=seed,
        check_replicas_every=check_replicas_every, staleness_correction=staleness_correction,
        dc_lambda=dc_lambda, fresh_fraction=fresh_fraction, backward_passes_per_step=backward_passes_per_step,
        auto_measure_steps=auto_measure_steps, auto_recheck_every=auto_recheck_every, communicator=communicator,
        process_set=process_set, hvd=_hvd, optimizer_family=optimizer_family(optimizer),
        optimizer_name=type(optimizer).__name__)
    if options.backward_passes_per_step > 1:
        raise ValueError("backward_passes_per_step > 1 is not supported for Keras: set Keras's own "
                         "gradient_accumulation_steps=N on the optimizer you wrap instead")
    if optimizer.built:
        raise ValueError("wrap the optimizer before it is used (DistributedOptimizer(keras.optimizers.SGD(...)) "
                         "before model.compile / the first apply_gradients)")
    cls = _pipelined_class(type(optimizer))
    wrapped = cls.from_config(optimizer.get_config())
    # Plain attributes: Keras's tracker would wrap the options (and the codec inside) as state.
    object.__setattr__(wrapped, "_pipesgd_options", options)
    object.__setattr__(wrapped, "_pipesgd_core", None)
    wrapped._pipesgd = None
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
