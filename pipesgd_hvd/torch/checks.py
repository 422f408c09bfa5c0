"""Checks of the PyTorch optimizer's arguments and of each gradient before it is reduced.

Every error names the argument or tensor and says the fix; ``docs/reliability.md`` lists them
with the test that checks each. Checks shared with other frameworks live in
``pipesgd_hvd/optimizer/options.py`` and :class:`~pipesgd_hvd.pipeline.config.PipelineConfig`.
"""
from __future__ import annotations

import gc
import numbers
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..staleness.choice import family_by_class

_COMMUNICATOR_METHODS = ("allreduce_async_", "alltoall_async", "allgather_async", "allgather_object")


def named_parameters(optimizer: torch.optim.Optimizer,
                     named: Optional[Sequence[Tuple[str, torch.Tensor]]]) -> List[Tuple[str, torch.Tensor]]:
    """(name, parameter) for every parameter of the optimizer, in param-group order (Horovod's checks)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named is None:
        return [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])]
    if isinstance(named, (str, bytes, torch.Tensor)) or not hasattr(named, "__iter__"):
        raise ValueError(f"named_parameters should be a sequence of (name, parameter) tuples, usually "
                         f"model.named_parameters(); got {type(named).__name__}")
    named = list(named)
    for pos, item in enumerate(named):
        if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str) \
                or not isinstance(item[1], torch.Tensor):
            raise ValueError(f"named_parameters should be a sequence of (str name, parameter) tuples, usually "
                             f"produced by model.named_parameters(); entry {pos} is {_short(item)}")
    seen, dups = set(), set()
    for name, _ in named:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError(f"parameter names in named_parameters must be unique; duplicates: {', '.join(sorted(dups))}")
    by_id = {id(p): name for name, p in named}
    unnamed = [p for p in params if id(p) not in by_id]
    if unnamed:
        raise ValueError(f"named_parameters was given, but {len(unnamed)} parameter(s) of the optimizer are not "
                         f"in it (shapes {[tuple(p.shape) for p in unnamed][:5]}); pass model.named_parameters() "
                         "of the model the optimizer trains")
    return [(by_id[id(p)], p) for p in params]


def _short(item: Any) -> str:
    text = repr(item)
    return text if len(text) <= 80 else text[:77] + "..."


class _Claims:
    """Which live pipelined optimizers train each parameter (by the tensor's id, with weak
    references to both, so that a dropped optimizer frees its parameters). A fact about the
    process, like Horovod's handle counter: it is what two optimizers can share.

    A parameter claimed by a second optimizer while the first still lives is only *contested*:
    ``opt = DistributedOptimizer(...)`` run again over the same model builds the new one while
    the old one is still bound to ``opt``, and drops it right after. Its gradient settles it
    (:meth:`check`): if two of its optimizers still live when it is handed to the pipeline, it
    would be reduced twice and stepped twice, which is an error."""

    def __init__(self) -> None:
        self._by_param: Dict[int, List[Tuple["weakref.ref[torch.Tensor]", "weakref.ref[Any]", str]]] = {}
        self.contested: set = set()  # ids of parameters claimed by more than one optimizer

    def _live(self, p: torch.Tensor) -> List[Tuple[Any, str]]:
        claims = [c for c in self._by_param.get(id(p), []) if c[0]() is p and c[1]() is not None]
        self._by_param[id(p)] = claims
        return [(c[1](), c[2]) for c in claims]

    def claim(self, owner: Any, named: Sequence[Tuple[str, torch.Tensor]]) -> None:
        ref = weakref.ref(owner)
        for name, p in named:
            live = self._live(p)
            if not any(o is owner for o, _ in live):
                self._by_param[id(p)].append((weakref.ref(p), ref, name))
            if len(live) >= 1 and any(o is not owner for o, _ in live):
                self.contested.add(id(p))

    def check(self, name: str, p: torch.Tensor) -> None:
        if len(self._live(p)) > 1:
            gc.collect()  # an optimizer dropped but held in a reference cycle trains nothing
        live = self._live(p)
        if len(live) <= 1:
            self.contested.discard(id(p))
            return
        raise ValueError(
            f"parameter '{name}' is trained by {len(live)} pipesgd_hvd DistributedOptimizers at once (as "
            f"{', '.join(repr(n) for _, n in live)}): its gradient would be reduced twice and the parameter stepped "
            "twice. Give each DistributedOptimizer its own parameters (one optimizer over several param groups, or "
            "disjoint sets), or drop the first optimizer (flush() it, then del it) before wrapping its parameters "
            "again")


_CLAIMS = _Claims()


def claim_parameters(owner: Any, named: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """Records that ``owner`` (a DistributedOptimizer) trains ``named`` (see :class:`_Claims`:
    a parameter that two live optimizers train is refused when its gradient is handed over)."""
    _CLAIMS.claim(owner, named)


def check_parameters(named: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """Complex parameters cannot be averaged by the codecs (and Horovod has no complex sum)."""
    for name, p in named:
        if p.is_complex():
            raise ValueError(f"parameter '{name}' is {p.dtype}: pipesgd_hvd averages real floating-point "
                             "gradients only; store it as a real tensor with a trailing dimension of 2 "
                             "(torch.view_as_real) and view it as complex in forward (torch.view_as_complex)")


def checked_grad(name: str, p: torch.Tensor, sparse_as_dense: bool) -> torch.Tensor:
    """``p.grad`` ready for the engine (dense, same shape, dtype and device as ``p``), or an error
    naming the parameter. PyTorch's ``.grad`` setter allows none of these mismatches, but
    ``p.grad.data = ...`` and ``p.grad_dtype = None`` get past it. A parameter that two live
    optimizers train is refused here (:func:`claim_parameters`)."""
    if _CLAIMS.contested and id(p) in _CLAIMS.contested:  # (an empty set: one test per gradient)
        _CLAIMS.check(name, p)
    grad = p.grad
    if grad.is_sparse:
        if not sparse_as_dense:
            raise ValueError(f"parameter '{name}' has a sparse gradient: pass sparse_as_dense=True to "
                             "DistributedOptimizer (or use a dense embedding)")
        grad = grad.to_dense()
    if grad.is_complex() or not grad.is_floating_point():
        raise TypeError(f"parameter '{name}' has a {grad.dtype} gradient: only real floating-point gradients "
                        "can be averaged; compute the gradient in the parameter's dtype "
                        f"({p.dtype}) and do not assign other tensors to .grad.data")
    if grad.dtype != p.dtype:
        raise TypeError(f"parameter '{name}' is {p.dtype} but its gradient is {grad.dtype}: gradients are "
                        "reduced in their parameter's dtype; cast the gradient (p.grad = g.to(p.dtype))")
    if grad.shape != p.shape:
        raise ValueError(f"parameter '{name}' has shape {tuple(p.shape)} but its gradient has shape "
                         f"{tuple(grad.shape)}: assign a gradient of the parameter's shape")
    if grad.device != p.device:
        raise ValueError(f"parameter '{name}' is on {p.device} but its gradient is on {grad.device}: keep "
                         "gradients on their parameter's device")
    return grad


def check_communicator(comm: Any) -> None:
    missing = [m for m in _COMMUNICATOR_METHODS if not callable(getattr(comm, m, None))]
    if missing or not hasattr(comm, "rank") or not hasattr(comm, "size"):
        raise TypeError(f"communicator must be a pipesgd_hvd Communicator (rank, size, "
                        f"{', '.join(_COMMUNICATOR_METHODS)}) or one of 'horovod', 'mpi4py', 'torch.distributed'; "
                        f"{type(comm).__name__} lacks {', '.join(missing) or 'rank/size'}")


def check_transport_devices(comm: Any, named: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """A transport that moves host memory only (``host_only``: mpi4py) cannot reduce CUDA tensors;
    say so now, with the fix, rather than from inside the first backward pass."""
    if not getattr(comm, "host_only", False):
        return
    on_device = [(name, p.device) for name, p in named if p.device.type != "cpu"]
    if on_device:
        name, device = on_device[0]
        raise ValueError(f"communicator {type(comm).__name__} moves host memory only, but parameter '{name}' is on "
                         f"{device} ({len(on_device)} parameter(s) off the CPU): use the default communicator (the "
                         "pipeline channel, NCCL for CUDA tensors) or communicator='horovod' (Horovod built with "
                         "HOROVOD_GPU_OPERATIONS=NCCL), or keep the model on the CPU with communicator='mpi4py'")


def check_grad_scaler(scaler: Any) -> None:
    if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in ("get_scale", "unscale_")):
        raise TypeError(f"grad_scaler must be the torch.amp.GradScaler in use (or None), got {type(scaler).__name__}")


def check_groups(num_groups: Any, groups: Any, params: Sequence[torch.Tensor]) -> None:
    """Horovod's grouping arguments: accepted (and ignored: buckets replace them) when well formed."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral) or num_groups < 0:
        raise ValueError(f"num_groups must be an int >= 0 (Horovod's argument; ignored here), got {num_groups!r}")
    if num_groups:  # Horovod's own warning, which code written for Horovod may filter on
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
    if groups is None or (isinstance(groups, numbers.Integral) and not isinstance(groups, bool) and groups >= 0):
        return
    known = {id(p) for p in params}
    if not isinstance(groups, (list, tuple)) or not all(
            isinstance(g, (list, tuple)) and all(isinstance(p, torch.Tensor) and id(p) in known for p in g)
            for g in groups):
        raise ValueError("groups must be an int >= 0 or a list of lists of the optimizer's parameters "
                         "(Horovod's argument; ignored here: gradients are fused by fusion_threshold_mb)")


# Per-coordinate step sizes: staleness_correction="auto" treats these alike (staleness/choice.py).
_ADAPTIVE = ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "Adadelta", "RMSprop", "SparseAdam")


def optimizer_family(optimizer: torch.optim.Optimizer) -> str:
    """The wrapped optimizer's family for ``staleness_correction="auto"``: torch's own classes
    and their subclasses by their torch base class; anything else is "other"."""
    return family_by_class(optimizer, "torch.optim", _ADAPTIVE)
