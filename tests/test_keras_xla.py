"""Keras: a train step that would be XLA-compiled is refused when fit() builds the optimizer, with
the fix in the message (Horovod's ops and tf.py_function have no XLA kernels; fit would fail deep
inside XLA's compiler otherwise)."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import pipesgd_hvd.keras as psgd  # noqa: E402
from pipesgd_hvd.ops.tensorflow import TensorFlowOps  # noqa: E402
from pipesgd_hvd.testing import LocalWorld  # noqa: E402


def _fit(jit_compile):
    comm = LocalWorld(1, TensorFlowOps()).communicator(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=psgd.DistributedOptimizer(keras.optimizers.SGD(0.1), communicator=comm,
                                                          compression="int8"), loss="mse",
                  jit_compile=jit_compile)
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 3), "float32")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    return model


@pytest.mark.parametrize("gpu_visible,jit_compile", [(False, True), (True, "auto")])
def test_xla_compiled_train_step_is_refused_with_the_fix(monkeypatch, gpu_visible, jit_compile):
    if gpu_visible:  # what Keras sees on a GPU machine: "auto" resolves to XLA
        devices = tf.config.list_physical_devices
        gpu = type("Device", (), {"device_type": "GPU", "name": "/physical_device:GPU:0"})()
        monkeypatch.setattr(tf.config, "list_physical_devices",
                            lambda kind=None: devices(kind) + ([gpu] if kind in (None, "GPU") else []))
    with pytest.raises(ValueError, match=r"jit_compile=False"):
        _fit(jit_compile)


def test_without_xla_fit_runs():
    assert _fit(False).jit_compile is False
