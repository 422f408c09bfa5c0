"""What every pipelined optimizer shares, whether its step runs in Python (PyTorch) or in a traced
graph (Keras): the pipeline's life and its state around the steps.

:class:`Lifecycle` owns the pipeline object (the eager
:class:`~pipesgd_hvd.pipeline.engine.PipelineEngine`, or TensorFlow's ``TracedEngine``, built by the
subclass's ``build_engine``) and everything that replaces or saves it:

* its name, agreed across ranks (:func:`~pipesgd_hvd.pipeline.guards.agree_pipeline_name`);
* the auto mode (:mod:`pipesgd_hvd.auto.controller`), which rebuilds it with another width or
  codec at a step every rank agrees on;
* the staleness correction (``staleness_correction``: one
  :class:`~pipesgd_hvd.staleness.correction.Correction`, the identity without one), built once
  and kept across the auto mode's rebuilds;
* the one checkpoint entry (:mod:`pipesgd_hvd.optimizer.checkpoint`);
* Horovod elastic: dropping what the old world left in flight, rebuilding for the new world and
  continuing from rank 0's state (the rule of :mod:`pipesgd_hvd.optimizer.elastic_rule`).
"""
from __future__ import annotations

import atexit
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

from ..auto.controller import AutoController
from ..comm.base import Communicator
from ..comm.topology import Topology, resolve_topology
from ..compression import resolve_compression
from ..compression.codecs import Codec
from ..pipeline.config import PipelineConfig, WireStats
from ..pipeline.engine import AppliedStep
from ..pipeline.fusion import TensorSpec
from ..pipeline.guards import agree_pipeline_name, provisional_name
from ..staleness import registry as corrections
from ..staleness.choice import AccuracyWarning
from ..staleness.correction import Correction, CorrectionContext
from . import checkpoint, elastic_rule
from .framework import FrameworkSide
from .options import OptimizerOptions


class Engine(Protocol):
    """What the life cycle needs of a pipeline (the eager engine and TensorFlow's both are one)."""

    specs: List[TensorSpec]
    codec: Codec
    config: PipelineConfig
    stats: Any

    @property
    def step(self) -> int: ...
    def flush(self) -> List[AppliedStep]: ...
    def settings(self) -> List[Any]: ...
    def state_dict(self) -> Dict[str, Any]:
        """The engine's part of the checkpoint entry (collective: in-flight steps are reduced)."""
    def load_state_dict(self, state: Dict[str, Any]) -> None: ...
    def abandon(self) -> Dict[str, Any]:
        """At a change of the world: drop what is not reduced yet, return :meth:`state_dict` of
        the rest without any collective; the pipeline is unusable afterwards."""
    def close(self) -> None: ...


