"""The typed encoding every object collective uses between processes (pipesgd_hvd/comm/wire.py),
and the per-job secret's MACs: what crosses comes back equal, anything else is refused with
words, and no bytes, however made, run code when decoded (issue 32: no pickle on network data)."""
import math
import os
import pathlib
import pickle
import random
import re
from collections import OrderedDict

import numpy as np
import pytest
import torch

from pipesgd_hvd.comm import wire

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pipesgd_hvd"


def same(a, b):
    """Equal in value, type and dtype (nan equal to nan)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            a.contiguous().numpy(force=True).tobytes() == b.numpy(force=True).tobytes() if a.dtype != torch.bfloat16 else \
            torch.equal(a.view(torch.int16), b.view(torch.int16))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return isinstance(b, np.generic) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(b) is type(a) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_what_the_pipeline_gathers_comes_back_equal():
    # the kinds of things allgather_object carries: counts, settings, checksums, measurements, and
    # checkpoint-like states (a torch optimizer's state_dict has int keys and tuples)
    opt = torch.optim.Adam([torch.nn.Parameter(torch.ones(3, 2))], lr=0.1)
    opt.zero_grad()
    opt.param_groups[0]["params"][0].grad = torch.ones(3, 2)
    opt.step()
    state = {
        "counts": [0, 1, -7, 2 ** 80], "floats": [0.0, -0.0, 1e-320, 3.5, float("inf"), -float("inf")],
        "none": None, "flags": (True, False), "text": "ünïcode \n", "raw": b"\x00\xff" * 3,
        "settings": [("width", 2), ("compression", "int8+ef"), ("op", "average")],
        "tensors": [("0.weight", (16, 6), "float32")],
        "checksums": (5, [b"\x01" * 8, b"\x02" * 8], False),
        "in_flight": [{"step": 3, "meta": torch.tensor(65536.0), "grads": {"w": torch.randn(4, 5)}}],
        "optimizer": opt.state_dict(),
        OrderedDict(a=1)["a"]: "int key", (1, "t"): "tuple key",
        "numpy": [np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((0, 4), np.int64), np.float64(2.5),
                  np.int32(-3), np.bool_(True), np.array(7, np.uint8), np.arange(4, dtype=">f8")],
        "torch": [torch.arange(5, dtype=torch.bfloat16), torch.tensor([True, False]), torch.zeros(0),
                  torch.arange(12.0).reshape(3, 4).t(), torch.tensor(3, dtype=torch.int64), torch.ones(2, dtype=torch.float16)],
        "size": torch.Size([2, 3]),
    }
    back = wire.decode(wire.encode(state))
    expected = dict(state, size=(2, 3), numpy=state["numpy"][:-1] + [np.arange(4, dtype="<f8")])
    assert same(back, expected), back
    assert math.isnan(wire.decode(wire.encode(float("nan"))))
    assert back["optimizer"]["state"][0]["exp_avg"].dtype == torch.float32  # int keys kept
    assert back["torch"][3].is_contiguous()  # a transposed tensor comes back a plain contiguous CPU tensor


@pytest.mark.parametrize("bad, where", [
    (object(), ""), ({"a": [1, {2, 3}]}, r"\['a'\]\[1\]"), ([lambda: 0], r"\[0\]"),
    ({"x": np.array([object()], dtype=object)}, r"\['x'\]"), ({"s": torch.eye(3).to_sparse()}, r"\['s'\]"),
])
def test_anything_else_is_refused_with_where_it_sits_and_what_to_do(bad, where):
    with pytest.raises(TypeError, match=rf"cannot send a .* between ranks{' at ' + where if where else ''}.*instead of pickle.*"
                                        r"convert it"):
        wire.encode(bad)


def test_nesting_is_bounded_both_ways():
    deep = []
    for _ in range(wire.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(TypeError, match="nested more than"):
        wire.encode(deep)
    forged = wire.MAGIC + b"".join([len(b'{"root":' + b"[" * 5000 + b"]" * 5000 + b',"buffers":[]}').to_bytes(4, "little"),
                                    b'{"root":' + b"[" * 5000 + b"]" * 5000 + b',"buffers":[]}'])
    with pytest.raises(wire.WireError):
        wire.decode(forged)


class _Boom:
    """What an attacker sends to a pickle reader: unpickling it would create a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_hostile_bytes_are_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    payloads = [pickle.dumps(_Boom(str(marker))), b"", b"PSGDw1\n", wire.MAGIC + b"\xff\xff\xff\xff{}"]
    good = wire.encode({"a": np.arange(10.0), "b": [1, 2]})
    payloads += [good[:-3], good + b"x", good.replace(b'"float64"', b'"object"'),
                 good.replace(b'"ndarray":0', b'"ndarray":7'), good.replace(b'"shape":[10]', b'"shape":[11]'),
                 wire.MAGIC + (18).to_bytes(4, "little") + b'{"root":{"x":1}}xx']
    rng = random.Random(0)
    for _ in range(300):  # fuzz: flip, cut and splice bytes of a valid encoding
        b = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        payloads.append(bytes(b[:rng.randint(0, len(b))]) if rng.random() < 0.3 else bytes(b))
    for data in payloads:
        try:
            wire.decode(data)
        except wire.WireError:
            pass
    assert not marker.exists()
    for data in payloads[:4] + payloads[5:10]:
        with pytest.raises(wire.WireError):
            wire.decode(data)


