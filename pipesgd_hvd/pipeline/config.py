"""Settings of one pipeline (the same on every rank) and its byte counters.

Shared by the eager engine (:mod:`pipesgd_hvd.pipeline.engine`), TensorFlow's traced executor
(``keras/traced_engine.py``), the cross-rank checks and the optimizer core; it imports none of them.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from ..comm.base import ReduceOp
from ..compression.hierarchical import LOCAL_DTYPES
from .fusion import DEFAULT_FUSION_THRESHOLD


#: The widest pipeline accepted. A width-K pipeline keeps K - 1 steps in flight (each a copy of
#: every gradient), applies nothing for its first K - 1 steps and applies each gradient K - 1
#: steps late; Pipe-SGD's analysis picks 2, and nothing here was measured past 3. A larger value
#: is far more likely a mistake (width=1000 would apply nothing for 999 steps) than a choice.
MAX_WIDTH = 8


def integer(name: str, value: Any, minimum: int, hint: str = "") -> int:
    """``value`` as an int >= ``minimum`` (numpy ints too), or a ValueError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{hint}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class PipelineConfig:
    """Settings of one pipeline (the same on every rank; checked at construction).

    ``check_replicas_every``: compare a checksum of every parameter across ranks every that many
    steps (0: never); see :mod:`pipesgd_hvd.pipeline.guards`. ``hierarchical``: byte codecs reduce
    in two levels (``compression/hierarchical.py``), the dtype named here inside the node
    ("float32", "float16" or "bfloat16"); None: one flat reduction over all ranks."""

    width: int = 2
    warmup_steps: int = 0
    fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD
    op: ReduceOp = ReduceOp.AVERAGE
    gradient_predivide_factor: float = 1.0
    name: str = "psgd"
    seed: int = 0
    check_replicas_every: int = 0
    hierarchical: Optional[str] = None
    #: further settings that must be equal on every rank, as (name, value) pairs: the optimizer's
    #: own (staleness_correction, dc_lambda, backward_passes_per_step, sparse_as_dense), which the
    #: engine does not use but whose mismatch would make the replicas drift apart silently
    agreed: Tuple[Tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        # Frozen: normalised values (numpy ints -> int) are written through object.__setattr__.
        fix = lambda field_name, value: object.__setattr__(self, field_name, value)  # noqa: E731
        fix("width", integer("width", self.width, 1, " (1 = synchronous, 2 = Pipe-SGD)"))
        if self.width > MAX_WIDTH:
            raise ValueError(f"width={self.width} is more than {MAX_WIDTH}: a width-K pipeline applies nothing for its "
                             f"first K - 1 steps, keeps K - 1 copies of every gradient in flight and applies each one "
                             f"K - 1 steps late ({self.width - 1} here); use width=2 (Pipe-SGD) or width='auto'")
        fix("warmup_steps", integer("warmup_steps", self.warmup_steps, 0))
        fix("fusion_threshold_bytes", integer("fusion threshold", self.fusion_threshold_bytes, 0, " bytes"))
        fix("seed", integer("seed", self.seed, 0, " (the same on every rank)"))
        fix("check_replicas_every", integer("check_replicas_every", self.check_replicas_every, 0,
                                            " steps (0 or None: never)"))
        if not isinstance(self.op, ReduceOp):
            raise ValueError(f"op must be Average or Sum, got {self.op!r}")
        factor = self.gradient_predivide_factor
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 0 < factor < math.inf:
            raise ValueError(f"gradient_predivide_factor must be a finite number > 0, got {factor!r}")
        fix("gradient_predivide_factor", float(factor))
        if self.gradient_predivide_factor != 1.0 and self.op is not ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor is only supported with op=Average (as in Horovod)")
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a str, got {self.name!r}")
        if not isinstance(self.agreed, tuple) or not all(
                isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str) for e in self.agreed):
            raise ValueError(f"agreed must be a tuple of (name, value) pairs, got {self.agreed!r}")
        if self.hierarchical not in (None, *LOCAL_DTYPES):
            raise ValueError(f"hierarchical must be None or one of {', '.join(LOCAL_DTYPES)} (the dtype inside the "
                             f"node), got {self.hierarchical!r}")

    def scale_factors(self) -> Tuple[float, float]:
        """(prescale, postscale) as Horovod splits an average around the sum."""
        if self.op is ReduceOp.AVERAGE:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0


def settings_entries(config: PipelineConfig, codec_name: str) -> List[Tuple[str, Any]]:
    """The settings that must be equal on every rank, as (name, value) pairs (checked across
    ranks and saved with checkpoints). ``seed`` too: it seeds the codecs' stochastic rounding, and
    ranks with different seeds round differently without any error."""
    return [("width", config.width), ("warmup_steps", config.warmup_steps), ("op", config.op.value),
            ("fusion_threshold_bytes", config.fusion_threshold_bytes),
            ("gradient_predivide_factor", config.gradient_predivide_factor), ("compression", codec_name),
            ("check_replicas_every", config.check_replicas_every), ("hierarchical", config.hierarchical),
            ("seed", config.seed), *config.agreed]


@dataclass
class WireStats:
    """Bytes this rank sent, next to what a float32 ring all-reduce would have sent."""

    steps: int = 0
    bytes_sent: int = 0
    fp32_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.bytes_sent / self.fp32_bytes if self.fp32_bytes else 1.0
