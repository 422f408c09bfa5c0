"""A fake CUDA table (pipesgd_hvd/ops/torch_cuda.py's ``CudaTable``) for CPU-only machines.

Every tensor is reported on ``cuda:<default>`` (or on the device given for its storage with
:meth:`FakeCuda.place`, or on the host when the ``host`` predicate says so), streams and events are plain objects, and every call that matters for the
stream rules is logged: which streams were made on which device by which thread, which device
and stream were current, which event each stream waited for, and which tensor was recorded on
which stream.

What a test with it proves: the pipeline makes the calls the rules require (a side stream per
device and thread, the job under its bucket's device, markers waited for on their own device,
record_stream on the consuming stream for every tensor that crosses streams, the side stream
behind the default stream after Horovod's async completion). What it cannot prove: that those
calls are sufficient on a real GPU (the allocator's and the driver's behaviour); the real run
is tools/gpu_check.py --device cuda.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch


class FakeStream:
    def __init__(self, table: "FakeCuda", device: torch.device, name: str) -> None:
        self.table, self.device, self.name = table, device, name

    def wait_event(self, event: "FakeEvent") -> None:
        self.table.log("wait", self, event)

    def synchronize(self) -> None:
        self.table.log("synchronize", self)

    def __repr__(self) -> str:
        return f"<stream {self.name} on {self.device}>"


class FakeEvent:
    def __init__(self, table: "FakeCuda") -> None:
        self.table = table
        self.stream: Optional[FakeStream] = None

    def record(self, stream: FakeStream) -> None:
        self.stream = stream
        self.table.log("record", stream, self)

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        return self.table.elapsed_ms


class FakeCuda:
    def __init__(self, default: int = 1, elapsed_ms: float = 1.5,
                 host: Optional[Callable[[torch.Tensor], bool]] = None) -> None:
        self.default = torch.device("cuda", default)
        self._host = host  # which tensors stay host tensors (the engine's membership flags, say)
        self.elapsed_ms = elapsed_ms
        self.events: List[Tuple[Any, ...]] = []
        self.streams: List[Tuple[int, FakeStream]] = []   # (thread ident, stream) as made
        self.recorded: List[Tuple[int, FakeStream]] = []  # (storage address, stream)
        self.devices_entered: List[Tuple[int, torch.device]] = []
        self._placed: Dict[int, torch.device] = {}
        self._defaults: Dict[str, FakeStream] = {}
        self._local = threading.local()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------ test helpers
    def log(self, *entry: Any) -> None:
        with self._lock:
            self.events.append((threading.get_ident(),) + entry)

    def place(self, x: torch.Tensor, index: int) -> torch.Tensor:
        self._placed[x.untyped_storage().data_ptr()] = torch.device("cuda", index)
        return x

    def recorded_on(self, x: torch.Tensor) -> List[FakeStream]:
        address = x.untyped_storage().data_ptr()
        return [s for a, s in self.recorded if a == address]

    # -------------------------------------------------------------------------- the table
    def device_of(self, x: torch.Tensor) -> Optional[torch.device]:
        placed = self._placed.get(x.untyped_storage().data_ptr())
        if placed is None and self._host is not None and self._host(x):
            return None
        return placed or self.default

    def active(self) -> bool:
        return True

    def new_stream(self, device: torch.device) -> FakeStream:
        stream = FakeStream(self, torch.device(device), f"side{len(self.streams)}")
        with self._lock:
            self.streams.append((threading.get_ident(), stream))
        return stream

    def _current(self) -> Dict[str, FakeStream]:
        if not hasattr(self._local, "current"):
            self._local.current = {}
        return self._local.current

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        current = self._current()
        key = str(stream.device)
        before = current.get(key)
        current[key] = stream
        try:
            yield
        finally:
            if before is None:
                del current[key]
            else:
                current[key] = before

    @contextlib.contextmanager
    def use_device(self, device: torch.device) -> Iterator[None]:
        with self._lock:
            self.devices_entered.append((threading.get_ident(), torch.device(device)))
        yield

    def current_stream(self, device: torch.device) -> FakeStream:
        return self._current().get(str(device)) or self.default_stream(device)

    def default_stream(self, device: torch.device) -> FakeStream:
        key = str(device)
        with self._lock:
            if key not in self._defaults:
                self._defaults[key] = FakeStream(self, torch.device(device), f"default:{key}")
            return self._defaults[key]

    def new_event(self, timing: bool = False) -> FakeEvent:
        return FakeEvent(self)

    def record_stream(self, x: torch.Tensor, stream: FakeStream) -> None:
        with self._lock:
            self.recorded.append((x.untyped_storage().data_ptr(), stream))
