"""Checks of the optimizer arguments that every framework adapter shares (Horovod's names)."""
from __future__ import annotations

from typing import Any, Optional

from .comm.base import ReduceOp


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
                             "cannot be pipelined or compressed): use op=Average")
    raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")


def check_backward_passes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {value!r}")
    return value


def fusion_threshold_bytes(megabytes: Any) -> int:
    if isinstance(megabytes, bool) or not isinstance(megabytes, (int, float)) or not 0 <= megabytes < float("inf"):
        raise ValueError(f"fusion_threshold_mb must be a finite number >= 0 (MiB; 0: one bucket per tensor), "
                         f"got {megabytes!r}")
    return int(megabytes * 2**20)


def check_global_process_set(process_set: Any, hvd: Optional[Any]) -> None:
    if process_set is not None and hvd is not None and process_set is not hvd.global_process_set:
        raise ValueError("pipesgd_hvd supports only Horovod's global process set; omit process_set")


def check_staleness_correction(value: Any) -> bool:
    """``staleness_correction``: False (default) or True / "weight_prediction"."""
    if value in (False, None):
        return False
    if value is True or value == "weight_prediction":
        return True
    raise ValueError(f"staleness_correction must be False, True or 'weight_prediction', got {value!r}")


def check_no_auto(width: Any, compression: Any, framework: str) -> None:
    """``width="auto"`` / ``compression="auto"`` (chosen from measurements) exist only in the
    PyTorch adapter for now; elsewhere say so and what to pass, instead of "unknown compression"."""
    instead = {"width": "width=2 (Pipe-SGD, the default) or width=1 (synchronous)",
               "compression": "a fixed codec: compression='int8' (or 'fp16', 'int4'; 'none', the default)"}
    for name, value in (("width", width), ("compression", compression)):
        if isinstance(value, str) and value == "auto":
            raise ValueError(f"{name}='auto' is supported by pipesgd_hvd.torch only for now; with {framework} "
                             f"pass {instead[name]}")
