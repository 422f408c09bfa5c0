"""PyTorch's side of :class:`~pipesgd_hvd.optimizer.framework.TrainingAdapter`: parameters, ``.grad``,
hooks and the wrapped optimizer. Translation only; the policy is the core's."""
from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.optim.adam import adam as functional_adam
from torch.optim.sgd import sgd as functional_sgd

from ..ops.torch import TORCH_OPS, dtype_name
from ..pipeline.fusion import TensorSpec
from ..staleness.prediction import AdamState
from . import checks
from .fingerprint import host_fingerprints


class TorchAdapter:
    """One wrapped ``torch.optim`` optimizer and its named parameters."""

    ops = TORCH_OPS

    def __init__(self, optimizer: torch.optim.Optimizer, named: Sequence[Tuple[str, torch.Tensor]],
                 sparse_as_dense: bool, grad_scaler: Any) -> None:
        self.optimizer = optimizer
        self.sparse_as_dense, self.grad_scaler = sparse_as_dense, grad_scaler
        self.set_parameters(named)

    def set_parameters(self, named: Sequence[Tuple[str, torch.Tensor]]) -> None:
        self.named = list(named)
        self.params = [p for _, p in self.named]
        self._hooks: Dict[int, Any] = getattr(self, "_hooks", {})
        self._sparse: Set[int] = set()  # tensors whose local gradient is sparse

    # -------------------------------------------------------------------------------- tensors
    def tensor_specs(self) -> List[TensorSpec]:
        return [TensorSpec(name, tuple(p.shape), dtype_name(p.dtype), str(p.device)) for name, p in self.named]

    def device_anchors(self) -> Dict[str, torch.Tensor]:
        return {str(p.device): p for p in self.params}

    def trainable(self) -> List[int]:
        return [i for i, p in enumerate(self.params) if p.requires_grad]

    def weights(self) -> List[torch.Tensor]:
        return self.params

    #: The context the staleness corrections write the parameters in (a value handed down, not a
    #: method: the optimizer core calls it on every step without calling back into this file).
    weights_guard: Callable[[], ContextManager[Any]] = torch.no_grad

    def replica_fingerprints(self) -> List[Tuple[str, Any]]:
        return host_fingerprints(self.named)  # computed on the device; one small copy

    # ------------------------------------------------------------------------------ gradients
    def watch_gradients(self, ready: Callable[[int], None]) -> None:
        """A post-accumulate-grad hook per trainable parameter calls ``ready(index)``. The hook
        holds the callback weakly: a dropped optimizer's hooks do nothing."""
        callback = weakref.WeakMethod(ready)  # type: ignore[arg-type]
        for i, p in enumerate(self.params):
            if p.requires_grad and i not in self._hooks:
                self._hooks[i] = p.register_post_accumulate_grad_hook(_hook(callback, i))

    def unwatch_gradients(self) -> None:
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()

    def has_local_gradient(self, index: int) -> bool:
        return self.params[index].grad is not None

    def local_gradient(self, index: int) -> torch.Tensor:
        name, p = self.named[index]
        if p.grad is not None and p.grad.is_sparse:
            self._sparse.add(index)  # reduced dense (sparse_as_dense), handed back sparse, as Horovod does
        return checks.checked_grad(name, p, self.sparse_as_dense)

    def write(self, update: Any) -> None:
        """Puts an :class:`~pipesgd_hvd.optimizer.core.Update` into ``.grad`` (None: zeros, so
        that code run between synchronize() and step(), e.g. GradScaler.unscale_, sees finite
        gradients while the pipeline fills and step() applies nothing)."""
        if update is None:
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()
            return
        grads, scale, owned = update.grads, update.scale, update.owned
        for i, p in enumerate(self.params):
            g = grads.get(i)
            if g is None:
                p.grad = None
                continue
            mine = owned
            if not (isinstance(scale, float) and scale == 1.0):  # a device tensor is never compared (a sync)
                g, mine = g * scale, True
            if i in self._sparse:  # optimizers such as SparseAdam take sparse gradients only
                p.grad = g.to_sparse()
                continue
            if p.grad is not None and p.grad.shape == g.shape and p.grad.dtype == g.dtype and not p.grad.is_sparse:
                # .grad keeps its identity, as with Horovod's in-place all-reduce; a tensor that is
                # ours becomes its memory (set_, as Horovod's optimizer does after decompressing),
                # which saves a copy of the gradient per step
                if mine and p.grad.device == g.device:
                    p.grad.set_(g)
                else:
                    p.grad.copy_(g)
            else:
                p.grad = g.detach() if mine and g.dtype == p.dtype and g.device == p.device else g.detach().clone()

    def apply(self, update: Any, check_finite: bool, stateless: Any = None) -> bool:
        if update is not None:
            self.write(update)
        if check_finite and not self.gradients_finite():
            return False
        if stateless is not None:
            stateless.step_()
        else:
            self.optimizer.step()
        return True

    def gradients_finite(self) -> bool:
        # One host read for all of them, not one per parameter.
        return _all_true([torch.isfinite(p.grad).all() for p in self.params if p.grad is not None])

    def gradients_all_zero(self) -> bool:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads or any(g.is_sparse for g in grads):
            return False
        return _all_true([~g.any() for g in grads])

    def optimizer_has_state(self) -> bool:
        return len(self.optimizer.state) > 0

    def loss_scale(self) -> Any:
        """The scaler's scale now: a copy of torch's GradScaler's own scale tensor where it has
        one (``get_scale()`` reads it to the host, a sync, twice per step), else a float."""
        if self.grad_scaler is None:
            return None
        on_device = getattr(self.grad_scaler, "_get_scale_async", None)  # torch.amp.GradScaler's
        scale = on_device() if callable(on_device) else None
        if isinstance(scale, torch.Tensor):
            return scale.detach().reshape(()).clone()  # the scaler updates its tensor in place
        return float(self.grad_scaler.get_scale())

    # --------------------------------------------------------------------- the wrapped optimizer
    def check_adam_support(self) -> None:
        """``staleness_correction="adam_prediction"`` reads Adam's moments: Adam/AdamW only."""
        if not isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError("staleness_correction='adam_prediction' predicts with Adam's own next step, but the "
                             f"wrapped optimizer is {type(self.optimizer).__name__}: wrap torch.optim.Adam or AdamW, or use "
                             "staleness_correction='weight_prediction'")
        if any(group.get("maximize") for group in self.optimizer.param_groups):
            raise ValueError("staleness_correction='adam_prediction' does not support Adam(maximize=True): use "
                             "staleness_correction='weight_prediction'")

    def adam_state(self, index: int) -> Optional[AdamState]:
        p = self.params[index]
        state = self.optimizer.state.get(p)
        if not state or "exp_avg" not in state:
            return None  # no update yet
        group = next(g for g in self.optimizer.param_groups if any(q is p for q in g["params"]))
        decoupled = isinstance(self.optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
        beta1, beta2 = group["betas"]
        return AdamState(m=state["exp_avg"], v=state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"],
                         step=int(state["step"]), lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                         eps=float(group["eps"]),
                         decoupled_weight_decay=float(group["weight_decay"]) if decoupled else 0.0)

    def optimizer_snapshot(self) -> "OptimizerStateSnapshot":
        return OptimizerStateSnapshot(self.optimizer)

    def look_ahead_step(self) -> Optional["StatelessStep"]:
        """The wrapped optimizer's step that leaves its state alone, where torch's functional form
        computes it (plain SGD, Adam, AdamW); None otherwise (a look-ahead then saves and puts
        back the optimizer's state around its ordinary step)."""
        return StatelessStep.for_optimizer(self.optimizer)

    def optimizer_state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class StatelessStep:
    """A look-ahead's step without a copy of the optimizer's state: for each parameter with a
    gradient, torch's own functional update (``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``,
    what ``step()`` calls with the group's settings) on copies of that parameter's state only,
    so the weights move exactly as ``step()`` would move them and the state stays as it was. At
    most one parameter's state is copied at a time, where saving the whole state costs Adam two
    copies of the weights. Only the classes themselves (a subclass may step otherwise), without
    complex, differentiable, capturable or fused settings. On the CPU the copies go into buffers
    reused from parameter to parameter and update to update (one per state entry and dtype, as
    large as the largest parameter): a fresh clone of each one's state every update cost its
    allocation and page faults on the training thread (a few ms per update on 8 MB of weights). On
    a GPU a clone is cheap (the caching allocator reuses its blocks) and holds nothing after."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._state_copies: Dict[Any, torch.Tensor] = {}

    def _copy(self, entry: str, kept: torch.Tensor) -> torch.Tensor:
        """``kept`` copied into the reused buffer of its state ``entry`` (a view of its shape)."""
        if kept.device.type != "cpu":
            return kept.clone()
        key, n = (entry, kept.dtype), kept.numel()
        buffer = self._state_copies.get(key)
        if buffer is None or buffer.numel() < n:
            buffer = self._state_copies[key] = torch.empty(n, dtype=kept.dtype)
        return buffer[:n].view(kept.shape).copy_(kept)

    @classmethod
    def for_optimizer(cls, optimizer: torch.optim.Optimizer) -> Optional["StatelessStep"]:
        if type(optimizer) not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
            return None
        for group in optimizer.param_groups:
            if group.get("differentiable") or group.get("capturable") or group.get("fused"):
                return None
            if any(torch.is_complex(p) for p in group["params"]):
                return None
        return cls(optimizer)

    @torch.no_grad()
    def step_(self) -> None:
        opt = self.optimizer
        adam = not isinstance(opt, torch.optim.SGD)
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = opt.state.get(p, {})
                if adam:
                    self._adam(group, p, state)
                else:
                    self._sgd(group, p, state)

    def _adam(self, group: Dict[str, Any], p: torch.Tensor, state: Dict[str, Any]) -> None:
        def copy_or_zeros(key: str) -> torch.Tensor:
            kept = state.get(key)
            return self._copy(key, kept) if kept is not None else torch.zeros_like(p, memory_format=torch.preserve_format)

        step = state["step"].clone() if "step" in state else torch.tensor(0.0, dtype=torch.get_default_dtype())
        beta1, beta2 = group["betas"]
        functional_adam([p], [p.grad], [copy_or_zeros("exp_avg")], [copy_or_zeros("exp_avg_sq")],
                              [copy_or_zeros("max_exp_avg_sq")] if group["amsgrad"] else [], [step],
                              amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                              weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                              foreach=group["foreach"], capturable=False, differentiable=False, fused=None,
                              grad_scale=getattr(self.optimizer, "grad_scale", None),
                              found_inf=getattr(self.optimizer, "found_inf", None),
                              decoupled_weight_decay=group.get("decoupled_weight_decay", False))

    def _sgd(self, group: Dict[str, Any], p: torch.Tensor, state: Dict[str, Any]) -> None:
        kept = state.get("momentum_buffer")
        functional_sgd([p], [p.grad], [None if kept is None else self._copy("momentum_buffer", kept)],
                            weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                            dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
                            has_sparse_grad=p.grad.is_sparse, foreach=group["foreach"], fused=None,
                            grad_scale=getattr(self.optimizer, "grad_scale", None),
                            found_inf=getattr(self.optimizer, "found_inf", None))


class OptimizerStateSnapshot:
    """The wrapped optimizer's per-parameter state (``optimizer.state``), saved before the
    split-batch rule's virtual update and put back after it, in place (the optimizer's tensors
    keep their identity). The save buffers are kept from update to update, so a step allocates
    nothing once the state's shapes are settled. State the virtual update created (the first
    update of an optimizer that creates its state lazily, as Adam does) is removed again."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._saved: Dict[Any, Dict[str, Any]] = {}

    def save(self, when: bool) -> None:
        if not when:
            return
        saved: Dict[Any, Dict[str, Any]] = {}
        for p, state in self.optimizer.state.items():
            kept = self._saved.get(p, {})
            saved[p] = {k: _copied(v, kept.get(k)) for k, v in state.items()}
        self._saved = saved

    def restore(self, when: bool) -> None:
        if not when:
            return
        state = self.optimizer.state
        for p in [p for p in state if p not in self._saved]:
            del state[p]
        for p, entry in self._saved.items():
            current = state[p]
            for k in [k for k in current if k not in entry]:
                del current[k]
            for k, v in entry.items():
                current[k] = _copied(v, current.get(k))


def _copied(value: Any, into: Any) -> Any:
    """``value`` copied into ``into`` when that is a tensor of the same kind (returned), else a new copy."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if isinstance(into, torch.Tensor) and into is not value and into.shape == value.shape \
            and into.dtype == value.dtype and into.device == value.device:
        return into.copy_(value)
    return value.detach().clone()


def _all_true(flags: List[torch.Tensor]) -> bool:
    """Whether every 0-d bool tensor is true, read to the host once (per device)."""
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for flag in flags:
        by_device.setdefault(flag.device, []).append(flag)
    return all(bool(torch.stack(group).all()) for group in by_device.values())


def _hook(callback: "weakref.WeakMethod[Callable[[int], None]]", index: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        ready = callback()
        if ready is not None:
            ready(index)

    return hook
