"""The CUDA stream rules of the PyTorch table, behind one small seam that tests can fake.

Codec work of a byte codec runs on the engine's communication thread, on a side stream, while the
training thread's kernels run on the compute stream. Every rule below exists because the caching
allocator and the CUDA runtime are per stream and per thread:

* **A side stream per (device, thread).** Streams belong to one device; the current device is
  per thread and is cuda:0 in a new thread. A stream made without naming the device would open
  a context on GPU 0 for every local rank, and its kernels could not touch the bucket's memory.
* **The job runs under its bucket's device** (``torch.cuda.device``), so that the tensors the
  codec allocates land next to the bucket.
* **Markers carry their device.** A marker is an event recorded on the producer's stream; the
  consumer makes *its* stream of the *same device* wait for it.
* **record_stream for every tensor that crosses streams.** The allocator reuses a freed block on
  the stream that allocated it as soon as the host drops it. A transport's output (allocated on
  its own stream) decoded on the side stream, and a side-stream result read on the compute
  stream, must be recorded on the stream that reads them, or the block can be handed to new
  work before the read has run.
* **Async completion.** With ``HOROVOD_ENABLE_ASYNC_COMPLETION=1`` Horovod marks a handle done
  once it has made its own thread's current stream (the device's default stream) wait for the
  collective; the host does not wait. A side stream that decodes the result must itself wait:
  it waits for an event recorded on the default stream after the handle is done.

:class:`CudaTable` is the seam: the real one calls ``torch.cuda``; a test supplies a fake one
(tests/test_torch_streams.py) to check the rules on a CPU-only machine.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, ContextManager, Dict, Iterator, Optional, Protocol, Tuple

import torch


class CudaTable(Protocol):
    """The CUDA calls the stream rules make."""

    def device_of(self, x: torch.Tensor) -> Optional[torch.device]:
        """``x``'s CUDA device, or None for a host tensor."""
    def active(self) -> bool:
        """CUDA is available and initialised in this process (streams are worth making)."""
    def new_stream(self, device: torch.device) -> Any: ...
    def use_stream(self, stream: Any) -> ContextManager[Any]: ...
    def use_device(self, device: torch.device) -> ContextManager[Any]: ...
    def current_stream(self, device: torch.device) -> Any: ...
    def default_stream(self, device: torch.device) -> Any: ...
    def new_event(self, timing: bool = False) -> Any: ...
    def record_stream(self, x: torch.Tensor, stream: Any) -> None: ...


class TorchCuda:
    """:class:`CudaTable` over ``torch.cuda``."""

    def device_of(self, x: torch.Tensor) -> Optional[torch.device]:
        return x.device if x.device.type == "cuda" else None

    def active(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def use_stream(self, stream: Any) -> ContextManager[Any]:
        return torch.cuda.stream(stream)

    def use_device(self, device: torch.device) -> ContextManager[Any]:
        return torch.cuda.device(device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def default_stream(self, device: torch.device) -> Any:
        return torch.cuda.default_stream(device)

    def new_event(self, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def record_stream(self, x: torch.Tensor, stream: Any) -> None:
        x.record_stream(stream)


@dataclass(frozen=True)
class Marker:
    """A position in one device's stream: an event and the device it was recorded on."""

    device: torch.device
    event: Any


class StreamRules:
    """The rules of the module docstring for one TensorOps table (one per table, shared by threads)."""

    def __init__(self, cuda: Optional[CudaTable] = None) -> None:
        self.cuda: CudaTable = cuda if cuda is not None else TorchCuda()
        self._local = threading.local()  # this thread's side streams, by device

    def side_stream(self, device: torch.device) -> Any:
        """This thread's side stream on ``device`` (made on first use, on that device)."""
        streams: Dict[Any, Any] = getattr(self._local, "streams", None) or {}
        self._local.streams = streams
        key = str(device)
        if key not in streams:
            streams[key] = self.cuda.new_stream(device)
        return streams[key]

    @contextlib.contextmanager
    def guard(self, like: Any) -> Iterator[None]:
        """``like``'s device current, and this thread's side stream of that device; nothing for host
        tensors."""
        device = self.cuda.device_of(like) if isinstance(like, torch.Tensor) else None
        if device is None or not self.cuda.active():
            yield
            return
        with self.cuda.use_device(device), self.cuda.use_stream(self.side_stream(device)):
            yield

    def ready_marker(self, like: torch.Tensor) -> Optional[Marker]:
        device = self.cuda.device_of(like)
        if device is None:
            return None
        event = self.cuda.new_event()
        event.record(self.cuda.current_stream(device))
        return Marker(device, event)

    def wait_marker(self, marker: Optional[Marker]) -> None:
        if marker is not None:
            self.cuda.current_stream(marker.device).wait_event(marker.event)

    def record_use(self, x: torch.Tensor) -> None:
        """``x`` is read (or written) by the current stream of its device: its memory is not reused
        before that stream's work queued so far has run."""
        device = self.cuda.device_of(x)
        if device is not None:
            self.cuda.record_stream(x, self.cuda.current_stream(device))

    def follow_default_stream(self, x: torch.Tensor) -> None:
        """The current stream of ``x``'s device waits for everything queued on that device's default
        stream so far (Horovod's async completion made the default stream wait for the collective)."""
        device = self.cuda.device_of(x)
        if device is None:
            return
        current, default = self.cuda.current_stream(device), self.cuda.default_stream(device)
        if current == default:
            return  # already ordered behind it
        event = self.cuda.new_event()
        event.record(default)
        current.wait_event(event)

    def wait_ready(self, x: torch.Tensor) -> None:
        """Blocks the host until the current stream's work on ``x``'s device has run (a sync; for
        timing only, never on the training path)."""
        device = self.cuda.device_of(x)
        if device is not None:
            self.cuda.current_stream(device).synchronize()

    def device_seconds(self, like: torch.Tensor, work: Any) -> Tuple[Any, Optional[float]]:
        """Runs ``work()`` and returns (its result, seconds of the current stream's GPU time between
        two timing events), or (result, None) for a host tensor. Synchronises on the end event."""
        device = self.cuda.device_of(like)
        if device is None:
            return work(), None
        stream = self.cuda.current_stream(device)
        start, end = self.cuda.new_event(timing=True), self.cuda.new_event(timing=True)
        start.record(stream)
        result = work()
        end.record(stream)
        end.synchronize()
        return result, start.elapsed_time(end) / 1e3
