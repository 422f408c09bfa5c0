"""The TensorFlow table: the same codecs give the same bytes as numpy, eagerly and traced."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from pipesgd_hvd.compression import resolve_compression  # noqa: E402
from pipesgd_hvd.compression.allreduce import compressed_allreduce  # noqa: E402
from pipesgd_hvd.ops.numpy import NUMPY_OPS  # noqa: E402
from pipesgd_hvd.ops.seeds import Seed  # noqa: E402
from pipesgd_hvd.ops.tensorflow import TensorFlowOps  # noqa: E402
from pipesgd_hvd.testing import LocalWorld  # noqa: E402
from threads import run_threads  # noqa: E402
from test_codecs import CODECS, INPUTS, roundtrip  # noqa: E402

NEAREST = [n for n in CODECS if not n.endswith("stochastic")]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf.function"])
# (no denormal input: TensorFlow's CPU kernels flush denormals to zero, numpy keeps them)
@pytest.mark.parametrize("data", ["heavy-tailed", "huge", "tiny", "zeros"])
@pytest.mark.parametrize("name", NEAREST)
def test_tensorflow_table_encodes_the_numpy_bytes(name, data, traced):
    x = INPUTS[data]
    ops = TensorFlowOps()
    p_np, y_np = roundtrip(CODECS[name], x, NUMPY_OPS)
    run = (lambda t: roundtrip(CODECS[name], tf.reshape(t, (-1,)), ops))
    if traced:
        run = tf.function(run)
    p_tf, y_tf = run(tf.constant(x))
    assert np.array_equal(p_np, p_tf.numpy()), "the bytes on the wire are the same"
    if traced:
        # Grappler rewrites ``q / L * scale`` (e.g. into a multiplication by 1/L): decoded values
        # may move by an ulp. Every rank runs the same graph, so replicas still agree bitwise.
        np.testing.assert_array_max_ulp(y_np, y_tf.numpy(), maxulp=2)
    else:
        assert np.array_equal(y_np, y_tf.numpy(), equal_nan=True)


def test_stochastic_rounding_draws_change_with_the_step_variable_inside_one_trace():
    ops = TensorFlowOps()
    step = tf.Variable(0, dtype=tf.int64)
    codec = resolve_compression(CODECS["int8-stochastic"])
    x = tf.constant(np.linspace(-1, 1, 512, dtype=np.float32))
    encode = tf.function(lambda: codec.encode(ops, tf.reshape(x, (1, -1)), key="k",
                                              seed=Seed(5, step.read_value()))[0])
    first = encode().numpy()
    assert np.array_equal(first, encode().numpy()), "same step, same draws"
    step.assign_add(1)
    assert not np.array_equal(first, encode().numpy()), "a new step draws anew"


def test_error_feedback_residual_is_a_variable_made_on_first_trace():
    ops = TensorFlowOps()
    codec = resolve_compression("int8")
    step = tf.function(lambda g: codec.encode(ops, g, key="b0", seed=0)[0])
    g = tf.constant(np.random.default_rng(1).standard_normal((1, 1024)).astype(np.float32))
    step(g)
    residual = codec.residual("b0")
    assert isinstance(residual, tf.Variable)
    # Eager reference: the same two steps through numpy give the same residual.
    ref = resolve_compression("int8")
    for _ in range(2):
        ref.encode(NUMPY_OPS, g.numpy(), key="b0", seed=0)
    after_one = residual.numpy().copy()
    step(g)
    assert not np.array_equal(after_one, residual.numpy()), "the second call updated the variable"
    # (decode may differ by an ulp between graph and numpy, see above)
    np.testing.assert_allclose(residual.numpy(), ref.residual("b0"), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["int8", "truncate16", "bf16"])
def test_compressed_allreduce_through_the_tensorflow_table(name):
    size, n = 3, 1001
    inputs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(size)]
    tf_ops = TensorFlowOps()
    world_np, world_tf = LocalWorld(size, NUMPY_OPS), LocalWorld(size, tf_ops)
    codecs_np = [resolve_compression(name) for _ in range(size)]
    codecs_tf = [resolve_compression(name) for _ in range(size)]
    out_np = run_threads(world_np, lambda rank, comm: compressed_allreduce(
        NUMPY_OPS, comm, codecs_np[rank], inputs[rank].copy(), name="t", key="b0", seed=rank)[0])
    out_tf = run_threads(world_tf, lambda rank, comm: compressed_allreduce(
        tf_ops, comm, codecs_tf[rank], tf.constant(inputs[rank]), name="t", key="b0", seed=rank)[0].numpy())
    for a, b in zip(out_np, out_tf):
        np.testing.assert_array_equal(a, b)
