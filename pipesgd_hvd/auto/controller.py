"""``width="auto"`` / ``compression="auto"`` at run time: measure, agree, switch. Framework-free.

The decision rule is :mod:`pipesgd_hvd.auto.rule`; this module feeds it and carries it out. An adapter
(PyTorch's ``DistributedOptimizer``; Keras can reuse it) builds its engine with
:meth:`AutoSettings.initial` and calls two hooks per step::

    controller.reduction_started()                  # entering our code: the user's compute ends
    applied = engine.end_step(meta)
    applied += controller.after_step(engine, applied)   # steps to apply now (a flush at a check)

and supplies ``rebuild(width, compression)``, which closes the engine and builds the next one
(``first_step=engine.step``). Timeline, in engine steps (the same on every rank):

* steps ``0 .. measure_steps-1`` run synchronously (width 1; uncompressed unless the codec is
  fixed). Compute time per step is the time spent outside our code: from the end of one step's
  reduction to the start of the next one's (forward, backward, the update, data loading), the
  median over the window (the first step, which has no previous end, is not counted);
* at the end of step ``measure_steps-1`` (a *check*): flush the engine (whatever is in flight is
  returned for the adapter to apply: nothing is lost), gather every rank's compute time, then
  time the reductions themselves, synchronously, on the step's averaged gradient: the float32
  all-reduce first, then each candidate codec's compressed all-reduce, least lossy first (one
  warm-up, which also lines the ranks up, then the median of ``repeats``; with the CPU time the
  rank spent, or on a GPU the codec's own GPU time, timed with CUDA events). After each, one small ``allgather_object`` takes the slowest rank's numbers, and
  the loop stops as soon as the lossier codecs cannot change the choice
  (:func:`~pipesgd_hvd.auto.rule.settled`): every rank runs the same collectives and decides the same
  from the same numbers (:func:`~pipesgd_hvd.auto.rule.decide_fixed`). If the choice differs from the
  running configuration, every rank rebuilds its engine at this same step;
* every ``recheck_every`` steps after that, another check. Compute time then comes from the
  pipelined steps before it (the last ``measure_steps`` of them): time outside our waits, which in
  pipelined mode includes whatever the overlapping communication slows compute down by, i.e. what
  a step actually costs. Cost of a check: the flush (one step's communication is not hidden, and
  a width-K pipeline refills: its next K-1 steps apply nothing, the flushed gradient having been
  applied early), ``repeats + 1`` reductions per codec timed (at most one per candidate) and a
  few small allgathers; every 500 steps that is about 1-2% of training time.

Switching codec drops the old codec's error-feedback residual (at most one step's quantization
error; a new codec starts with none).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import math
import numbers
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Protocol, Sequence, Tuple

from ..comm.base import Communicator, DoneHandle
from ..comm.topology import Topology
from ..compression import resolve_compression
from ..compression.allreduce import compressed_allreduce, reduce_bucket
from ..compression.hierarchical import hierarchical_allreduce
from ..compression.codecs import Codec
from ..ops.base import MutableTensorOps, Tensor
from ..ops.seeds import Seed
from ..pipeline.engine import AppliedStep
from ..pipeline.fusion import TensorSpec
from .model import CODECS
from .rule import (CANDIDATES, TOLERANCE, Decision, Measurements, decide_fixed, hierarchical_label, settled,
                   with_hierarchical)

AUTO = "auto"
GATHER_NAME = "pipesgd.auto"
log = logging.getLogger("pipesgd_hvd.auto.rule")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


@dataclass(frozen=True)
class AutoSettings:
    """What the auto mode may choose (``None``: chosen from measurements; else fixed as given) and
    when it measures. The same on every rank (checked at every check)."""

    width: Optional[int]
    compression: Any
    measure_steps: int = 10
    recheck_every: int = 500            # 0: never re-check
    sync_fraction: float = 0.05
    tolerance: float = TOLERANCE
    candidates: Tuple[str, ...] = CANDIDATES
    pipelining: bool = True             # False: a width chosen here is 1 (Adam's kin without the accurate mode)
    calls_per_update: int = 1           # calls of step() per pipeline step (2: staleness_correction="split_batch")
    fresh_fraction: float = 0.0         # the share of a step's compute its reduction cannot hide behind

    @classmethod
    def from_arguments(cls, width: Any, compression: Any, measure_steps: Any = 10,
                       recheck_every: Any = 500) -> Optional["AutoSettings"]:
        """The settings for an optimizer's ``width``/``compression`` arguments; None if neither is "auto"."""
        auto_width, auto_codec = _is_auto(width), _is_auto(compression)
        if not (auto_width or auto_codec):
            return None
        if isinstance(measure_steps, bool) or not isinstance(measure_steps, numbers.Integral) or measure_steps < 2:
            raise ValueError(f"auto_measure_steps must be an int >= 2 (the first step cannot be timed), "
                             f"got {measure_steps!r}")
        if recheck_every is None:
            recheck_every = 0
        if isinstance(recheck_every, bool) or not isinstance(recheck_every, numbers.Integral) or recheck_every < 0:
            raise ValueError(f"auto_recheck_every must be an int >= 1 (or 0/None: never), got {recheck_every!r}")
        if not auto_width and (isinstance(width, bool) or not isinstance(width, numbers.Integral) or width < 1):
            raise ValueError(f"width must be an int >= 1 or 'auto', got {width!r}")
        if not auto_codec:
            resolve_compression(compression)  # an unknown codec fails now, not at the first check
        return cls(None if auto_width else int(width), None if auto_codec else compression,
                   int(measure_steps), int(recheck_every))

    def initial(self) -> Tuple[int, Any]:
        """(width, compression) while measuring: synchronous, uncompressed unless the codec is fixed."""
        return 1, ("none" if self.compression is None else self.compression)

    def fixed_codec_name(self) -> Optional[str]:
        return None if self.compression is None else model_name(resolve_compression(self.compression))

    def entries(self) -> Tuple[Any, ...]:
        return (self.width, self.fixed_codec_name(), self.measure_steps, self.recheck_every,
                self.sync_fraction, self.tolerance, tuple(self.candidates), self.pipelining, self.calls_per_update,
                self.fresh_fraction)

    def timed_codecs(self) -> List[Codec]:
        """What a check times, in order: the float32 all-reduce (the link for the model, the
        synchronous option), then the fixed codec or the candidates, least lossy first."""
        rest = self.candidates if self.compression is None else (self.compression,)
        names = ["none", *(c for c in rest if not (isinstance(c, str) and c == "none"))]
        codecs = [resolve_compression(c) for c in names]
        return [c for i, c in enumerate(codecs) if model_name(c) not in {model_name(d) for d in codecs[:i]}]


