"""PyTorch adapter: hooks, ``.grad`` and the wrapped optimizer. No pipeline logic lives here.

It translates between PyTorch and :class:`~pipesgd_hvd.engine.PipelineEngine`: a
post-accumulate-grad hook hands each parameter's gradient to the engine as soon as the backward
pass produces it, ``synchronize()`` ends the step and writes the averaged (stale) gradient into
``.grad``, ``step()`` runs the wrapped optimizer on it.
"""
from __future__ import annotations

import atexit
import copy
import dataclasses
import weakref
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from ..auto_controller import AutoController, AutoSettings
from ..comm.base import Communicator, exit_if_stuck
from ..compression import Compression, resolve_compression
from .. import elastic
from ..engine import AppliedStep, PipelineConfig, PipelineEngine, WireStats, pipeline_name
from ..fusion import DEFAULT_FUSION_THRESHOLD, TensorSpec
from ..options import (check_backward_passes, check_global_process_set, check_staleness_correction,
                       fusion_threshold_bytes, resolve_reduce_op)
from ..staleness import WeightPrediction
from . import torch_checks as checks
from .torch_ops import TORCH_OPS, dtype_name

try:  # Horovod is the default transport, but torchrun users may not have it
    import horovod.torch as _hvd

    from .torch_elastic import register_elastic_handler
except ImportError:  # pragma: no cover - exercised only without Horovod
    _hvd = None


