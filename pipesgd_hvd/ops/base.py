"""The one seam between framework-free code and a framework's tensors.

Codecs, the compressed all-reduce and the pipeline engine are written once against
:class:`TensorOps`; each framework supplies a small table (``ops/numpy.py``,
``ops/torch.py``, ``ops/tensorflow.py``). Element-wise arithmetic uses Python's
operators (``+ - * /``) and basic slicing (``x[:, a:b]``, ``x[:, 0::2]``), which all three support
with the same meaning; everything else goes through the table.

Dtypes are named by strings ("float32", "float16", "bfloat16", "uint8", ...) so that nothing here
imports a framework.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Protocol, Sequence, Tuple

Tensor = Any  # a numpy array, torch.Tensor or tf.Tensor, depending on the table
Shape = Tuple[int, ...]

# Bytes per element for the dtypes the engine and codecs move.
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "uint8": 1, "int8": 1,
            "int32": 4, "int64": 8}


class TensorOps(Protocol):
    """Functional tensor operations every framework provides (usable inside a traced graph)."""

    name: str

    def dtype_name(self, x: Tensor) -> str: ...
    def shape(self, x: Tensor) -> Shape: ...
    def numel(self, x: Tensor) -> int: ...
    def zeros(self, shape: Shape, dtype: str, like: Optional[Tensor] = None) -> Tensor:
        """Zeros on ``like``'s device (host when None)."""
    def full(self, shape: Shape, value: float, dtype: str, like: Optional[Tensor] = None) -> Tensor: ...
    def cast(self, x: Tensor, dtype: str) -> Tensor: ...
    def reshape(self, x: Tensor, shape: Shape) -> Tensor: ...
    def concat(self, xs: Sequence[Tensor], axis: int = 0) -> Tensor: ...
    def stack(self, xs: Sequence[Tensor], axis: int) -> Tensor: ...
    def sum(self, x: Tensor, axis: int, keepdims: bool = False) -> Tensor: ...
    def abs(self, x: Tensor) -> Tensor: ...
    def amax(self, x: Tensor, axis: int) -> Tensor: ...
    def amax_abs(self, x: Tensor, axis: int) -> Tensor:
        """``max(|x|)`` along ``axis``, NaN if a NaN is there."""
    def to_levels(self, x: Tensor, divisor: Tensor, levels: float, offset: float,
                  noise: Optional[Tensor] = None) -> Tensor:
        """Quantizer codes: ``clip(round(x / divisor * levels) + offset, offset - levels, offset + levels)``
        (``floor(... + noise)`` instead of ``round`` when ``noise`` is given); ``divisor`` broadcasts.
        Fused because each pass over a large bucket costs as much as sending it on a fast link."""
    def from_levels(self, codes: Tensor, scale: Tensor, levels: float, offset: float) -> Tensor:
        """Inverse of :meth:`to_levels`: float32 ``(codes - offset) / levels * scale`` (``scale`` broadcasts)."""
    def finite_or_zero(self, x: Tensor) -> Tensor:
        """``x`` with every NaN and +-inf replaced by 0. May overwrite ``x``: pass a temporary."""
    def round(self, x: Tensor) -> Tensor:
        """Round half to even (the IEEE default; all three frameworks agree)."""
    def floor(self, x: Tensor) -> Tensor: ...
    def clip(self, x: Tensor, lo: float, hi: float) -> Tensor: ...
    def where(self, cond: Tensor, a: Tensor, b: Tensor) -> Tensor: ...
    def isfinite(self, x: Tensor) -> Tensor: ...
    def isnan(self, x: Tensor) -> Tensor: ...
    def all(self, x: Tensor, axis: int) -> Tensor: ...
    def logical_and(self, a: Tensor, b: Tensor) -> Tensor: ...
    def logical_not(self, a: Tensor) -> Tensor: ...
    def bitcast(self, x: Tensor, dtype: str) -> Tensor:
        """Reinterpret the bytes of ``x`` (C order, little-endian) along its last axis.

        The last axis grows or shrinks by the itemsize ratio: float32 [r, n] -> uint8 [r, 4n].
        """
    def uniform(self, shape: Shape, seed: Any, like: Optional[Tensor] = None) -> Tensor:
        """float32 uniform in [0, 1), a pure function of ``seed`` (an int or a 2-int tensor)."""
    def new_state(self, value: Tensor) -> Tensor:
        """A mutable holder initialised to ``value`` (a tensor, or a variable in a graph)."""
    def assign(self, state: Tensor, value: Tensor) -> Tensor:
        """Overwrite a holder made by :meth:`new_state`; returns the holder."""
    def read(self, state: Tensor) -> Tensor: ...
    def assign_scaled(self, state: Tensor, x: Tensor, scale: Any, accumulate: bool = False) -> Tensor:
        """``state = x * scale``, or with ``accumulate`` ``state += x * scale`` (the same rounding as
        those expressions); returns the holder. Eagerly without the temporary and the copy of
        ``assign``: the accurate mode does it to every gradient twice per update."""
    def to_numpy(self, x: Tensor) -> Any:
        """A host numpy array (zero-copy where the framework allows)."""
    def from_numpy(self, a: Any, like: Optional[Tensor] = None) -> Tensor: ...
    def kernel_address(self, x: Tensor) -> Optional[int]:
        """Address of ``x``'s first element when the fused host kernels (compression/host_kernels.py)
        may read it (and write it, if the codec owns it: outputs, residuals): a C-contiguous
        tensor in host memory of a table that also has :meth:`MutableTensorOps.empty`. None
        otherwise (GPU and graph tensors, a table built with ``fused=False``): the codecs then
        use :meth:`kernel_device`, or their tensor-op reference where that is None too."""
    def kernel_device(self, x: Tensor) -> Optional[str]:
        """Which device kernels may take a tensor without an address: ``"cuda"`` for a CUDA
        tensor of a fused table (``compression/triton_kernels.py``, when Triton is importable),
        ``"tensorflow"`` for a TensorFlow CPU tensor of a fused table (the host kernels inside
        ``tf.numpy_function``, ``compression/tf_kernels.py``). None: host kernels or the
        reference. The table names the device; ``compression/device_kernels.py`` picks the code."""
    def record_use(self, x: Tensor) -> None:
        """``x`` crossed streams and is used by the current one (CUDA: ``record_stream``, so the
        allocator does not hand its memory to other work before this stream has read it).
        No-op for host and graph tensors."""
    def host_array(self, x: Tensor) -> Any:
        """A host numpy copy of ``x``'s values, wherever it lives (a sync on GPU: checks, timing)."""
    def move_like(self, x: Tensor, like: Optional[Tensor]) -> Tensor:
        """``x`` on ``like``'s device (itself when already there or ``like`` is None)."""
    def device_seconds(self, like: Tensor, work: Callable[[], Any]) -> Tuple[Any, Optional[float]]:
        """(``work()``, seconds of device time it queued on ``like``'s device, timed with events),
        or (``work()``, None) for host tensors."""


class MutableTensorOps(TensorOps, Protocol):
    """In-place extras of eager frameworks (numpy, PyTorch); the pipeline's fusion buffers use them."""

    def empty(self, shape: Shape, dtype: str, like: Optional[Tensor] = None) -> Tensor: ...
    def copy_into_(self, dst: Tensor, offset: int, src: Tensor) -> None:
        """``dst[offset:offset + src.numel()] = src.flatten()``, casting to dst's dtype."""
    def fill_(self, dst: Tensor, offset: int, numel: int, value: float) -> None: ...
    def view(self, flat: Tensor, offset: int, numel: int, shape: Shape) -> Tensor:
        """A view of ``flat[offset:offset + numel]`` with ``shape`` (no copy)."""
    def stream_guard(self, like: Optional[Tensor] = None) -> ContextManager[Any]:
        """Runs codec work for ``like`` on this thread's side stream of ``like``'s device, with
        that device current (CUDA; nothing on CPU)."""
    def ready_marker(self, like: Tensor) -> Any:
        """Marks the current stream's position on ``like``'s device (a CUDA event on GPU, None on CPU)."""
    def wait_marker(self, marker: Any) -> None:
        """Makes the current stream of the marker's device wait for it (no-op for None)."""
