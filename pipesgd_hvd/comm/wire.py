"""How objects cross processes: a typed encoding instead of pickle, and the per-job secret.

Why not pickle: ``pickle.loads`` on bytes from the network runs whatever code they name, so
anyone who can reach a rank's port could run code on the cluster (torch.distributed says its
object collectives assume a trusted network for the same reason). The pipeline gathers a few
kinds of things: step counts, settings, checksums, measurements, and checkpoint-like states
(in-flight gradients, the wrapped optimizer's ``state_dict``). This encoding carries exactly those:

* JSON for the structure: ``None``, ``bool``, ``int``, ``float`` (nan and inf too), ``str``,
  ``list``; tagged objects for what JSON lacks: ``{"tuple": [...]}``, ``{"dict": [[key, value],
  ...]}`` (any encodable hashable keys: a torch ``state_dict`` has int keys), ``{"bytes": i}``;
* raw little-endian bytes for arrays, after the JSON: ``{"ndarray": i, "dtype": "float32",
  "shape": [2, 3]}`` (numpy arrays and scalars, ml_dtypes' bfloat16 too; eager TensorFlow tensors
  and variables go as numpy arrays and come back so) and ``{"tensor": i, ...}`` (torch tensors,
  moved to the host; decoded as CPU tensors: the engine moves them back to their parameter's
  device).

Anything else is refused with a :class:`TypeError` that names where it sits (``at ['state'][0]``)
and what to convert it to. Decoding checks everything it reads (magic, lengths, tags, dtypes,
shapes against byte counts, nesting depth) and raises :class:`WireError` on anything malformed:
it never runs code, whatever the bytes.

The per-job secret (:func:`new_secret`, :func:`mac`): rank 0 makes 32 random bytes and hands
them to every rank through Horovod's own broadcast, which runs inside the job; a peer proves it
holds them with an HMAC-SHA256 (the idea of Horovod's ``runner/common/util/secret.py``), and
bytes whose MAC does not check are never used. See :mod:`.pipeline_channel` and
``docs/reliability.md`` ("Who can talk to a job").
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import struct
import sys
from typing import Any, Dict, List, Tuple

import numpy as np

MAGIC = b"PSGDw1\n"
MAC_BYTES = 32
MAX_DEPTH = 64  # deeper nesting than any state the pipeline sends; bounds the decoder's recursion

# numpy dtypes that may cross (by numpy's name); torch adds bfloat16, which numpy lacks.
_NUMPY_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64", "complex64", "complex128")
_TORCH_DTYPES = _NUMPY_DTYPES + ("bfloat16",)
_HEADER = struct.Struct("<I")

if sys.byteorder != "little":  # the raw array bytes are little-endian
    raise ImportError("pipesgd_hvd's wire encoding assumes a little-endian machine")


class WireError(ValueError):
    """Bytes that are not a valid encoding (corrupt, truncated, or not from a pipesgd_hvd rank)."""


# ------------------------------------------------------------------------------------- secret
def new_secret() -> bytes:
    """A fresh per-job secret (rank 0 makes it; every rank receives it from rank 0)."""
    return secrets.token_bytes(32)


def mac(secret: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` (each length-prefixed, so that no two splits sign the same)."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        h.update(_HEADER.pack(len(part)))
        h.update(part)
    return h.digest()


def mac_ok(secret: bytes, expected_tag: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(mac(secret, *parts), expected_tag)


# ------------------------------------------------------------------------------------- encode
def encode(obj: Any) -> bytes:
    """``obj`` as bytes (module docstring); TypeError for anything that cannot cross."""
    buffers: List[bytes] = []
    root = _encode(obj, buffers, "", 0)
    header = json.dumps({"root": root, "buffers": [len(b) for b in buffers]}, separators=(",", ":"),
                        allow_nan=True).encode()
    return b"".join([MAGIC, _HEADER.pack(len(header)), header, *buffers])


def _refuse(obj: Any, where: str, why: str = "") -> TypeError:
    return TypeError(
        f"cannot send a {type(obj).__module__}.{type(obj).__qualname__} between ranks{f' at {where}' if where else ''}"
        f"{': ' + why if why else ''}. pipesgd_hvd's object collectives carry only None, bool, int, float, str, "
        "bytes, lists, tuples, dicts, numpy arrays and torch tensors (a typed encoding instead of pickle, so that "
        "nothing received can run code); convert it to one of those first")


def _encode(obj: Any, buffers: List[bytes], where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise TypeError(f"cannot send an object nested more than {MAX_DEPTH} levels deep between ranks (at {where})")
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, np.generic):  # before int/float: np.float64 is a float, np.bool_ is neither
        array = _numpy_array(np.asarray(obj), obj, where)
        buffers.append(array.tobytes())
        return {"npscalar": len(buffers) - 1, "dtype": array.dtype.name}
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        buffers.append(bytes(obj))
        return {"bytes": len(buffers) - 1}
    if isinstance(obj, np.ndarray):
        array = _numpy_array(obj, obj, where)
        buffers.append(array.tobytes())
        return {"ndarray": len(buffers) - 1, "dtype": array.dtype.name, "shape": list(array.shape)}
    torch = sys.modules.get("torch")  # a torch tensor can only exist if torch is imported
    if torch is not None and isinstance(obj, torch.Tensor):
        return _encode_tensor(torch, obj, buffers, where)
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(obj, (tf.Tensor, tf.Variable)):  # eager values: they come back numpy
        return _encode(obj.numpy(), buffers, where, depth)
    if isinstance(obj, list):
        return [_encode(v, buffers, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):  # torch.Size too: it comes back a tuple
        return {"tuple": [_encode(v, buffers, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]}
    if isinstance(obj, dict):  # OrderedDict too: the order is kept, the class is not
        return {"dict": [[_encode(k, buffers, f"{where} (a key)", depth + 1),
                          _encode(v, buffers, f"{where}[{k!r}]", depth + 1)] for k, v in obj.items()]}
    raise _refuse(obj, where)


def _numpy_array(array: np.ndarray, obj: Any, where: str) -> np.ndarray:
    if array.dtype.name == "bfloat16":  # ml_dtypes' (TensorFlow's, Keras's): its raw bytes
        return np.ascontiguousarray(array) if array.ndim else array.copy()
    if array.dtype.name not in _NUMPY_DTYPES:
        raise _refuse(obj, where, f"dtype {array.dtype} is not one of {', '.join(_NUMPY_DTYPES)}")
    # (not ascontiguousarray: it makes a 0-d array 1-d)
    return array.astype(array.dtype.newbyteorder("<"), order="C", copy=False)


def _encode_tensor(torch: Any, t: Any, buffers: List[bytes], where: str) -> Dict[str, Any]:
    dtype = str(t.dtype).replace("torch.", "")
    if t.layout != torch.strided or t.is_quantized or dtype not in _TORCH_DTYPES:
        raise _refuse(t, where, f"only dense tensors of {', '.join(_TORCH_DTYPES)} (this one: {t.dtype}, {t.layout})")
    host = t.detach().to("cpu").contiguous()
    # numpy has no bfloat16: its bytes go as int16 of the same width
    raw = host.view(torch.int16) if dtype == "bfloat16" else host
    buffers.append(raw.numpy().tobytes())
    return {"tensor": len(buffers) - 1, "dtype": dtype, "shape": list(t.shape)}


# ------------------------------------------------------------------------------------- decode
def decode(data: bytes) -> Any:
    """The object :func:`encode` made; WireError for anything else (it never runs code)."""
    view = memoryview(data)
    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise WireError("received bytes that are not a pipesgd_hvd object (wrong magic): a rank of another "
                        "version, or someone outside the job, sent them")
    start = len(MAGIC) + _HEADER.size
    if len(view) < start:
        raise WireError("received a truncated object")
    (length,) = _HEADER.unpack(view[len(MAGIC):start])
    if start + length > len(view):
        raise WireError(f"received a truncated object (header of {length} bytes, {len(view) - start} there)")
    try:
        header = json.loads(bytes(view[start:start + length]).decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise WireError(f"received an object whose header is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict) or set(header) != {"root", "buffers"} or not isinstance(header["buffers"], list):
        raise WireError("received an object with a malformed header")
    sizes = header["buffers"]
    if not all(type(s) is int and s >= 0 for s in sizes):
        raise WireError("received an object with malformed buffer sizes")
    offset, buffers = start + length, []
    for size in sizes:
        buffers.append(view[offset:offset + size])
        offset += size
    if offset != len(view):
        raise WireError(f"received an object of {len(view)} bytes whose header accounts for {offset}")
    return _Decoder(buffers).node(header["root"], 0)


class _Decoder:
    def __init__(self, buffers: List[memoryview]) -> None:
        self.buffers = buffers

    def node(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise WireError(f"received an object nested more than {MAX_DEPTH} levels deep")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.node(v, depth + 1) for v in node]
        if not isinstance(node, dict) or not node:
            raise WireError(f"received a malformed object node of type {type(node).__name__}")
        if "tuple" in node and len(node) == 1 and isinstance(node["tuple"], list):
            return tuple(self.node(v, depth + 1) for v in node["tuple"])
        if "dict" in node and len(node) == 1 and isinstance(node["dict"], list):
            return self._dict(node["dict"], depth)
        if "bytes" in node and len(node) == 1:
            return bytes(self._buffer(node["bytes"]))
        if "ndarray" in node or "npscalar" in node:
            return self._numpy(node)
        if "tensor" in node:
            return self._tensor(node)
        raise WireError(f"received an object node with unknown tags {sorted(node)[:4]}")

    def _dict(self, items: List[Any], depth: int) -> Dict[Any, Any]:
        out: Dict[Any, Any] = {}
        for item in items:
            if not isinstance(item, list) or len(item) != 2:
                raise WireError("received a malformed dict entry")
            key = self.node(item[0], depth + 1)
            try:
                hash(key)
            except TypeError:
                raise WireError(f"received a dict key of unhashable type {type(key).__name__}") from None
            out[key] = self.node(item[1], depth + 1)
        return out

    def _buffer(self, index: Any) -> memoryview:
        if type(index) is not int or not 0 <= index < len(self.buffers):
            raise WireError(f"received an object that refers to buffer {index!r} of {len(self.buffers)}")
        return self.buffers[index]

    @staticmethod
    def _shape(node: Dict[str, Any], allowed: Tuple[str, ...], keys: set) -> Tuple[str, Tuple[int, ...]]:
        if set(node) != keys:
            raise WireError(f"received an array node with keys {sorted(node)}")
        dtype, shape = node["dtype"], node.get("shape", [])
        if dtype not in allowed:
            raise WireError(f"received an array of dtype {dtype!r}, not one of {', '.join(allowed)}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise WireError(f"received an array with a malformed shape {shape!r}")
        return dtype, tuple(shape)

    def _numpy(self, node: Dict[str, Any]) -> Any:
        scalar = "npscalar" in node
        keys = {"npscalar", "dtype"} if scalar else {"ndarray", "dtype", "shape"}
        dtype, shape = self._shape(node, _NUMPY_DTYPES + ("bfloat16",), keys)
        raw = self._buffer(node["npscalar" if scalar else "ndarray"])
        item = _bfloat16() if dtype == "bfloat16" else np.dtype(dtype).newbyteorder("<")
        if len(raw) != item.itemsize * _count(shape):
            raise WireError(f"received a {dtype} array of shape {shape} with {len(raw)} bytes")
        array = np.frombuffer(raw, dtype=item).reshape(shape).astype(item.newbyteorder("="), copy=True)
        return array[()] if scalar else array

    def _tensor(self, node: Dict[str, Any]) -> Any:
        dtype, shape = self._shape(node, _TORCH_DTYPES, {"tensor", "dtype", "shape"})
        raw = self._buffer(node["tensor"])
        try:
            import torch
        except ImportError:
            raise WireError("received a torch tensor, but torch is not installed here") from None
        torch_dtype = getattr(torch, dtype)
        itemsize = torch.empty((), dtype=torch_dtype).element_size()
        if len(raw) != itemsize * _count(shape):
            raise WireError(f"received a {dtype} tensor of shape {shape} with {len(raw)} bytes")
        if not len(raw):
            return torch.empty(shape, dtype=torch_dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch_dtype).reshape(shape)


def _bfloat16() -> np.dtype:
    try:
        import ml_dtypes  # installed with TensorFlow and JAX
    except ImportError:
        raise WireError("received a numpy bfloat16 array, but ml_dtypes (which numpy needs for it) is not "
                        "installed here") from None
    return np.dtype(ml_dtypes.bfloat16)


def _count(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------- signed frames
def seal(secret: bytes, context: bytes, payload: bytes) -> bytes:
    """``payload`` preceded by its MAC under the job's ``secret`` (``context`` names what it is,
    so that a frame cannot be replayed as something else)."""
    return mac(secret, context, payload) + payload


def open_sealed(secret: bytes, context: bytes, frame: bytes, sender: str) -> bytes:
    """The payload of a :func:`seal` frame, or WireError if its MAC does not check: the bytes did
    not come from a rank of this job."""
    tag, payload = bytes(frame[:MAC_BYTES]), bytes(frame[MAC_BYTES:])
    if len(frame) < MAC_BYTES or not mac_ok(secret, tag, context, payload):
        raise WireError(f"bytes received from {sender} do not carry this job's secret: they did not come from a rank "
                        "of this job (someone outside it reached the pipeline's port, or a stale job on the same "
                        "port). Refused; check who can reach the training hosts (docs/reliability.md, 'Who can "
                        "talk to a job')")
    return payload


__all__ = ["MAC_BYTES", "WireError", "decode", "encode", "mac", "mac_ok", "new_secret", "open_sealed", "seal"]
