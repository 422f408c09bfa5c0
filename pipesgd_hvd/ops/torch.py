"""TensorOps for PyTorch tensors, on CPU or CUDA (codec work goes to a side CUDA stream)."""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Sequence, Tuple

import numpy as np
import torch

from .base import Shape
from .seeds import eager_seed
from .torch_cuda import CudaTable, StreamRules

_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32,
    "int64": torch.int64, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def torch_dtype(dtype: str) -> torch.dtype:
    return _DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _standard_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _device(like: Optional[torch.Tensor]) -> torch.device:
    return like.device if like is not None else torch.device("cpu")


class TorchOps:
    name = "torch"

    def __init__(self, fused: bool = True, cuda: Optional[CudaTable] = None) -> None:
        # Side streams per (device, thread), markers, record_stream: ops/torch_cuda.py.
        # ``cuda``: a fake CUDA table for tests of those rules on a CPU-only machine.
        self.streams = StreamRules(cuda)
        self.fused = fused  # False: codecs run their unfused tensor-op reference (the tests' baseline)

    def dtype_name(self, x: torch.Tensor) -> str:
        return dtype_name(x.dtype)

    def shape(self, x: torch.Tensor) -> Shape:
        return tuple(x.shape)

    def numel(self, x: torch.Tensor) -> int:
        return x.numel()

    def zeros(self, shape: Shape, dtype: str, like: Optional[torch.Tensor] = None) -> torch.Tensor:
        return torch.zeros(shape, dtype=_DTYPES[dtype], device=_device(like))

    def empty(self, shape: Shape, dtype: str, like: Optional[torch.Tensor] = None) -> torch.Tensor:
        return torch.empty(shape, dtype=_DTYPES[dtype], device=_device(like))

    def full(self, shape: Shape, value: float, dtype: str, like: Optional[torch.Tensor] = None) -> torch.Tensor:
        return torch.full(shape, value, dtype=_DTYPES[dtype], device=_device(like))

    def cast(self, x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(_DTYPES[dtype])

    def reshape(self, x: torch.Tensor, shape: Shape) -> torch.Tensor:
        return x.reshape(shape)

    def concat(self, xs: Sequence[torch.Tensor], axis: int = 0) -> torch.Tensor:
        return torch.cat(list(xs), dim=axis)

    def stack(self, xs: Sequence[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.stack(list(xs), dim=axis)

    def sum(self, x: torch.Tensor, axis: int, keepdims: bool = False) -> torch.Tensor:
        return torch.sum(x, dim=axis, keepdim=keepdims)

    def abs(self, x: torch.Tensor) -> torch.Tensor:
        return torch.abs(x)

    def amax(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.amax(x, dim=axis)

    def amax_abs(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.amax(torch.abs(x), dim=axis)  # (measured faster than the infinity norm)

    def to_levels(self, x: torch.Tensor, divisor: torch.Tensor, levels: float, offset: float,
                  noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        # One new tensor, then in place: a fresh large tensor costs ~4x an in-place pass here.
        y = torch.div(x, divisor).mul_(levels)
        y = y.round_() if noise is None else y.add_(noise).floor_()
        return y.add_(offset).clamp_(offset - levels, offset + levels)

    def from_levels(self, codes: torch.Tensor, scale: torch.Tensor, levels: float, offset: float) -> torch.Tensor:
        return codes.to(torch.float32).sub_(offset).div_(levels).mul_(scale)

    def finite_or_zero(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nan_to_num_(x, nan=0.0, posinf=0.0, neginf=0.0)

    def round(self, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    def floor(self, x: torch.Tensor) -> torch.Tensor:
        return torch.floor(x)

    def clip(self, x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
        return torch.clamp(x, lo, hi)

    def where(self, cond: torch.Tensor, a: Any, b: Any) -> torch.Tensor:
        return torch.where(cond, a, b)

    def isfinite(self, x: torch.Tensor) -> torch.Tensor:
        return torch.isfinite(x)

    def isnan(self, x: torch.Tensor) -> torch.Tensor:
        return torch.isnan(x)

    def all(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.all(x, dim=axis)

    def logical_and(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.logical_and(a, b)

    def logical_not(self, a: torch.Tensor) -> torch.Tensor:
        return torch.logical_not(a)

    def bitcast(self, x: torch.Tensor, dtype: str) -> torch.Tensor:
        # view(dtype) needs standard strides; a one-row column slice counts as "contiguous" while
        # keeping its parent's row stride, so compare against the standard strides explicitly.
        if x.stride() != _standard_strides(x.shape):
            x = x.clone(memory_format=torch.contiguous_format)
        return x.view(_DTYPES[dtype])

    def uniform(self, shape: Shape, seed: Any, like: Optional[torch.Tensor] = None) -> torch.Tensor:
        device = _device(like)
        gen = torch.Generator(device=device)
        gen.manual_seed(eager_seed(seed))
        return torch.rand(shape, generator=gen, device=device, dtype=torch.float32)

    def new_state(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach().clone()

    def assign(self, state: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return state.copy_(value)

    def read(self, state: torch.Tensor) -> torch.Tensor:
        return state

    def assign_scaled(self, state: torch.Tensor, x: torch.Tensor, scale: Any, accumulate: bool = False) -> torch.Tensor:
        if accumulate:
            return state.add_(x * scale)  # not add_(x, alpha=scale): that one may fuse (another rounding)
        return torch.mul(x, scale, out=state)

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        if x.device.type != "cpu" or self.streams.cuda.device_of(x) is not None:
            raise ValueError(f"to_numpy needs a host tensor, got one on {x.device}: a transport that moves host "
                             "memory only (mpi4py) cannot reduce CUDA tensors; use the default communicator "
                             "(the pipeline channel: NCCL for CUDA tensors) or communicator='horovod'")
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16: move the raw bits
            return x.view(torch.int16).numpy()
        return x.numpy()

    def from_numpy(self, a: np.ndarray, like: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = torch.from_numpy(a)
        if like is not None and like.dtype == torch.bfloat16 and out.dtype == torch.int16:
            out = out.view(torch.bfloat16)
        return out.to(_device(like)) if like is not None else out

    def kernel_address(self, x: torch.Tensor) -> Optional[int]:
        if not self.fused or x.device.type != "cpu" or not x.is_contiguous() \
                or self.streams.cuda.device_of(x) is not None:  # a (fake) device tensor has no host address
            return None
        return x.data_ptr()

    def kernel_device(self, x: torch.Tensor) -> Optional[str]:
        if not self.fused or self.streams.cuda.device_of(x) is None:
            return None
        return "cuda"

    def copy_into_(self, dst: torch.Tensor, offset: int, src: torch.Tensor) -> None:
        dst.narrow(0, offset, src.numel()).copy_(src.reshape(-1))

    def fill_(self, dst: torch.Tensor, offset: int, numel: int, value: float) -> None:
        dst.narrow(0, offset, numel).fill_(value)

    def view(self, flat: torch.Tensor, offset: int, numel: int, shape: Shape) -> torch.Tensor:
        return flat.narrow(0, offset, numel).view(shape)

    def host_array(self, x: torch.Tensor) -> np.ndarray:
        """A host numpy copy of ``x``'s values (for checks and timing; a device tensor syncs)."""
        host = x.detach().cpu()
        return (host.view(torch.int16) if host.dtype == torch.bfloat16 else host).numpy().copy()

    def move_like(self, x: torch.Tensor, like: Optional[torch.Tensor]) -> torch.Tensor:
        """``x`` on ``like``'s device (itself if already there): state loaded with
        ``map_location="cpu"`` goes back next to the bucket it belongs to."""
        if like is None or x.device == like.device:
            return x
        return x.to(like.device)

    # ---------------------------------------------------------------- streams (torch_cuda.py)
    def stream_guard(self, like: Optional[torch.Tensor] = None) -> ContextManager[Any]:
        return self.streams.guard(like)

    def ready_marker(self, like: torch.Tensor) -> Any:
        return self.streams.ready_marker(like)

    def wait_marker(self, marker: Any) -> None:
        self.streams.wait_marker(marker)

    def record_use(self, x: torch.Tensor) -> None:
        self.streams.record_use(x)

    def follow_default_stream(self, x: torch.Tensor) -> None:
        self.streams.follow_default_stream(x)

    def wait_ready(self, x: torch.Tensor) -> None:
        self.streams.wait_ready(x)

    def device_seconds(self, like: torch.Tensor, work: Callable[[], Any]) -> Tuple[Any, Optional[float]]:
        return self.streams.device_seconds(like, work)

TORCH_OPS = TorchOps()
