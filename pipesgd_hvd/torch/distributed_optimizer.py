"""PyTorch's ``DistributedOptimizer``: Horovod's signature over the framework-free optimizer core.

Translation only: arguments become :class:`~pipesgd_hvd.optimizer.options.OptimizerOptions`, parameters
and ``.grad`` are reached through :class:`~pipesgd_hvd.torch.tensors.TorchAdapter`, and
every decision (what a step applies, flush, checkpoint, auto mode, elastic) is
:class:`~pipesgd_hvd.optimizer.core.OptimizerCore`'s.
"""
from __future__ import annotations

import gc
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from ..comm.torch_default import default_communicator
from ..compression import Compression
from ..optimizer import checkpoint
from ..optimizer.core import OptimizerCore
from ..optimizer.elastic_rule import is_elastic_job
from ..optimizer.options import OptimizerOptions
from ..pipeline.config import WireStats
from ..pipeline.engine import PipelineEngine
from ..pipeline.fusion import DEFAULT_FUSION_THRESHOLD
from ..staleness.formulas import DEFAULT_DC_LAMBDA
from ..staleness.split_batch import DEFAULT_FRESH_FRACTION
from . import checks
from .tensors import TorchAdapter

try:  # Horovod is the default transport, but torchrun users may not have it
    import horovod.torch as _hvd

    from ..comm.horovod_torch import HorovodTorchCommunicator, join_async
    from .elastic_state import register_elastic_handler
except ImportError:  # pragma: no cover - exercised only without Horovod
    _hvd = None
    HorovodTorchCommunicator = type(None)  # nothing is one


_LIVE: "weakref.WeakSet[DistributedOptimizer]" = weakref.WeakSet()  # for join(): this process's optimizers