class Lifecycle:
    """The pipeline of one optimizer, from construction to interpreter exit (module docstring)."""

    # True where every step runs in Python (PyTorch): per-step flags then stay on the host; False
    # where the step is traced (Keras), so they must be graph variables.
    eager_steps = False

    def __init__(self, options: OptimizerOptions, names: Sequence[str], comm: Communicator, framework: FrameworkSide,
                 comm_factory: Optional[Callable[[], Communicator]] = None) -> None:
        """``comm_factory``: builds the transport again for a new Horovod elastic world
        (collective); the transport is then this optimizer's own, closed at a change of the world
        and at exit. ``framework``: the tensors and the wrapped optimizer (PyTorch's adapter, or
        Keras's side); subclasses supply :meth:`build_engine`. Nothing here holds a reference to
        ``self`` (callbacks are weak): an optimizer the user drops is freed at once, and its hooks
        stop."""
        self.options, self.comm, self.framework, self.ops = options, comm, framework, framework.ops
        self._comm_factory = comm_factory
        self._held: List[Any] = [None]  # the engine, where a finalizer can see it without holding self
        self.names = list(names)
        # ``compression``: the option as given (or as the auto mode chose it); each engine resolves
        # its own codec from it (a codec is stateful: error-feedback residuals).
        self.width, self.compression = options.initial()
        codec = resolve_compression(self.compression)
        # Under Horovod elastic a joining worker builds its optimizer while the others sync, so it
        # issues no collective here; the pipeline is built again, checked, in elastic_sync().
        joining = elastic_rule.is_elastic_job()
        self._name = provisional_name() if joining else agree_pipeline_name(comm)
        self.topology: Optional[Topology] = None if joining else self._new_topology(codec)
        self.hierarchical = True  # byte codecs use the topology where there is one (the auto mode may say no)
        self._set_engine(self._new_engine(check_ranks=not joining, codec=codec))
        self.auto_controller = None if options.auto is None else \
            AutoController(options.auto, comm, self.ops, rebuild=weak_method(self._switch), topology=self.topology,
                           choose_hierarchy=options.hierarchical is None, node_dtype=options.node_dtype())
        self.correction = self._new_correction()
        if options.advice is not None and comm.rank == 0:
            warnings.warn(options.advice, AccuracyWarning, stacklevel=4)
        self.switched: List[Callable[[], None]] = []  # told after the auto mode rebuilt the pipeline

    # ------------------------------------------------------------------------ the pipeline
    def _set_engine(self, engine: Engine) -> None:
        """``self.engine`` is a plain attribute (read on every step); the finalizer sees the same
        engine through ``_held``."""
        self.engine = self._held[0] = engine

    @property
    def name(self) -> str:
        """The prefix of this optimizer's collective names (the same on every rank)."""
        return self._name

    @property
    def stats(self) -> WireStats:
        return self.engine.stats

    def _new_engine(self, first_step: int = 0, check_ranks: bool = True, codec: Optional[Codec] = None) -> Engine:
        codec = resolve_compression(self.compression) if codec is None else codec
        on = self.topology is not None and self.hierarchical and not codec.summable
        hierarchical = self.options.node_dtype() if on else None
        config = self.options.config(self._name, width=self.width, hierarchical=hierarchical)
        return self.build_engine(config, codec, first_step=first_step, check_ranks=check_ranks)

    def _new_topology(self, codec: Optional[Codec] = None) -> Optional[Topology]:
        """The node groups of hierarchical reductions, where ``hierarchical`` asks for them and a
        byte codec may run (a fixed codec, or the auto mode's choice); None otherwise. Collective
        where it builds them; every rank decides alike, from the same options."""
        auto = self.options.auto
        codec = resolve_compression(self.compression) if codec is None else codec
        plain = (auto is None or auto.compression is not None) and codec.summable  # no stage to split
        return resolve_topology(self.options.hierarchical, self.comm, name=f"{self._name}.topology",
                                settings=(codec.name, None if auto is None else auto.compression), wanted=not plain)

    def build_engine(self, config: PipelineConfig, codec: Codec, *, first_step: int, check_ranks: bool) -> Engine:
        """A new pipeline; ``check_ranks``: run the cross-rank check of settings and tensors
        (collective) now."""
        raise NotImplementedError

    def rebuild(self) -> None:
        """A new pipeline over the same settings (the tensor list changed before training)."""
        self.engine.close()
        self._set_engine(self._new_engine())
        self.correction = self._new_correction()

    def _switch(self, width: int, compression: Any, hierarchical: bool = False) -> None:
        """The auto mode's rebuild: the pipeline was flushed; the next one continues its step
        count and byte counts (a fresh name per configuration keeps the collectives' names apart).
        ``hierarchical``: a byte codec reduces over the topology."""
        old = self.engine
        old.close()
        self.width, self.compression, self.hierarchical = width, compression, hierarchical
        self._name = f"{self._name.split('.auto')[0]}.auto{old.step}"
        self._set_engine(self._new_engine(first_step=old.step))
        self.engine.stats = old.stats
        for listener in self.switched:
            listener()

    def _new_correction(self) -> Correction:
        """The staleness correction of ``staleness_correction`` (the identity without one, and
        where it has nothing to do at this width)."""
        framework = self.framework
        with framework.weights_guard():
            return corrections.build(self.options.staleness_correction, CorrectionContext(
                ops=self.ops, weights=framework.weights(), eager=self.eager_steps, width=self.width,
                world_size=self.comm.size, options=self.options, framework=framework))

    # ------------------------------------------------------------------------ checkpointing
    def compose_state(self) -> Dict[str, Any]:
        """The checkpoint entry (collective: in-flight steps are reduced or waited for)."""
        with self.framework.weights_guard():
            saved = self.correction.state_dict(self.names)
        return checkpoint.compose(
            self.engine.state_dict(),
            auto=self.auto_controller.state_dict() if self.auto_controller is not None else None,
            corrections=saved, residuals_of=checkpoint.owner(self.comm.rank, self.comm.size))

    def load_entry(self, entry: Dict[str, Any]) -> None:
        """Loads the pipeline's part of an entry (format 2). Rebuilding the pipeline for a saved
        auto choice is collective: load on every rank."""
        if entry.get("auto") is not None and self.auto_controller is not None:
            self.auto_controller.load_state_dict(entry["auto"])  # the width and codec it ran with
        checkpoint.check_resumable(entry["settings"], self.engine.settings())
        self.engine.load_state_dict(checkpoint.usable_residuals(entry, self.comm.rank, self.comm.size,
                                                                self.engine.settings()))

    def load_correction(self, entry: Optional[Dict[str, Any]]) -> None:
        """After the model's weights (and the wrapped optimizer's state) were loaded: the
        correction's state, or a fresh start that applies the in-flight averages as they are.
        A checkpoint saved with another correction whose model held other weights than the real
        ones gets its real weights back."""
        saved = None if entry is None else entry.get("corrections")
        with self.framework.weights_guard():
            self.correction.load_state_dict(saved, self.names)
            if saved is not None and saved.get("kind") != self.correction.name and saved.get("real_weights"):
                if not self.correction.holds_other_weights():
                    for name, w in zip(self.names, self.framework.weights()):
                        self.ops.assign(w, saved["real_weights"][name])

    # -------------------------------------------------------------------- Horovod elastic
    def check_elastic_support(self) -> None:
        if self.auto_controller is not None:
            raise ValueError("Horovod elastic (TorchState, KerasState) does not support width='auto' or "
                             "compression='auto' yet: pass a fixed width and compression")
        if not self.correction.elastic:
            runs = " / ".join(repr(name) for name, cls in corrections.CORRECTIONS.items() if cls.elastic)
            raise ValueError(f"Horovod elastic (TorchState, KerasState) does not support "
                             f"staleness_correction={self.correction.name!r} yet: use {runs} or none")

    def elastic_restore(self, entry: Optional[Dict[str, Any]]) -> None:
        """After HorovodInternalError (a worker was lost): drop what is in flight, unwaited, and
        go back to the committed entry. Horovod is broken here: no collective."""
        self.engine.abandon()
        self.close_comm()  # its peers are gone or about to be; elastic_sync builds it anew
        self._set_engine(self._new_engine(check_ranks=False))
        if entry is not None:
            self.engine.load_state_dict(entry)

    def elastic_sync(self, root_state: Callable[[], Any] = lambda: None,
                     load_root_state: Callable[[Any], None] = lambda state: None) -> None:
        """On every rank of a new world (after a reset, and at the start): drop the old world's
        unreduced steps, rebuild the pipeline for this world (cross-rank check included) and
        continue from rank 0's state: ``root_state()`` (the wrapped optimizer's, loaded with
        ``load_root_state``), the reduced in-flight gradients and the step count; error-feedback
        residuals start afresh (pipesgd_hvd.optimizer.elastic_rule). The staleness correction takes rank
        0's state, settled: the real weights in the model, nothing of a rank's own kept."""
        held = self.engine.abandon()
        if self._comm_factory is not None:  # the old world's connections; every rank is here: build anew
            self.close_comm()
            self.comm = self._comm_factory()
            if self.auto_controller is not None:
                self.auto_controller.comm = self.comm
        self._name = agree_pipeline_name(self.comm)  # collective: every rank of the new world is here
        if not isinstance(self.options.hierarchical, Topology):  # the new world's hosts, on every rank alike
            if self.topology is not None:
                self.topology.close()
            self.topology = self._new_topology()
        self._set_engine(self._new_engine())
        root = None
        if self.comm.rank == 0:
            with self.framework.weights_guard():
                correction = self.correction.state_dict(self.names)
            root = (root_state(), elastic_rule.state_for_new_world(held, self.engine.codec.state_dict()), correction)
        outer, entry, correction = self.comm.allgather_object(root, f"{self._name}.elastic")[0]
        load_root_state(outer)
        self.engine.load_state_dict(entry)
        with self.framework.weights_guard():
            self.correction.load_state_dict(correction, self.names)
            self.correction.before_flush()
            self.correction.flushed()


    def close_comm(self, at_exit: bool = False) -> None:
        """Closes the transport if it is this optimizer's own (built by ``comm_factory``), and the
        node groups built over it (not a Topology the user passed). ``at_exit``: one optimizer
        finishing; a shared transport (``closes_at_exit``) stays open for the others' exit
        handlers and is closed after them (comm/ordered.py); this optimizer's node groups close."""
        if self.topology is not None and not isinstance(self.options.hierarchical, Topology):
            self.topology.close()
            self.topology = None
        if at_exit and getattr(self.comm, "closes_at_exit", False):
            return
        close = getattr(self.comm, "close", None)
        if self._comm_factory is not None and close is not None:
            close()


def weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` without a reference to its object (a callback kept by something the object owns)."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        if bound is None:
            raise ReferenceError("the optimizer this callback belongs to is gone")
        return bound(*args, **kwargs)

    return call


def call_at_exit(owner: Any, method: Callable[[Any], None]) -> None:
    """Runs ``method(owner)`` at interpreter exit if ``owner`` is still alive then (a weak
    reference: an optimizer dropped earlier is not kept alive by it)."""
    ref = weakref.ref(owner)

    def finish() -> None:
        alive = ref()
        if alive is not None:
            method(alive)

    atexit.register(finish)
