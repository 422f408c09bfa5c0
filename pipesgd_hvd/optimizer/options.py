"""Every argument the pipelined optimizers take, checked once for every framework.

:meth:`PipelineOptions.from_arguments` reads Horovod's arguments and ours the way PyTorch's and
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
from ..staleness.formulas import DEFAULT_DC_LAMBDA, check_dc_lambda
from ..staleness.rule import choose as choose_correction

#: ``staleness_correction`` values: weight prediction (:mod:`pipesgd_hvd.staleness.prediction`, extrapolating
#: the last update, or Adam's own next step), the gradient-side corrections of
#: :mod:`pipesgd_hvd.staleness.corrections`, and the split-batch rule
#: (:mod:`pipesgd_hvd.staleness.split_batch`, ACCO: half of each update's gradient is fresh).
STALENESS_CORRECTIONS = ("weight_prediction", "adam_prediction", "delay_compensation", "eager", "split_batch")
#: The corrections that keep per-step state in the pipeline (not weight prediction).
GRADIENT_CORRECTIONS = ("delay_compensation", "eager", "split_batch")


@dataclass(frozen=True)
class PipelineOptions:
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
                       backward_passes_per_step: Any = 1,
                       sparse_as_dense: Any = False, auto_measure_steps: Any = 10, auto_recheck_every: Any = 500,
                       communicator: Any = None, process_set: Any = None, hvd: Any = None,
                       optimizer_family: Optional[str] = None, hierarchical: Any = None,
                       grad_scaler: bool = False) -> "PipelineOptions":
        """``hvd``: the Horovod module of the framework, if installed (resolves ``hvd.Average``,
        ``hvd.Sum``, ``hvd.Adasum`` and the global process set). ``optimizer_family``: the
        wrapped optimizer's (:data:`pipesgd_hvd.staleness.rule.FAMILIES`), which
        ``staleness_correction="auto"`` chooses by; ``grad_scaler``: a loss scaler is in use."""
        check_global_process_set(process_set, hvd)
        if not isinstance(sparse_as_dense, bool):
            raise ValueError(f"sparse_as_dense must be True or False, got {sparse_as_dense!r}")
        auto = AutoSettings.from_arguments(width, compression, auto_measure_steps, auto_recheck_every)
        options = cls(width=width, compression=compression, warmup_steps=warmup_steps,
                      fusion_threshold_bytes=fusion_threshold_bytes(fusion_threshold_mb), op=resolve_reduce_op(op, hvd),
                      gradient_predivide_factor=gradient_predivide_factor, seed=seed,
                      check_replicas_every=check_replicas_every or 0,
                      staleness_correction=check_staleness_correction(staleness_correction),
                      dc_lambda=check_dc_lambda(dc_lambda),
                      backward_passes_per_step=check_backward_passes(backward_passes_per_step),
                      sparse_as_dense=sparse_as_dense, auto=auto, communicator=communicator,
                      hierarchical=check_hierarchical(hierarchical))
        if options.staleness_correction == "auto":
            options = options.replace(staleness_correction=choose_correction(
                optimizer_family, lambda name: correction_refusal(options.replace(staleness_correction=name),
                                                                  grad_scaler) is None))
        refusal = correction_refusal(options, grad_scaler)
        if refusal is not None:
            raise ValueError(refusal)
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
                                      ("sparse_as_dense", self.sparse_as_dense)))

    def node_dtype(self) -> str:
        """What a hierarchical reduction sends inside the node: float32, or the 16-bit cast
        ``hierarchical`` names."""
        return _NODE_DTYPES.get(self.hierarchical, "float32") if isinstance(self.hierarchical, str) else "float32"

    def replace(self, **changes: Any) -> "PipelineOptions":
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


def correction_refusal(options: PipelineOptions, grad_scaler: bool = False) -> Optional[str]:
    """Why the staleness correction cannot run with the other settings (None: it can). The
    gradient-side corrections keep state per in-flight step, which the auto mode's rebuilds would
    drop mid-run, and mix gradients scaled by different loss scales; eager swaps this rank's share
    of an average, so needs one; the split-batch rule pairs steps two by two, which one step in
    flight allows."""
    correction = options.staleness_correction
    if correction not in GRADIENT_CORRECTIONS:
        return None
    if options.auto is not None:
        return (f"staleness_correction={correction!r} does not support width='auto' or compression='auto' yet: pass "
                "a fixed width and compression")
    if grad_scaler:
        return (f"staleness_correction={correction!r} does not support grad_scaler yet: train without a GradScaler "
                "(bf16 autocast needs none), or use 'weight_prediction'")
    if correction == "split_batch" and options.width not in (1, 2):
        return (f"staleness_correction='split_batch' pairs two consecutive steps into one update (a look-ahead half "
                f"and a real half), which needs width=2 (or 1: synchronous), got width={options.width!r}")
    if correction == "eager" and options.op != ReduceOp.AVERAGE:
        return ("staleness_correction='eager' swaps this rank's 1/size share of an average, so it needs op=hvd.Average "
                "(the default): drop op=hvd.Sum, or use 'delay_compensation'")
    if correction == "eager" and options.check_replicas_every:
        return ("staleness_correction='eager' makes replicas differ between steps by design (each rank applies its own "
                "fresh gradient), so check_replicas_every cannot be used with it: set check_replicas_every=0, or use "
                "'delay_compensation'")
    return None


def check_staleness_correction(value: Any) -> Optional[str]:
    """``staleness_correction``: False/None (default), True (weight prediction), ``"auto"`` (kept:
    the rule of :mod:`pipesgd_hvd.staleness.rule` resolves it once the other settings are known)
    or a name of :data:`STALENESS_CORRECTIONS`."""
    if value is False or value is None:
        return None
    if value is True:
        return "weight_prediction"
    if isinstance(value, str) and (value == "auto" or value in STALENESS_CORRECTIONS):
        return value
    raise ValueError(f"staleness_correction must be False, True, 'auto' or "
                     f"{' / '.join(map(repr, STALENESS_CORRECTIONS))}, got {value!r}")