def join(device: int = -1) -> int:
    """``hvd.join()`` for uneven data per rank, with the pipelined optimizer of this process
    (:meth:`DistributedOptimizer.join`); Horovod's own join when there is none. Returns the rank
    that joined last."""
    gc.collect()  # optimizers dropped but not yet collected do not count
    live = list(_LIVE)
    if len(live) > 1:
        raise ValueError(f"join() with {len(live)} pipelined optimizers alive: a joined rank can take part in one "
                         "optimizer's steps only; keep one optimizer per process for uneven data")
    if live:
        return live[0].join()
    if _hvd is None:
        raise RuntimeError("join() needs Horovod or a pipelined optimizer")
    return int(_hvd.join(device))


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
    ranks from step t-K+1: ``K=2`` (default) is Pipe-SGD, its all-reduce runs while the next step
    computes; ``K=1`` is Horovod's synchronous update, bit for bit. The first ``warmup_steps``
    steps are synchronous; then the first K-1 steps apply nothing (the pipeline fills).
    ``flush()`` applies what is in flight; ``state_dict()`` saves it, so a restart continues
    exactly.

    Horovod's arguments keep their meaning (``compression`` also takes ours:
    ``psgd.Compression.fp16``, ``.bf16``, ``.int8``, ``.int4``, ...). Ours, keyword-only:
    ``width`` (or ``"auto"``), ``warmup_steps``, ``fusion_threshold_mb``, ``communicator``,
    ``grad_scaler``, ``seed``, ``check_replicas_every``, ``staleness_correction`` (and ``dc_lambda``),
    ``auto_measure_steps``, ``auto_recheck_every``, ``hierarchical``: ``docs/options.md`` describes
    each, and ``docs/reliability.md`` every error.

    **Multi-GPU nodes.** A byte codec (``int8``, ``int4``, ``fp16``, ...) compresses only between
    hosts where each host holds several ranks and there are several hosts (``hierarchical=None``,
    the default): the gradient is reduce-scattered inside the host in float32, compressed across
    hosts among the ranks of equal local rank, and gathered back, so each host's network link
    carries ``local_size`` times fewer bytes. ``hierarchical=True``/``False`` forces it on or off;
    ``"fp16"``/``"bf16"`` sends 16 bits inside the host.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                 compression: Any = Compression.none, backward_passes_per_step: int = 1, op: Any = None,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 sparse_as_dense: bool = False, process_set: Any = None, *, width: Any = 2,
                 warmup_steps: int = 0, fusion_threshold_mb: float = DEFAULT_FUSION_THRESHOLD / 2**20,
                 communicator: Any = None, grad_scaler: Any = None, seed: int = 0,
                 check_replicas_every: Optional[int] = None, staleness_correction: Any = False,
                 dc_lambda: float = DEFAULT_DC_LAMBDA, fresh_fraction: float = DEFAULT_FRESH_FRACTION,
                 auto_measure_steps: int = 10,
                 auto_recheck_every: Optional[int] = 500, hierarchical: Any = None) -> None:
        # Every check runs before the first collective, so a bad argument (the same on every
        # rank, as the code is) raises on every rank and no rank is left waiting.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a pipesgd_hvd DistributedOptimizer")
        checks.check_grad_scaler(grad_scaler)
        options = OptimizerOptions.from_arguments(
            width=width, compression=compression, warmup_steps=warmup_steps, fusion_threshold_mb=fusion_threshold_mb,
            op=op, gradient_predivide_factor=gradient_predivide_factor, seed=seed,
            check_replicas_every=check_replicas_every, staleness_correction=staleness_correction,
            dc_lambda=dc_lambda, fresh_fraction=fresh_fraction, backward_passes_per_step=backward_passes_per_step,
            sparse_as_dense=sparse_as_dense,
            auto_measure_steps=auto_measure_steps, auto_recheck_every=auto_recheck_every,
            communicator=communicator, process_set=process_set, hvd=_hvd,
            optimizer_family=checks.optimizer_family(optimizer), optimizer_name=type(optimizer).__name__,
            hierarchical=hierarchical,
            grad_scaler=grad_scaler is not None)
        if communicator is not None and not isinstance(communicator, str):
            checks.check_communicator(communicator)
        named = checks.named_parameters(optimizer, named_parameters)
        checks.check_parameters(named)
        checks.check_groups(num_groups, groups, [p for _, p in named])
        checks.claim_parameters(self, named)
        self._optimizer = optimizer
        self._adapter = TorchAdapter(optimizer, named, sparse_as_dense, grad_scaler)
        comm, factory = (communicator, None) if communicator is not None and not isinstance(communicator, str) \
            else default_communicator(communicator, collective=not is_elastic_job())
        checks.check_transport_devices(comm, named)
        self._core = OptimizerCore(options, [n for n, _ in named], self._adapter, comm, factory)
        self.backward_passes_per_step = options.backward_passes_per_step
        self.sparse_as_dense = sparse_as_dense
        if _hvd is not None:
            register_elastic_handler(DistributedOptimizer)
        _LIVE.add(self)
        # torch.optim.Optimizer's own bookkeeping, which LR schedulers and step hooks rely on; the
        # parameters and state stay the wrapped optimizer's (see the properties below).
        self._optimizer_step_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: Dict[int, Callable] = OrderedDict()
        self._patch_step_function()

    # ----------------------------------------------------------------------- the step itself
    def synchronize(self) -> None:
        """End this step's communication and put the gradient to apply now into ``.grad``:
        the average of step t-K+1 (zeros while the pipeline fills, and step() then applies nothing)."""
        core = self._core
        if not core.synchronized:
            self._adapter.write(core.synchronize(self._adapter.loss_scale()))

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside it does not synchronize: call ``synchronize()`` yourself first
        (gradient clipping, AMP's ``unscale_``)."""
        self._core.should_synchronize = False
        try:
            yield
        finally:
            self._core.should_synchronize = True

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        core, adapter = self._core, self._adapter
        if core.is_state_initialization():
            return self._optimizer.step(closure) if closure is not None else self._optimizer.step()
        if adapter.grad_scaler is not None and core.should_synchronize and not core.synchronized:
            raise RuntimeError("with grad_scaler, call optimizer.synchronize() before scaler.step(optimizer) and "
                               "wrap it in optimizer.skip_synchronize(), so that the scaler unscales and checks the "
                               "gradient that is applied (Horovod's AMP pattern)")
        core.check_step(closure)
        if core.should_synchronize and not core.synchronized:
            adapter.write(core.synchronize(adapter.loss_scale()))
        if not core.apply_pending:
            core.no_update()
            return None
        with core.updating() as stateless:
            if stateless is not None:  # a look-ahead: the optimizer's step without a change of its state
                stateless.step_()
                return None
            return self._optimizer.step(closure) if closure is not None else self._optimizer.step()

    def flush(self, check_steps: bool = True) -> int:
        """Apply every gradient still in flight (call once training ends, on every rank); returns
        how many steps. Collective: first checks that every rank ran the same number of steps.
        With a grad_scaler, gradients are unscaled here and a non-finite one is skipped."""
        return self._core.flush(check_steps)

    @contextmanager
    def real_weights(self) -> Iterator[None]:
        """With ``staleness_correction``, the parameters hold predicted weights between steps; inside
        this block they hold the real ones, and the prediction comes back after it (bit for bit).
        Evaluate or save there; do not change the weights there. Without the correction: no-op. ::

            with opt.real_weights():
                accuracy = evaluate(model)
        """
        with self._core.real_weights():
            yield

    def join(self) -> int:
        """Uneven data per rank: call it where Horovod's code calls ``hvd.join()``, once this rank
        has no batches left (``pipesgd_hvd.torch.join()`` does it for the process's optimizer).
        Applies what is in flight, then takes part with zeros in the other ranks' remaining steps
        until every rank has joined (their averages divide by the number of ranks, as with
        Horovod's join); Horovod's own join runs meanwhile, so the others' ``hvd.allreduce``
        calls complete too. Returns the rank that joined last: broadcast the model from it."""
        outer = None
        if _hvd is not None and _hvd.is_initialized() and not isinstance(self._core.comm, HorovodTorchCommunicator):
            outer = join_async
        elif isinstance(self._core.comm, HorovodTorchCommunicator) and not self._core.engine.codec.summable:
            raise ValueError("join() with communicator='horovod' and a byte codec: Horovod's join supports only "
                             "all-reduce; use the default communicator (the pipeline's channel)")
        return self._core.join(outer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------------ checkpointing
    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state dict plus ``"pipesgd"``: in-flight gradients (waited for),
        error-feedback residuals, the step count, and the auto and prediction state
        (``pipesgd_hvd.optimizer.checkpoint``)."""
        entry = self._core.state_dict()
        state = self._optimizer.state_dict()
        state[checkpoint.KEY] = entry
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        entry, rest = checkpoint.read(state_dict)
        self._optimizer.load_state_dict(rest)
        self._core.load_state_dict(entry)

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

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self._core.check_tensors_can_change()
        self._optimizer.add_param_group(param_group)
        group = len(self.param_groups) - 1  # named as Horovod names unnamed parameters
        named = self._adapter.named + [(f"allreduce.noname.{group}.{j}", p)
                                       for j, p in enumerate(self.param_groups[group]["params"])]
        self._adapter.set_parameters(named)
        self._core.tensors_changed([n for n, _ in named])

    @property
    def _parameter_names(self) -> Dict[torch.Tensor, str]:
        """Horovod's ``{parameter: name}``, which code written for Horovod reads."""
        return {p: name for name, p in self._adapter.named}

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._optimizer

    @property
    def engine(self) -> PipelineEngine:
        return self._core.engine

    @property
    def core(self) -> OptimizerCore:
        return self._core

    @property
    def auto_controller(self) -> Any:
        return self._core.auto_controller

    @property
    def auto_decision(self) -> Any:
        """With ``width``/``compression="auto"``: the latest :class:`pipesgd_hvd.auto.rule.Decision`
        (``.describe()`` says why), the same on every rank; None while measuring or without auto."""
        controller = self._core.auto_controller
        return None if controller is None else controller.decision

    @property
    def width(self) -> int:
        return self._core.width

    @property
    def stats(self) -> WireStats:
        """Bytes sent so far, and the float32 ring all-reduce equivalent."""
        return self._core.stats

    def __repr__(self) -> str:
        config = self._core.engine.config
        return (f"pipesgd_hvd.DistributedOptimizer(width={config.width}, warmup_steps={config.warmup_steps}, "
                f"compression={self._core.engine.codec.name}, optimizer={self._optimizer!r})")