def test_a_frame_without_the_jobs_secret_is_refused():
    secret, other = os.urandom(32), os.urandom(32)
    frame = wire.seal(secret, b"ctx/0", b"payload")
    assert wire.open_sealed(secret, b"ctx/0", frame, "rank 0") == b"payload"
    for key, context, data in [(other, b"ctx/0", frame), (secret, b"ctx/1", frame),
                               (secret, b"ctx/0", frame[:-1] + b"X"), (secret, b"ctx/0", b"short")]:
        with pytest.raises(wire.WireError, match=r"from rank 0 do not carry this job's secret.*Who can talk to a job"):
            wire.open_sealed(key, context, data, "rank 0")
    # length-prefixed parts: moving bytes between parts changes the MAC
    assert wire.mac(secret, b"ab", b"c") != wire.mac(secret, b"a", b"bc")


def test_no_pickle_reads_network_data_anywhere_in_the_package():
    """No module unpickles (pickle, cloudpickle, torch.load, numpy's allow_pickle) and none calls
    the framework object collectives that do (Horovod's allgather_object/broadcast_object,
    torch.distributed's *_object, mpi4py's lowercase allgather/bcast)."""
    banned = re.compile(r"pickle\.loads?\(|cloudpickle|torch\.load\(|allow_pickle=True|hvd\.(allgather|broadcast)_object\("
                        r"|dist\.(all_gather|broadcast|gather|scatter)_object|\.(allgather|bcast|gather|recv)\(\s*[a-z_]+\s*\)"
                        r"|import pickle")
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}" for path in PACKAGE.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if banned.search(line) and not line.strip().startswith("#")]
    assert not found, found


def test_eager_tensorflow_values_cross_as_numpy():
    """Keras's elastic sync sends its optimizer's variables and codec state (tf.Variable)."""
    tf = pytest.importorskip("tensorflow")
    state = {"residual": tf.Variable(tf.ones((2, 3))), "step": tf.constant(7, tf.int64),
             "bf16": tf.constant([1.5, -2.0], tf.bfloat16)}
    back = wire.decode(wire.encode(state))
    assert back["residual"].dtype == np.float32 and np.array_equal(back["residual"], np.ones((2, 3)))
    assert back["step"] == 7 and back["step"].dtype == np.int64
    assert back["bf16"].dtype.name == "bfloat16" and back["bf16"].astype(np.float32).tolist() == [1.5, -2.0]