def model_name(codec: Codec) -> str:
    """The timing model's name for a codec ("int8+ef" -> "int8"); its own name if the model has none."""
    base = codec.name.split("+")[0].split("-")[0]
    return base if base in CODECS else codec.name


class Engine(Protocol):
    """What a check needs of the running pipeline: the eager engine, or TensorFlow's."""

    specs: List[TensorSpec]

    @property
    def step(self) -> int: ...

    def flush(self) -> List[AppliedStep]:
        """Collective: every step in flight, reduced, oldest first."""
        ...


class Probe(Protocol):
    """Times one reduction (tests inject scripted numbers)."""

    def reduction(self, comm: Communicator, ops: MutableTensorOps, codec: Codec, flat: Tensor) -> Tuple[float, float]:
        """(seconds, what it costs compute) of one synchronous reduction of ``flat`` with ``codec``,
        as the engine runs it: the process's CPU seconds on host tensors, the codec's GPU seconds
        on device tensors. Collective. (A probe that times hierarchical candidates also takes
        ``topology=`` and ``node_dtype=``: the groups and the dtype inside the node.)"""
        ...


def _block(ops: MutableTensorOps, x: Tensor) -> None:
    """Wait until ``x`` is computed (a host copy of one element syncs a GPU's stream)."""
    ops.host_array(ops.reshape(x, (-1,))[:1])


class _Loopback:
    """A communicator of ``size`` ranks that moves nothing: the compressed all-reduce over it runs
    exactly the codec's own kernels (plus one copy for the gathered rows), for timing them."""

    rank = 0

    def __init__(self, ops: MutableTensorOps, size: int) -> None:
        self._ops, self.size = ops, size

    def alltoall_async(self, x: Tensor, name: str) -> DoneHandle:
        return DoneHandle(x)

    def allgather_async(self, x: Tensor, name: str) -> DoneHandle:
        return DoneHandle(self._ops.concat([x] * self.size, 0))