def default_communicator(name: Optional[str] = None) -> Communicator:
    """Horovod when it is initialized, else torch.distributed; ``name`` or ``PIPESGD_COMMUNICATOR``
    ("horovod", "mpi4py", "torch.distributed") picks one explicitly."""
    import os

    name = name or os.environ.get("PIPESGD_COMMUNICATOR") or None
    if name == "mpi4py":
        from ..comm.mpi4py import Mpi4pyCommunicator

        return Mpi4pyCommunicator(TORCH_OPS)
    if name in (None, "horovod") and _hvd is not None and _hvd.is_initialized():
        from ..comm.horovod_torch import HorovodTorchCommunicator

        return HorovodTorchCommunicator()
    if name in (None, "torch.distributed"):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from ..comm.torch_distributed import TorchDistributedCommunicator

            return TorchDistributedCommunicator()
    if name not in (None, "horovod", "torch.distributed"):
        raise ValueError(f"unknown communicator {name!r}: use 'horovod', 'mpi4py' or 'torch.distributed'")
    raise RuntimeError("no communicator is ready: call hvd.init() (or torch.distributed.init_process_group()) "
                       "before creating DistributedOptimizer")


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a ``torch.optim`` optimizer so that gradients are averaged across ranks, pipelined.

    Drop-in for ``horovod.torch.DistributedOptimizer`` (same arguments, same order)::

        opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
        opt = psgd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        compression=psgd.Compression.int8)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for x, y in loader:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        opt.flush()   # applies the last in-flight gradient

    **Staleness contract.** With ``width=K`` the update of step t uses the gradient averaged over
    ranks from step t-K+1 (computed on the weights of that step): ``K=2`` (default) is Pipe-SGD, its
    all-reduce runs while the next step computes; ``K=1`` is Horovod's synchronous update, bit for
    bit. The first ``warmup_steps`` steps are synchronous; then the first K-1 steps apply nothing
    (their ``step()`` leaves the weights alone while the pipeline fills). ``flush()`` applies what
    is in flight; ``state_dict()`` saves it, so a restart continues exactly.

    Args (Horovod's, in Horovod's order):
        optimizer: the optimizer to wrap; its ``param_groups`` and ``state`` are used in place.
        named_parameters: ``model.named_parameters()``; names identify tensors across ranks.
        compression: ``psgd.Compression.none`` (default), ``.fp16``, ``.bf16``, ``.truncate16``,
            ``.int8``, ``.int4``, a codec built from its blocks, or Horovod's ``hvd.Compression.none``/
            ``.fp16`` (all-reduced in float16, as in Horovod); or ``"auto"`` (below).
        backward_passes_per_step: backward passes accumulated locally before a reduction.
        op: ``hvd.Average`` (default) or ``hvd.Sum``. Adasum is not supported.
        gradient_predivide_factor: with Average, scale by 1/f before the sum and f/size after.
        num_groups, groups: accepted for compatibility and ignored: gradients are fused into
            buckets of ``fusion_threshold_mb`` instead.
        sparse_as_dense: densify sparse gradients (otherwise a sparse gradient is an error).
        process_set: only Horovod's global process set is supported.
    Keyword-only (ours):
        width: pipeline width K >= 1 (default 2), or ``"auto"``.
        warmup_steps: synchronous steps before pipelining (default 0).
        fusion_threshold_mb: bucket size in MiB (default 64, Horovod's).
        communicator: a Communicator, or "horovod" / "mpi4py" / "torch.distributed"
            (default: Horovod if initialized, else torch.distributed).
        grad_scaler: the ``torch.amp.GradScaler`` in use, if any; a stale gradient is then
            rescaled by the ratio of loss scales (now / when it was computed). Use Horovod's AMP
            pattern: ``scaler.scale(loss).backward(); opt.synchronize(); scaler.unscale_(opt)``
            (optional), ``with opt.skip_synchronize(): scaler.step(opt)``; ``scaler.update()``.
        seed: seeds stochastic rounding (the same on every rank).
        check_replicas_every: every that many steps, compare a checksum of every parameter across
            ranks and raise ``ReplicaDriftError`` on every rank, naming the step and the first
            parameter that differs (default None: never). Costs one pass over the weights on the
            host and a small allgather per check.
        staleness_correction: False (default) or True: weight prediction (``pipesgd_hvd.staleness``,
            after SpecTrain/SAPipe). The gradient of step t is computed at w_t + (w_t - w_{t-1}),
            a guess of the weights it will be applied to, instead of at w_t. Between steps the
            parameters hold that prediction: evaluate or save the model inside
            ``with opt.real_weights():`` or after ``flush()``, which puts the real weights back.
            ``state_dict()`` saves the real weights and the previous ones, so a restart is exact.
            Costs two extra copies of the weights and three element-wise passes over them per
            step (``docs/accuracy.md`` has the measured time and when it helps); with width 2 it
            pays off when the learning rate is large enough that staleness costs accuracy.
        auto_measure_steps, auto_recheck_every: with ``width="auto"`` and/or ``compression="auto"``
            (default 10 and 500; ``auto_recheck_every=0`` or None: never re-check), see below.

    **Automatic width and codec** (``pipesgd_hvd.auto_controller``). The first
    ``auto_measure_steps`` steps run synchronously (width 1, uncompressed unless the codec is
    fixed) while every rank measures its compute time per step (time outside the optimizer's
    waits: forward, backward, the update, data loading; median). Then every rank times the
    reductions themselves on the step's gradient, synchronously: the float32 all-reduce, then
    each candidate codec's compressed all-reduce, least lossy first, with the CPU each costs; the
    slowest rank's numbers are gathered after each, so every rank applies the rule of
    :func:`pipesgd_hvd.auto.decide` to the same numbers and switches at the same step: width 1 if
    communication is under 5% of compute, else width 2 with the least lossy of none < fp16 <
    int8 < int4 whose predicted step, ``max(compute + the reduction's CPU, the reduction)``, is
    within 10% of the fastest (the timing stops once no lossier codec can be faster by more).
    The switch flushes (the in-flight gradient is applied, nothing is lost) and rebuilds the
    pipeline. Every ``auto_recheck_every`` steps it measures again (compute from the pipelined
    steps, a flush, the reductions timed again: about one unhidden step and four reductions per
    codec timed) and switches when the choice changes. ``opt.auto_decision`` holds the latest
    decision on every rank (``.describe()`` gives the reason and predicted step times); rank 0
    logs it with the numbers on the ``pipesgd_hvd.auto`` logger (``logging.INFO``). If
    only one of the two is ``"auto"``, the other stays as given. ``state_dict()`` saves the
    running choice; load it on every rank (rebuilding the pipeline is collective). ::

        opt = psgd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        width="auto", compression="auto")

    Errors: a bad argument, parameters that differ across ranks, a gradient that cannot be
    averaged, or ranks that ran different numbers of steps raise on every rank with the tensor and
    the fix; a collective that does not complete within ``PIPESGD_TIMEOUT`` seconds (default 600)
    raises ``PeerLostError``. ``docs/reliability.md`` has the full table.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1, op: Any = None,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 sparse_as_dense: bool = False, process_set: Any = None, *, width: int = 2,
                 warmup_steps: int = 0, fusion_threshold_mb: float = DEFAULT_FUSION_THRESHOLD / 2**20,
                 communicator: Any = None, grad_scaler: Any = None, seed: int = 0,
                 check_replicas_every: Optional[int] = None, staleness_correction: bool = False,
                 auto_measure_steps: int = 10, auto_recheck_every: Optional[int] = 500) -> None:
        # Every check runs before the first collective, so a bad argument (the same on every
        # rank, as the code is) raises on every rank and no rank is left waiting.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a pipesgd_hvd DistributedOptimizer")
        check_backward_passes(backward_passes_per_step)
        check_global_process_set(process_set, _hvd)
        if process_set is not None and _hvd is None:
            raise ValueError("process_set needs Horovod, which is not installed; omit process_set")
        threshold_bytes = fusion_threshold_bytes(fusion_threshold_mb)
        checks.check_flag("sparse_as_dense", sparse_as_dense)
        checks.check_grad_scaler(grad_scaler)
        correct_staleness = check_staleness_correction(staleness_correction)
        if communicator is not None and not isinstance(communicator, str):
            checks.check_communicator(communicator)
        self._optimizer = optimizer
        self._named = checks.named_parameters(optimizer, named_parameters)
        checks.check_parameters(self._named)
        checks.check_groups(num_groups, groups, [p for _, p in self._named])
        self._params = [p for _, p in self._named]
        self._index = {p: i for i, p in enumerate(self._params)}
        self._prediction = WeightPrediction(TORCH_OPS, self._params) if correct_staleness else None
        self._weights_predicted = False  # the parameters hold the prediction, not the real weights
        self.backward_passes_per_step = backward_passes_per_step
        self.sparse_as_dense = sparse_as_dense
        self._grad_scaler = grad_scaler
        auto = AutoSettings.from_arguments(width, compression, auto_measure_steps, auto_recheck_every)
        if auto is not None:  # measure synchronously first; see pipesgd_hvd.auto_controller
            width, compression = auto.initial()
        self.width = width
        config = dict(width=width, warmup_steps=warmup_steps, fusion_threshold_bytes=threshold_bytes,
                      op=resolve_reduce_op(op, _hvd), gradient_predivide_factor=gradient_predivide_factor,
                      seed=seed, check_replicas_every=check_replicas_every or 0)
        PipelineConfig(**config)  # bad settings fail here, before any collective
        resolve_compression(compression)  # so does an unknown codec
        self._codec_template = compression
        self._comm = communicator if communicator is not None and not isinstance(communicator, str) \
            else default_communicator(communicator)
        self._config = PipelineConfig(**config, name=pipeline_name([n for n, _ in self._named]))
        # Under Horovod elastic a joining worker builds its optimizer while the others sync, so the
        # cross-rank check waits for hvd.elastic.TorchState's sync(), which rebuilds the engine.
        self._engine = self._build_engine(check_ranks=not elastic.is_elastic_job())
        if _hvd is not None:
            register_elastic_handler(DistributedOptimizer)
        self.auto_controller = None if auto is None else \
            AutoController(auto, self._comm, TORCH_OPS, rebuild=self._switch_engine)

        self._passes = [0] * len(self._params)
        self._hooks: Dict[int, Any] = {}
        self._register_hooks()
        self._synchronized = False
        self._should_synchronize = True
        self._apply_pending = False
        self._stepped = False  # a pipelined step has happened (see _is_state_initialization)

        # torch.optim.Optimizer's own bookkeeping, which LR schedulers and step hooks rely on; the
        # parameters and state stay the wrapped optimizer's (see the properties below).
        self._optimizer_step_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: Dict[int, Callable] = OrderedDict()
        self._patch_step_function()
        # Nothing computed is lost: gradients still in flight when the interpreter exits are applied.
        atexit.register(_flush_at_exit, weakref.ref(self))

    def _build_engine(self, first_step: int = 0, check_ranks: bool = True) -> PipelineEngine:
        specs = [TensorSpec(name, tuple(p.shape), dtype_name(p.dtype), str(p.device)) for name, p in self._named]
        anchors = {str(p.device): p for p in self._params}
        return PipelineEngine(specs, ops=TORCH_OPS, comm=self._comm, codec=resolve_compression(self._codec_template),
                              config=self._config, device_anchors=anchors, first_step=first_step,
                              check_ranks=check_ranks)

    def _switch_engine(self, width: int, compression: Any) -> None:
        """The auto mode's rebuild hook: the engine was flushed; the next one continues its step
        count and byte counts (a fresh name per configuration keeps Horovod's tensor names apart)."""
        old = self._engine
        old.close()
        base = self._config.name.split(".auto")[0]
        self._config = dataclasses.replace(self._config, width=width, name=f"{base}.auto{old.step}")
        self._codec_template, self.width = compression, width
        self._engine = self._build_engine(first_step=old.step)
        self._engine.stats = old.stats

    @property
    def auto_decision(self) -> Any:
        """With ``width``/``compression="auto"``: the latest :class:`pipesgd_hvd.auto.Decision`
        (``.describe()`` says why), the same on every rank; None while measuring or without auto."""
        return None if self.auto_controller is None else self.auto_controller.decision

    # ------------------------------------------------------------- forwarding to the wrapped one
    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: Dict[str, Any]) -> None:
        self._optimizer.defaults = value

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._optimizer

    @property
    def engine(self) -> PipelineEngine:
        return self._engine

    @property
    def stats(self) -> WireStats:
        """Bytes sent so far, and the float32 ring all-reduce equivalent."""
        return self._engine.stats

    def __repr__(self) -> str:
        return (f"pipesgd_hvd.DistributedOptimizer(width={self._config.width}, warmup_steps={self._config.warmup_steps}, "
                f"compression={self._engine.codec.name}, optimizer={self._optimizer!r})")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if self._engine.step > 0 or self._engine.step_open:
            raise RuntimeError("add_param_group() after training started is not supported by pipesgd_hvd: add all "
                               "parameter groups before the first step, and freeze or unfreeze parameters with "
                               "requires_grad instead")
        self._optimizer.add_param_group(param_group)
        group = len(self.param_groups) - 1  # named as Horovod names unnamed parameters
        self._named = self._named + [(f"allreduce.noname.{group}.{j}", p)
                                     for j, p in enumerate(self.param_groups[group]["params"])]
        self._params = [p for _, p in self._named]
        self._index = {p: i for i, p in enumerate(self._params)}
        self._passes = [0] * len(self._params)
        if self._prediction is not None:
            self._prediction = WeightPrediction(TORCH_OPS, self._params)
        self._engine.close()
        self._engine = self._build_engine()
        self._register_hooks()

    # ------------------------------------------------------------------------------ the hooks
    def _register_hooks(self) -> None:
        for i, p in enumerate(self._params):
            if p.requires_grad and i not in self._hooks:
                self._hooks[i] = p.register_post_accumulate_grad_hook(self._make_hook(i))

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        self_ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            opt = self_ref()
            if opt is not None:
                opt._gradient_ready(index, param)

        return hook

    def _active(self) -> List[int]:
        return [i for i, p in enumerate(self._params) if p.requires_grad]

    def _checked_grad(self, index: int, p: torch.Tensor) -> torch.Tensor:
        return checks.checked_grad(self._named[index][0], p, self.sparse_as_dense)

    def _gradient_ready(self, index: int, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if not self._engine.step_open:
            if self._synchronized:
                # The last synchronized step was never applied: GradScaler.step() skips
                # optimizer.step() when the (identical on every rank) gradient is not finite.
                self._synchronized, self._apply_pending = False, False
            self._engine.begin_step(self._active())
        passes = self._passes[index] + 1
        if passes > self.backward_passes_per_step:
            raise RuntimeError(f"gradients of '{self._named[index][0]}' were computed more than "
                               f"backward_passes_per_step={self.backward_passes_per_step} times before step(); "
                               "increase backward_passes_per_step to accumulate gradients locally")
        self._passes[index] = passes
        if passes == self.backward_passes_per_step:
            self._engine.add_gradient_(index, self._checked_grad(index, p))

    # ----------------------------------------------------------------------- the step itself
    def synchronize(self) -> None:
        """End this step's communication and put the gradient to apply now into ``.grad``:
        the average of step t-K+1 (zeros while the pipeline fills, and step() then applies nothing)."""
        if self._synchronized:
            return
        if self.auto_controller is not None:
            self.auto_controller.reduction_started()
        engine = self._engine
        if engine.replica_check_due():  # weights after the previous step's update, on every rank
            engine.check_replicas([(name, TORCH_OPS.to_numpy(p.detach().cpu())) for name, p in self._named])
        if not engine.step_open:
            manual = [i for i in self._active() if self._params[i].grad is not None]
            if not manual:
                raise RuntimeError("step()/synchronize() was called without a backward pass since the last step: "
                                   "call loss.backward() before every step() on every rank (to skip a batch, skip "
                                   "both on all ranks)")
            engine.begin_step(self._active())
        # Gradients whose hook did not fire (set by hand, or a parameter unfrozen since the hooks
        # were registered) are taken as they are, as Horovod's synchronize() does.
        for i in self._active():
            p = self._params[i]
            if p.grad is not None and not engine.has_gradient(i):
                engine.add_gradient_(i, self._checked_grad(i, p))
        self._passes = [0] * len(self._params)
        self._register_hooks()
        applied = engine.end_step(meta=self._loss_scale())
        if self.auto_controller is not None:  # at a check: flushed steps to apply; maybe a new engine
            applied = applied + self.auto_controller.after_step(engine, applied)
        self._restore_real_weights()  # the gradients were computed at the prediction: update the real weights
        for early in applied[:-1]:  # only when the width shrinks: apply older steps right away
            self._write_grads(early)
            self._optimizer.step()
        self._apply_pending = bool(applied)
        if applied:
            self._write_grads(applied[-1])
        else:
            # Nothing to apply while the pipeline fills: zero gradients (not None, so that code run
            # between synchronize() and step(), e.g. GradScaler.unscale_, sees finite gradients);
            # step() will not run the wrapped optimizer on them.
            for p in self._params:
                if p.grad is not None:
                    p.grad.zero_()
        self._synchronized = True
        self._stepped = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside it does not synchronize: call ``synchronize()`` yourself first
        (gradient clipping, AMP's ``unscale_``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        if self._is_state_initialization():
            return self._optimizer.step(closure)
        if closure is not None and self._config.width > 1:
            raise ValueError("step(closure) re-evaluates the loss, which a pipelined optimizer cannot do; "
                             "compute the loss before step(), or use width=1")
        if self._should_synchronize:
            if self._grad_scaler is not None and not self._synchronized:
                raise RuntimeError("with grad_scaler, call optimizer.synchronize() before scaler.step(optimizer) and "
                                   "wrap it in optimizer.skip_synchronize(), so that the scaler unscales and checks the "
                                   "gradient that is applied (Horovod's AMP pattern)")
            self.synchronize()
        elif not self._synchronized:
            raise RuntimeError("step() inside skip_synchronize() needs optimizer.synchronize() first")
        self._synchronized = False
        self._restore_real_weights()  # done by synchronize() already; a no-op then
        if not self._apply_pending:
            self._predict_weights()  # a fill step updates nothing, but the prediction starts here
            return None
        self._apply_pending = False
        loss = self._optimizer.step(closure)
        self._predict_weights()
        return loss

    # ------------------------------------------------------- staleness correction (prediction)
    def _restore_real_weights(self) -> None:
        if self._weights_predicted:
            with torch.no_grad():
                self._prediction.restore(self._params)
            self._weights_predicted = False

    def _predict_weights(self) -> None:
        if self._prediction is not None:
            with torch.no_grad():
                self._prediction.predict(self._params)
            self._weights_predicted = True

    @contextmanager
    def real_weights(self) -> Iterator[None]:
        """With ``staleness_correction``, the parameters hold predicted weights between steps; inside
        this block they hold the real ones, and the prediction comes back after it (bit for bit).
        Evaluate or save there; do not change the weights there. Without the correction: no-op. ::

            with opt.real_weights():
                accuracy = evaluate(model)
                torch.save(model.state_dict(), "model.pt")
        """
        if not self._weights_predicted:
            yield
            return
        self._restore_real_weights()
        try:
            yield
        finally:
            with torch.no_grad():
                self._prediction.reapply(self._params)  # a no-op if flush() ran inside the block
            self._weights_predicted = bool(self._prediction.started > 0.5)

    def flush(self, check_steps: bool = True) -> int:
        """Apply every gradient still in flight (call once training ends, on every rank); returns
        how many steps. Collective: first checks that every rank ran the same number of steps.
        With a grad_scaler, gradients are unscaled here and a non-finite one is skipped."""
        in_flight = self._engine.flush(check_steps=check_steps)  # checks the ranks agree before it waits
        if self._prediction is not None:  # the real weights first; prediction starts afresh next step
            with torch.no_grad():
                if self._weights_predicted:
                    self._prediction.reset(self._params)
                else:  # restored by synchronize(), perhaps updated since: leave the weights alone
                    self._prediction.started.zero_()
            self._weights_predicted = False
        applied_count = 0
        if self._apply_pending:
            self._optimizer.step()
            self._apply_pending, self._synchronized = False, False
            applied_count += 1
        for applied in in_flight:
            self._write_grads(applied, unscale=self._grad_scaler is not None)
            if self._grad_scaler is None or all(torch.isfinite(p.grad).all() for p in self._params if p.grad is not None):
                self._optimizer.step()
                applied_count += 1
        self._passes = [0] * len(self._params)
        return applied_count

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def _is_state_initialization(self) -> bool:
        """True for a step() before any training with all-zero gradients and no backward pass: how
        ``hvd.broadcast_optimizer_state`` makes a fresh optimizer create its state. Zero gradients
        from identical weights give identical results on every rank, so it runs locally."""
        if self._stepped or self._engine.step_open or self._engine.step > 0:
            return False
        grads = [p.grad for p in self._params if p.grad is not None]
        return bool(grads) and all(not g.is_sparse and not bool(g.any()) for g in grads)

    def _loss_scale(self) -> Optional[float]:
        return float(self._grad_scaler.get_scale()) if self._grad_scaler is not None else None

    def _write_grads(self, applied: AppliedStep, unscale: bool = False) -> None:
        ratio = 1.0
        if applied.meta is not None:  # loss scale when the gradient was computed
            ratio = (1.0 if unscale else self._loss_scale()) / applied.meta
        for i, p in enumerate(self._params):
            g = applied.grads.get(i)
            if g is None:
                p.grad = None
                continue
            if ratio != 1.0:
                g = g * ratio
            if p.grad is not None and p.grad.shape == g.shape and p.grad.dtype == g.dtype and not p.grad.is_sparse:
                p.grad.copy_(g)
            else:
                p.grad = g.detach().clone()

    # ------------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict plus ``"pipesgd"``: in-flight gradients (waited for),
        codec state (error-feedback residuals) and the step count; with ``staleness_correction``,
        ``"pipesgd_prediction"``: the real weights and the previous ones."""
        if self._apply_pending:
            raise RuntimeError("state_dict() between synchronize() and step(): call step() first")
        state = self._optimizer.state_dict()
        state["pipesgd"] = self._engine.state_dict()
        if self.auto_controller is not None:
            state["pipesgd_auto"] = self.auto_controller.state_dict()
        if self._prediction is not None:
            state["pipesgd_prediction"] = self._prediction.state_dict([n for n, _ in self._named])
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        state_dict = dict(state_dict)
        ours = state_dict.pop("pipesgd", None)
        auto = state_dict.pop("pipesgd_auto", None)
        prediction = state_dict.pop("pipesgd_prediction", None)
        self._optimizer.load_state_dict(state_dict)
        if ours is not None:
            if auto is not None and self.auto_controller is not None:
                self.auto_controller.load_state_dict(auto)  # the width and codec it ran with
            self._engine.load_state_dict(ours)
            self._stepped = self._engine.step > 0
        self._load_prediction(prediction)

    # -------------------------------------------------------------------- Horovod elastic
    # Called by hvd.elastic.TorchState through the handler of frameworks/torch_elastic.py; the
    # rule they keep is pipesgd_hvd/elastic.py's.
    def _check_elastic_support(self) -> None:
        if self.auto_controller is not None or self._prediction is not None:
            raise ValueError("hvd.elastic.TorchState does not support width='auto', compression='auto' or "
                             "staleness_correction=True yet: pass a fixed width and compression, without "
                             "staleness_correction")

    def _elastic_restore(self, committed: Dict[str, Any]) -> None:
        """After HorovodInternalError (a worker was lost): drop what is in flight, unwaited, and
        go back to the last commit. Horovod is broken here: no collective."""
        self._engine.abandon()
        self._engine = self._build_engine(check_ranks=False)
        self._synchronized = self._apply_pending = False
        self._passes = [0] * len(self._params)
        # A copy: torch's load_state_dict keeps the given tensors (Tensor.to returns them as they
        # are), and training would then change the commit in place before the next restore.
        self.load_state_dict(copy.deepcopy(committed))

    def _elastic_sync(self) -> None:
        """On every rank of a new world (after a reset, and at the start): drop the old world's
        unwaited reductions, rebuild the pipeline for this world (cross-rank check included) and
        continue from rank 0's state: the wrapped optimizer's state, the reduced in-flight
        gradients and the step count; error-feedback residuals start afresh (pipesgd_hvd.elastic)."""
        held = self._engine.abandon()
        self._synchronized = self._apply_pending = False
        self._passes = [0] * len(self._params)
        self._engine = self._build_engine()  # collective: every rank of the new world is here
        root = None
        if self._comm.rank == 0:
            root = self._optimizer.state_dict()
            root["pipesgd"] = elastic.state_for_new_world(held, self._engine.codec.state_dict())
        root = self._comm.allgather_object(root, f"{self._config.name}.elastic")[0]
        self.load_state_dict(root)

    def _load_prediction(self, saved: Optional[Dict[str, Any]]) -> None:
        """Load the model first: the parameters then get the prediction the next gradient is
        computed at (with the correction), or the real weights (a correction checkpoint resumed
        without it). A checkpoint without prediction state starts predicting afresh."""
        with torch.no_grad():
            if self._prediction is not None and saved is not None:
                self._prediction.load_state_dict(saved, [n for n, _ in self._named], self._params)
            elif self._prediction is not None:
                self._prediction.started.zero_()
            elif saved is not None and saved["started"]:
                for name, p in self._named:
                    p.copy_(saved["current"][name])
        self._weights_predicted = self._prediction is not None and bool(self._prediction.started > 0.5)



def _flush_at_exit(ref: "weakref.ref[DistributedOptimizer]") -> None:
    opt = ref()
    if opt is None:
        return
    engine = opt._engine
    if engine.failure is None and (engine.in_flight or opt._apply_pending):
        try:  # no step-count check: other ranks may be gone already
            count = opt.flush(check_steps=False)
            warnings.warn(f"pipesgd_hvd: applied {count} in-flight step(s) at exit; call optimizer.flush() "
                          "when training ends, before saving the model")
        except Exception as exc:  # the transport may already be gone at exit
            warnings.warn(f"pipesgd_hvd: could not apply in-flight gradients at exit: {exc}")
    if engine.failure is not None:
        # Nothing can be applied consistently; make sure the transport's own shutdown (run after
        # this handler: Horovod registered its handler earlier) cannot keep the process alive.
        exit_if_stuck(f"the pipeline stopped at {type(engine.failure).__name__}")
    engine.close()
