"""The pipeline's arithmetic, written once for the eager engine and TensorFlow's traced step.

Which step's gradient is applied when, which slot holds a pending gradient, what each collective
is called and how its stochastic rounding is seeded. Every function here works on Python ints
and on traced integer tensors alike (it uses only ``+ - % < >= & |``, which TensorFlow overloads
element-wise), so the eager :class:`~pipesgd_hvd.pipeline.engine.PipelineEngine` calls it with ints and
``keras/traced_engine.py`` with its step-counter variable, and both follow one rule::

    width K, warm-up W (steps 0 .. W-1 synchronous), the pipeline (re)starting at ``start``
    (W at first, the step after a flush later):
    step s < W          applies its own gradient (synchronous)
    s >= start + K - 1  applies the gradient of step s - K + 1 (staleness K - 1)
    otherwise           applies nothing (the pipeline fills)

A pending gradient waits in slot ``(s - start) % (K - 1)`` until it is applied.
"""
from __future__ import annotations

from typing import Any, List

from ..compression.allreduce import allreduce_wire_bytes
from ..ops.seeds import Seed, derive_seed
from .config import PipelineConfig
from .fusion import FusionLayout

Step = Any  # a Python int, or a traced integer tensor


class Schedule:
    """The rule above for one :class:`~pipesgd_hvd.pipeline.config.PipelineConfig`."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.width, self.warmup = config.width, config.warmup_steps

    # ------------------------------------------------------------------------- which step applies
    def width_at(self, step: int) -> int:
        """The width in force at ``step``: 1 during warm-up."""
        return 1 if step < self.warmup else self.width

    def in_warmup(self, step: Step) -> Any:
        return step < self.warmup

    def has_stale(self, step: Step, start: Step) -> Any:
        """Whether step ``step - K + 1``'s gradient is pending and applied at ``step``."""
        return step >= start + self.width - 1

    def applies(self, step: Step, start: Step) -> Any:
        """Whether ``step`` applies any gradient (False while the pipeline fills)."""
        return self.in_warmup(step) | self.has_stale(step, start)

    def pending_slot(self, step: Step, start: Step) -> Step:
        """The slot (of K - 1) that holds step ``step``'s gradient until it is applied; the same
        slot then holds the stale gradient that ``step`` applies (read before it is written)."""
        return (step - start) % max(self.width - 1, 1)

    def flush_order(self, step: int, start: int) -> List[int]:
        """Slots still pending after ``step`` steps ended, oldest first (eager only)."""
        ages = range(min(step - start, self.width - 1), 0, -1)
        return [self.pending_slot(step - age, start) for age in ages]

    def replica_check_due(self, step: Step) -> Any:
        """Whether the replica check runs at ``step`` (every ``check_replicas_every`` steps)."""
        every = self.config.check_replicas_every
        if not every:
            return False
        return (step > 0) & (step % every == 0)

    # ------------------------------------------------------------------------ names and seeds
    def op_name(self, layout: FusionLayout, bucket: int, tag: str) -> str:
        """The name of one bucket's reduction, the same on every rank. ``tag`` tells apart
        reductions that can be in flight at once: the eager engine's ``slot_tag(step)``, or the
        traced step's roles ("stale", "sync", "flush")."""
        return f"{self.config.name}.{layout.key}.b{bucket}.{tag}"

    def slot_tag(self, step: int) -> str:
        """Up to K steps are in flight at once; step s reuses the names of step s - K."""
        return f"s{step % self.width}"

    def state_key(self, layout: FusionLayout, bucket: int) -> str:
        """The key of one bucket's codec state (error-feedback residuals), per tensor set."""
        return f"{layout.key}.b{bucket}"

    def seed(self, bucket: int, rank: int, step: Step) -> Seed:
        return Seed(derive_seed(self.config.seed, bucket, rank), step)

    # ----------------------------------------------------------------------------- wire bytes
    def fp32_wire_bytes(self, layout: FusionLayout, size: int) -> int:
        """What a float32 ring all-reduce of every bucket of ``layout`` sends from one rank."""
        return sum(allreduce_wire_bytes(b.numel, "float32", size) for b in layout.buckets)