def codec_device_seconds(ops: MutableTensorOps, codec: Codec, flat: Tensor, size: int) -> Optional[float]:
    """GPU seconds of ``codec``'s own work in one reduction of ``flat`` over ``size`` ranks (encode,
    decode+sum, encode, decode), timed with events on the current stream; None for a host tensor.
    On a GPU this, not the process's CPU time, is what the codec takes from compute: its kernels
    share the device with the training step's."""
    codec = copy.deepcopy(codec)

    def work() -> Any:
        if codec.summable:
            return codec.decode(ops, *codec.encode(ops, flat, key="timing", seed=Seed(0)))
        return compressed_allreduce(ops, _Loopback(ops, size), codec, flat, name="timing", key="timing", seed=0)

    work()  # warm-up: kernels compiled and the allocator's blocks in place
    return ops.device_seconds(flat, work)[1]


class TimingProbe:
    """Wall-clock timings of the real reductions, and what each costs compute: the process's CPU
    time on host tensors, the codec's GPU time (CUDA events) on device tensors."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time, repeats: int = 3) -> None:
        self.clock, self.cpu_clock, self.repeats = clock, cpu_clock, repeats

    def reduction(self, comm: Communicator, ops: MutableTensorOps, codec: Codec, flat: Tensor,
                  topology: Optional[Topology] = None, node_dtype: str = "float32") -> Tuple[float, float]:
        """One warm-up (it also lines the ranks up and lets the transport set up its connections),
        then the median of ``repeats`` (wall) and of their process CPU time, which includes the
        transport's own threads: on a core shared with compute, that is what compute loses.
        ``flat`` may be overwritten; a private copy of ``codec`` keeps the pipeline's
        error-feedback residuals out of it. ``topology``: a byte codec's reduction is the
        hierarchical one over these groups, ``node_dtype`` inside the node."""
        codec = copy.deepcopy(codec)
        tag = f"{GATHER_NAME}.{codec.name}" + (".hier" if topology is not None else "")

        def reduce(name: str, seed: Seed) -> Tuple[Tensor, int]:
            if topology is not None and not codec.summable:
                return hierarchical_allreduce(ops, topology, codec, flat, name=name, key=tag, seed=seed,
                                              local_dtype=node_dtype)
            return reduce_bucket(ops, comm, codec, flat, name=name, key=tag, seed=seed).wait()

        reduce(f"{tag}.warmup", Seed(0))
        times, cpu = [], []
        for i in range(self.repeats):
            start, cpu_start = self.clock(), self.cpu_clock()
            out, _ = reduce(f"{tag}.{i}", Seed(i + 1))
            _block(ops, out)
            times.append(self.clock() - start)
            cpu.append(self.cpu_clock() - cpu_start)
        # (hierarchical: the flat reduction's codec work, an upper bound: the node stage leaves it less)
        on_device = codec_device_seconds(ops, codec, flat, comm.size)
        return statistics.median(times), (statistics.median(cpu) if on_device is None else on_device)


@dataclass(frozen=True)
class AutoRecord:
    """One check: the step it ran at, the gathered numbers (slowest rank) and the decision."""

    step: int
    measurements: Measurements
    decision: Decision


class AutoController:
    """Measures, gathers, decides and switches; see the module docstring for the timeline."""

    def __init__(self, settings: AutoSettings, comm: Communicator, ops: MutableTensorOps,
                 rebuild: Callable[[int, Any, bool], None], *, probe: Optional[Probe] = None,
                 clock: Callable[[], float] = time.perf_counter, topology: Optional[Topology] = None,
                 choose_hierarchy: bool = False, node_dtype: str = "float32") -> None:
        """``rebuild(width, compression, hierarchical)`` builds the next pipeline. ``topology``:
        the groups of hierarchical reductions, where there are (a byte codec is then timed and run
        hierarchically); ``choose_hierarchy``: time it flat too and take the better (the user
        left ``hierarchical`` to us)."""
        self.settings, self.comm, self.ops = settings, comm, ops
        self._rebuild = rebuild
        self.topology, self.choose_hierarchy, self.node_dtype = topology, choose_hierarchy, node_dtype
        self.probe: Probe = probe if probe is not None else TimingProbe()
        self.clock = clock
        self.width, self.compression = settings.initial()
        self.hierarchical = topology is not None  # what a byte codec runs as until a decision
        self.history: List[AutoRecord] = []
        self.next_check: Optional[int] = settings.measure_steps
        # One sample per call of step(); a pipeline step is calls_per_update of them.
        self._samples: Deque[float] = collections.deque(maxlen=settings.measure_steps * settings.calls_per_update)
        self._wait_started: Optional[float] = None
        self._last_end: Optional[float] = None

    @property
    def decision(self) -> Optional[Decision]:
        """The latest decision (None while measuring)."""
        return self.history[-1].decision if self.history else None

    # ------------------------------------------------------------------------------ hooks
    def reduction_started(self) -> None:
        """The adapter enters its end-of-step work: the user's compute of this step ends here."""
        if self._wait_started is None:
            self._wait_started = self.clock()

    def record_compute(self, seconds: float) -> None:
        """One step's compute time measured by the caller (TensorFlow times it inside the traced
        step), instead of :meth:`reduction_started`'s clock."""
        self._samples.append(max(float(seconds), 0.0))

    def after_step(self, engine: Engine, applied: Sequence[AppliedStep]) -> List[AppliedStep]:
        """Call right after ``engine.end_step`` returned ``applied``. At a check (collective on every
        rank at the same step) returns the flushed in-flight steps, oldest first, for the adapter to
        apply after ``applied``; the engine may have been rebuilt (read it again). Else ``[]``."""
        started, self._wait_started = self._wait_started, None
        if started is not None and self._last_end is not None:
            self._samples.append(max(started - self._last_end, 0.0))
        flushed: List[AppliedStep] = []
        if self.next_check is not None and engine.step >= self.next_check:
            flushed = self._check(engine, applied)
        self._last_end = self.clock()  # the check's own time is not the user's compute
        return flushed

    # ------------------------------------------------------------------------------ a check
    def _check(self, engine: Engine, applied: Sequence[AppliedStep]) -> List[AppliedStep]:
        flushed = engine.flush()  # collective; checks first that every rank ran as many steps
        latest = list(applied) + flushed
        nbytes = 4 * sum(math.prod(spec.shape) for spec in engine.specs)
        previous = self.history[-1].measurements.compute_s if self.history else 0.0
        mine = {"step": engine.step, "settings": self.settings.entries(), "gradient_bytes": nbytes,
                "compute_s": statistics.median(self._samples) * self.settings.calls_per_update if self._samples
                else previous}
        m = _slowest(self.comm.allgather_object(mine, GATHER_NAME))
        s = self.settings
        m = dataclasses.replace(m, fresh_fraction=s.fresh_fraction)
        if self.topology is not None:
            m = dataclasses.replace(m, local_size=self.topology.layout.local_size)
        for codec, label, topology in self._timed(s) if m.ranks > 1 else ():  # one rank: nothing to time
            flat = self._flat(latest[-1]) if latest else self.ops.zeros((nbytes // 4,), "float32")
            hier = {} if topology is None else {"topology": topology, "node_dtype": self.node_dtype}
            seconds, cpu = self.probe.reduction(self.comm, self.ops, codec, flat, **hier)
            theirs = self.comm.allgather_object((float(seconds), float(cpu)), f"{GATHER_NAME}.{label}")
            m = dataclasses.replace(m, reduction_s={**m.reduction_s, label: max(t for t, _ in theirs)},
                                    reduction_cpu_s={**m.reduction_cpu_s, label: max(c for _, c in theirs)})
            if label == "none":
                m = dataclasses.replace(m, allreduce_s=m.reduction_s["none"])
            if s.compression is None and settled(m, label, tolerance=s.tolerance, sync_fraction=s.sync_fraction,
                                                 pipelining=s.pipelining):
                break  # the lossier codecs cannot change the choice: not timed
        decision = decide_fixed(m, width=s.width, compression=s.fixed_codec_name(), sync_fraction=s.sync_fraction,
                                tolerance=s.tolerance, candidates=self._labels(s.candidates), pipelining=s.pipelining)
        self.history.append(AutoRecord(engine.step, m, decision))
        if self.comm.rank == 0:
            log.info("pipesgd_hvd auto, step %d: %s; measured (slowest of %d ranks): %s",
                     engine.step, decision.describe(), m.ranks, describe_measurements(m))
        self._samples.clear()
        self.next_check = engine.step + s.recheck_every if s.recheck_every else None
        chosen = (decision.width, decision.compression if s.compression is None else s.compression,
                  decision.hierarchical)
        if chosen != (self.width, self.compression, self.hierarchical):
            self.width, self.compression, self.hierarchical = chosen
            self._rebuild(*chosen)
        return flushed

    def _labels(self, candidates: Sequence[str]) -> Tuple[str, ...]:
        """The candidates as the rule sees them: byte codecs hierarchical where the groups exist,
        both ways where the choice is ours."""
        if self.topology is None:
            return tuple(candidates)
        both = with_hierarchical(candidates)
        return both if self.choose_hierarchy else tuple(c for c in both if c == "none" or c.endswith("/hier"))

    def _timed(self, s: AutoSettings) -> List[Tuple[Codec, str, Optional[Topology]]]:
        """What a check times, in order: (codec, label, the groups for a hierarchical timing)."""
        out: List[Tuple[Codec, str, Optional[Topology]]] = []
        for codec in s.timed_codecs():
            name = model_name(codec)
            if codec.summable or self.topology is None:
                out.append((codec, name, None))
                continue
            out.append((codec, hierarchical_label(name), self.topology))
            if self.choose_hierarchy:
                out.append((codec, name, None))
        return out

    def _flat(self, step: AppliedStep) -> Tensor:
        """The step's averaged gradient as one new float32 vector (the probe may overwrite it)."""
        ops = self.ops
        parts = [ops.cast(ops.reshape(g, (ops.numel(g),)), "float32") for _, g in sorted(step.grads.items())]
        return ops.concat(parts, 0)

    # ------------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Dict[str, Any]:
        """Plain values: the running configuration (a fixed codec is not saved: it is the one the
        optimizer is built with), the next check and the measured codec costs."""
        return {"width": self.width, "compression": self.compression if self.settings.compression is None else None,
                "hierarchical": self.hierarchical, "next_check": self.next_check,
                "history": [(r.step, r.decision.width, r.decision.compression, r.decision.reason)
                            for r in self.history]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores the configuration a checkpoint ran with (rebuilding the engine: collective, call
        on every rank, before loading the engine's state)."""
        chosen = (int(state["width"]), state["compression"] if self.settings.compression is None else self.compression,
                  bool(state.get("hierarchical", self.topology is not None)) and self.topology is not None)
        self.next_check = state["next_check"]
        self._samples.clear()
        self._wait_started = self._last_end = None
        if chosen != (self.width, self.compression, self.hierarchical):
            self.width, self.compression, self.hierarchical = chosen
            self._rebuild(*chosen)


def _slowest(everyone: List[Dict[str, Any]]) -> Measurements:
    """Every rank's step, settings and compute time -> one Measurements with the slowest rank's
    compute time (the same on every rank); the reductions are timed after it."""
    first = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs["settings"] != first["settings"]:
            raise ValueError(f"auto settings differ across ranks: rank 0 has {first['settings']}, rank {rank} has "
                             f"{theirs['settings']}; pass the same width, compression and auto_* arguments everywhere")
        if theirs["step"] != first["step"]:
            raise RuntimeError(f"auto check at different steps: rank 0 at {first['step']}, rank {rank} at "
                               f"{theirs['step']}; every rank must call step() as often")
    return Measurements(ranks=len(everyone), gradient_bytes=first["gradient_bytes"],
                        compute_s=max(e["compute_s"] for e in everyone), allreduce_s=0.0)


def describe_measurements(m: Measurements) -> str:
    reductions = ", ".join(f"{'none (float32 all-reduce)' if k == 'none' else k} {v * 1e3:.1f} ms "
                           f"(CPU {m.reduction_cpu_s.get(k, 0.0) * 1e3:.1f} ms)" for k, v in m.reduction_s.items())
    return (f"compute {m.compute_s * 1e3:.1f} ms/step; reductions of the {m.gradient_bytes / 1e6:.3g} MB gradient: "
            f"{reductions or 'not timed'}")
