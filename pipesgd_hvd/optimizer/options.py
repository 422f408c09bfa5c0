"""Every argument the pipelined optimizers take, checked once for every framework.

:meth:`OptimizerOptions.from_arguments` reads Horovod's arguments and ours the way PyTorch's and
Keras's ``DistributedOptimizer`` both receive them, and raises a ValueError naming the argument
and the fix before anything collective happens (a bad argument is the same on every rank, so
every rank raises and none is left waiting).
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..auto.controller import AutoSettings
from ..comm.base import ReduceOp
from ..comm.topology import Topology
from ..compression import Compression, resolve_compression
from ..pipeline.config import PipelineConfig
from ..pipeline.fusion import DEFAULT_FUSION_THRESHOLD
from ..staleness.choice import advice, choose as choose_correction
from ..staleness.registry import CORRECTIONS, correction_class
from ..staleness.formulas import DEFAULT_DC_LAMBDA, check_dc_lambda
from ..staleness.split_batch import DEFAULT_FRESH_FRACTION, check_fresh_fraction


@dataclass(frozen=True)
class OptimizerOptions:
    """The settings of one pipelined optimizer, validated. ``auto`` is set when ``width`` or
    ``compression`` is ``"auto"``; the pipeline then starts with ``initial()``."""

    width: Any = 2                      # int >= 1, or "auto"
    compression: Any = Compression.none  # a codec, a codec name, a Horovod compressor, or "auto"
    warmup_steps: int = 0
    fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD
    op: ReduceOp = ReduceOp.AVERAGE
    gradient_predivide_factor: float = 1.0
    seed: int = 0
    check_replicas_every: int = 0
    staleness_correction: Optional[str] = None
    dc_lambda: float = DEFAULT_DC_LAMBDA
    fresh_fraction: float = DEFAULT_FRESH_FRACTION
    advice: Optional[str] = None        # printed once at construction (staleness/choice.py)
    backward_passes_per_step: int = 1
    sparse_as_dense: bool = False
    auto: Optional[AutoSettings] = None
    communicator: Any = None            # a Communicator, a transport name, or None (the default)
    hierarchical: Any = None            # None (on where it helps), True, False, "fp16", "bf16", or a Topology

    @classmethod
    def from_arguments(cls, *, width: Any = 2, compression: Any = Compression.none, warmup_steps: Any = 0,
                       fusion_threshold_mb: Any = DEFAULT_FUSION_THRESHOLD / 2**20, op: Any = None,
                       gradient_predivide_factor: Any = 1.0, seed: Any = 0, check_replicas_every: Any = None,
                       staleness_correction: Any = False, dc_lambda: Any = DEFAULT_DC_LAMBDA,
                       fresh_fraction: Any = DEFAULT_FRESH_FRACTION, backward_passes_per_step: Any = 1,
                       sparse_as_dense: Any = False, auto_measure_steps: Any = 10, auto_recheck_every: Any = 500,
                       communicator: Any = None, process_set: Any = None, hvd: Any = None,
                       optimizer_family: Optional[str] = None, optimizer_name: str = "the optimizer",
                       hierarchical: Any = None, grad_scaler: bool = False) -> "OptimizerOptions":
        """``hvd``: the Horovod module of the framework, if installed (resolves ``hvd.Average``,
        ``hvd.Sum``, ``hvd.Adasum`` and the global process set). ``optimizer_family``: the
        wrapped optimizer's (:data:`pipesgd_hvd.staleness.choice.FAMILIES`), which
        ``staleness_correction="auto"`` chooses by and the advice quotes (with ``optimizer_name``);
        ``grad_scaler``: a loss scaler is in use."""
        check_global_process_set(process_set, hvd)
        if not isinstance(sparse_as_dense, bool):
            raise ValueError(f"sparse_as_dense must be True or False, got {sparse_as_dense!r}")
        auto = AutoSettings.from_arguments(width, compression, auto_measure_steps, auto_recheck_every)
        options = cls(width=width, compression=compression, warmup_steps=warmup_steps,
                      fusion_threshold_bytes=fusion_threshold_bytes(fusion_threshold_mb), op=resolve_reduce_op(op, hvd),
                      gradient_predivide_factor=gradient_predivide_factor, seed=seed,
                      check_replicas_every=check_replicas_every or 0,
                      staleness_correction=check_staleness_correction(staleness_correction),
                      dc_lambda=check_dc_lambda(dc_lambda), fresh_fraction=check_fresh_fraction(fresh_fraction),
                      backward_passes_per_step=check_backward_passes(backward_passes_per_step),
                      sparse_as_dense=sparse_as_dense, auto=auto, communicator=communicator,
                      hierarchical=check_hierarchical(hierarchical))
        chosen_by_auto = options.staleness_correction == "auto"
        if chosen_by_auto:
            options = options.replace(staleness_correction=choose_correction(
                optimizer_family, lambda name: correction_refusal(options.replace(staleness_correction=name),
                                                                  grad_scaler) is None))
        refusal = correction_refusal(options, grad_scaler)
        if refusal is not None:
            raise ValueError(refusal)
        correction = correction_class(options.staleness_correction)
        if options.auto is not None:  # what the auto mode may choose, and what a step is
            two_calls = correction.calls_per_update == 2
            options = options.replace(auto=dataclasses.replace(
                options.auto, calls_per_update=correction.calls_per_update,
                fresh_fraction=options.fresh_fraction if two_calls else 0.0,
                pipelining=two_calls or optimizer_family not in ("adam", "adaptive")))
        options = options.replace(advice=advice(optimizer_family, optimizer_name, width, options.staleness_correction,
                                                chosen_by_auto, correction.calls_per_update))
        options.config("psgd")                   # bad pipeline settings fail here
        resolve_compression(options.initial()[1])  # so does an unknown codec
        return options

    def initial(self) -> Tuple[int, Any]:
        """(width, compression) the pipeline starts with (synchronous and uncompressed while the
        auto mode measures, unless one of them is fixed)."""
        return self.auto.initial() if self.auto is not None else (self.width, self.compression)

    def config(self, name: str, width: Optional[int] = None, hierarchical: Optional[str] = None) -> PipelineConfig:
        """The engine's settings, named ``name``, at ``width`` (default: the initial one);
        ``hierarchical``: the dtype inside the node of a hierarchical pipeline (None: flat)."""
        return PipelineConfig(width=self.initial()[0] if width is None else width, warmup_steps=self.warmup_steps,
                              fusion_threshold_bytes=self.fusion_threshold_bytes, op=self.op,
                              gradient_predivide_factor=self.gradient_predivide_factor, name=name, seed=self.seed,
                              check_replicas_every=self.check_replicas_every, hierarchical=hierarchical,
                              agreed=(("staleness_correction", self.staleness_correction), ("dc_lambda", self.dc_lambda),
                                      ("backward_passes_per_step", self.backward_passes_per_step),
                                      ("sparse_as_dense", self.sparse_as_dense), ("fresh_fraction", self.fresh_fraction)))

    def node_dtype(self) -> str:
        """What a hierarchical reduction sends inside the node: float32, or the 16-bit cast
        ``hierarchical`` names."""
        return _NODE_DTYPES.get(self.hierarchical, "float32") if isinstance(self.hierarchical, str) else "float32"

    def replace(self, **changes: Any) -> "OptimizerOptions":
        return dataclasses.replace(self, **changes)


#: ``hierarchical`` values that choose a 16-bit node stage, and that dtype.
_NODE_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def check_hierarchical(value: Any) -> Any:
    """``hierarchical``: None (hierarchical where each host holds several ranks and there are
    several hosts), True (always, float32 inside the node), False (never), "fp16" / "bf16" (as
    True, a 16-bit cast inside the node, summed in float32), or a
    :class:`~pipesgd_hvd.comm.topology.Topology` (its groups, for a communicator of your own)."""
    if value is None or isinstance(value, (bool, Topology)) or (isinstance(value, str) and value in _NODE_DTYPES):
        return value
    raise ValueError(f"hierarchical must be None (on where each host holds several ranks), True, False, 'fp16', "
                     f"'bf16' or a pipesgd_hvd.comm.topology.Topology, got {value!r}")


def resolve_reduce_op(op: Any, hvd: Optional[Any] = None) -> ReduceOp:
    """``op`` as Horovod users pass it (``hvd.Average``, ``hvd.Sum``, a string, or None)."""
    if isinstance(op, ReduceOp):
        return op
    if op is None or (isinstance(op, str) and op.lower() == "average"):
        return ReduceOp.AVERAGE
    if isinstance(op, str) and op.lower() == "sum":
        return ReduceOp.SUM
    if hvd is not None and isinstance(op, int) and not isinstance(op, bool):
        if op == hvd.Average:
            return ReduceOp.AVERAGE
        if op == hvd.Sum:
            return ReduceOp.SUM
        if op == hvd.Adasum:
            raise ValueError("op=Adasum is not supported by pipesgd_hvd (it is not a sum of gradients, so it "
                             "cannot be pipelined or compressed): use op=Average, or keep Horovod's own "
                             "DistributedOptimizer for Adasum")
    raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")


def check_backward_passes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {value!r}")
    return int(value)


def fusion_threshold_bytes(megabytes: Any) -> int:
    if isinstance(megabytes, bool) or not isinstance(megabytes, (int, float)) or not 0 <= megabytes < float("inf"):
        raise ValueError(f"fusion_threshold_mb must be a finite number >= 0 (MiB; 0: one bucket per tensor), "
                         f"got {megabytes!r}")
    return int(megabytes * 2**20)


def check_global_process_set(process_set: Any, hvd: Optional[Any]) -> None:
    if process_set is None:
        return
    if hvd is None:
        raise ValueError("process_set needs Horovod, which is not installed; omit process_set")
    if process_set is not hvd.global_process_set:
        raise ValueError("pipesgd_hvd supports only Horovod's global process set; omit process_set (or keep Horovod's "
                         "own DistributedOptimizer for a process set)")


def correction_refusal(options: OptimizerOptions, grad_scaler: bool = False) -> Optional[str]:
    """Why the staleness correction cannot run with the other settings (None: it can): each
    correction says it (:meth:`~pipesgd_hvd.staleness.correction.Correction.refusal`)."""
    return correction_class(options.staleness_correction).refusal(options, grad_scaler)


def check_staleness_correction(value: Any) -> Optional[str]:
    """``staleness_correction``: False/None (default), True (weight prediction), ``"auto"`` (kept:
    :mod:`pipesgd_hvd.staleness.choice` resolves it once the other settings are known) or the
    name of a correction (:data:`pipesgd_hvd.staleness.registry.CORRECTIONS`)."""
    if value is False or value is None:
        return None
    if value is True:
        return "weight_prediction"
    names = sorted(CORRECTIONS)
    if isinstance(value, str) and (value == "auto" or value in names):
        return value
    raise ValueError(f"staleness_correction must be False, True, 'auto' or {' / '.join(map(repr, names))}, "
                     f"got {value!r}")
