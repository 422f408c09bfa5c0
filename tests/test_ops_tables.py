"""What every ops table (numpy, PyTorch, TensorFlow) must agree on beyond the codecs' kernels:
``assign_scaled``, the accurate mode's in-place ``state = x * s`` and ``state += x * s``, rounds as
those expressions do (bit for bit), so that the look-ahead and the reference rule agree."""
import numpy as np
import pytest
import torch

from pipesgd_hvd.ops.numpy import NUMPY_OPS
from pipesgd_hvd.ops.torch import TORCH_OPS

tf = pytest.importorskip("tensorflow")
from pipesgd_hvd.ops.tensorflow import TensorFlowOps  # noqa: E402

TABLES = {"numpy": (NUMPY_OPS, np.asarray), "torch": (TORCH_OPS, torch.from_numpy),
          "tensorflow": (TensorFlowOps(), tf.convert_to_tensor)}


@pytest.mark.parametrize("name", TABLES)
def test_assign_scaled_rounds_as_the_expression_and_keeps_the_holder(name):
    ops, tensor = TABLES[name]
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal(1001).astype(np.float32) for _ in range(2))
    state = ops.new_state(tensor(x.copy()))
    held = ops.assign_scaled(state, tensor(y), 0.3)
    assert held is state
    np.testing.assert_array_equal(ops.to_numpy(ops.read(state)), y * np.float32(0.3))
    ops.assign_scaled(state, tensor(x), 0.7, accumulate=True)
    np.testing.assert_array_equal(ops.to_numpy(ops.read(state)), y * np.float32(0.3) + x * np.float32(0.7))
