"""A custom loop (tf.GradientTape + apply_gradients), eager and in tf.function, and the proof in the
traced graph that the stale reduction does not wait for this step's forward/backward pass."""
import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import pipesgd_hvd.tensorflow as psgd
from keras_common import (BATCH, FEATURES, LOSS, assert_replicas_identical, make_model, passed, rank_data,
                          reference_weights, reference_weights_compressed)
from pipesgd_hvd.keras.traced_engine import STALE_SCOPE, SYNC_SCOPE

hvd.init()
STEPS = 15
x, y = rank_data(hvd.rank(), STEPS)


def sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def train(traced: bool, **kwargs):
    model = make_model()
    opt = psgd.DistributedOptimizer(sgd(), **kwargs)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    run = tf.function(step) if traced else step
    for t in range(STEPS):
        run(x[t * BATCH:(t + 1) * BATCH], y[t * BATCH:(t + 1) * BATCH])
    return model, opt, run


for traced in (False, True):
    for width, warmup in [(2, 0), (2, 2)]:
        label = f"{'tf.function' if traced else 'eager'}-width{width}-warmup{warmup}"
        model, opt, _ = train(traced, width=width, warmup_steps=warmup)
        assert_replicas_identical(model, label)
        want = reference_weights(sgd, STEPS, hvd.size(), width, warmup)
        for got, ref in zip(model.trainable_variables, want):
            np.testing.assert_allclose(got.numpy(), ref, rtol=2e-5, atol=2e-6, err_msg=label)
        passed(f"tf-loop-{label}")
    model, opt, _ = train(traced, compression="int8")
    assert_replicas_identical(model, f"int8-{traced}")
    want = reference_weights_compressed(sgd, STEPS, hvd.size(), "int8")
    # Eagerly the TensorFlow table computes what numpy does, value for value; traced, Grappler may
    # move a decoded value by an ulp (tests/test_tf_ops.py), and an ulp can tip a later rounding
    # to the next of 255 levels: a level of this model's gradients is ~1e-4 of the weights' scale.
    tolerance = dict(rtol=1e-6, atol=1e-7) if not traced else dict(rtol=1e-3, atol=1e-4)
    for got, ref in zip(model.trainable_variables, want):
        np.testing.assert_allclose(got.numpy(), ref, **tolerance, err_msg=f"int8 traced={traced}")
    passed(f"tf-loop-int8-{'tf.function' if traced else 'eager'}")


def waits_for(graph: tf.Graph, scope: str) -> set:
    conds = [op for op in graph.get_operations() if scope in op.name and op.type in ("If", "StatelessIf")]
    assert conds, f"no cond under {scope}: {[op.name for op in graph.get_operations() if op.type.endswith('If')]}"
    # Data and control inputs, transitively (automatic control dependencies are control inputs).
    seen, todo = set(), list(conds)
    while todo:
        op = todo.pop()
        for parent in [t.op for t in op.inputs] + list(op.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


# The traced step's graph: the stale reduction must not wait for anything computed from the batch.
_, _, traced_step = train(True, warmup_steps=2)
graph = traced_step.get_concrete_function(tf.TensorSpec((BATCH, FEATURES), tf.float32),
                                          tf.TensorSpec((BATCH,), tf.int32)).graph
batch = {op for op in graph.get_operations() if op.type == "Placeholder" and op.outputs[0].dtype != tf.resource}
stale_waits = waits_for(graph, STALE_SCOPE)
assert not stale_waits & batch, sorted(op.name for op in stale_waits & batch)
assert not any(op.type in ("MatMul", "BiasAddGrad") for op in stale_waits), \
    sorted(op.name for op in stale_waits if op.type in ("MatMul", "BiasAddGrad"))
# The check can fail: the warm-up (synchronous) reduction does wait for the batch.
assert waits_for(graph, SYNC_SCOPE) & batch
passed("tf-graph-stale-reduction-independent-of-the-step")
