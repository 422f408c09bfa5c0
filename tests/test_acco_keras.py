"""staleness_correction="acco" (ACCO) in Keras 3's DistributedOptimizer: 2 in-process ranks
(eager) and 1 rank inside tf.function, at widths 1 and 2, against a plain Keras reference of the
rule written here with TensorFlow ops (bitwise)."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import pipesgd_hvd.keras as psgd  # noqa: E402
from pipesgd_hvd.testing import LocalWorld  # noqa: E402
from pipesgd_hvd.ops.tensorflow import TensorFlowOps  # noqa: E402
from test_staleness_corrections_keras import batches, gradients, make_model  # noqa: E402
from test_staleness_corrections_keras import train as train_with  # noqa: E402

CALLS = 7  # odd: the run ends after a virtual step, so flush() applies a real one


def inner():
    return keras.optimizers.AdamW(0.05, beta_1=0.9, beta_2=0.95, weight_decay=0.1)


def train(traced, ranks=2, width=2, calls=CALLS, **options):
    """Each rank's final weights (after flush()) and the batches."""
    return train_with(traced, ranks, width, calls=calls, make_inner=inner, staleness_correction="acco", **options)


def reference(data, ranks=2, calls=CALLS, traced=False, width=2):
    """The rule written out on a plain Keras optimizer: each call's average is applied by the next
    call, alternately by a virtual step from theta_t (every optimizer variable copied and put
    back) and by the real step from theta_t with (avg A + avg B) * 0.5. ``traced``: gradients
    from a tf.function too (a traced graph's forward and backward pass need not match eager's
    bitwise, see test_staleness_corrections_keras.py)."""
    grads_of = tf.function(gradients) if traced else gradients
    model, opt = make_model(), inner()
    variables = model.trainable_variables
    opt.build(variables)
    real, first, pending = None, None, None

    def update(grads):
        opt.apply_gradients(zip(grads, variables))

    update_now = tf.function(update) if traced else update  # Keras's update traced as in the step

    def apply(avg):
        nonlocal real, first
        if width == 1:
            update_now(avg)
        elif real is None:
            real, first = [tf.identity(v) for v in variables], avg
            saved = [tf.identity(v) for v in opt.variables]
            update_now(avg)
            for v, s in zip(opt.variables, saved):
                v.assign(s)
        else:
            for v, w in zip(variables, real):
                v.assign(w)
            update_now([(a + b) * 0.5 for a, b in zip(first, avg)])
            real = None

    for t in range(calls):
        local = [grads_of(model, data[t][r]) for r in range(ranks)]
        avg = [(a + b) * 0.5 for a, b in zip(*local)] if ranks == 2 else list(local[0])
        if width == 1:
            apply(avg)
            continue
        if pending is not None:
            apply(pending)
        pending = avg
    if pending is not None:  # flush() runs eagerly
        if real is None:
            update(pending)
        else:
            update_now = update
            apply(pending)
    return [v.numpy() for v in variables]


def assert_same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("calls", [CALLS, CALLS + 1], ids=["ends-after-virtual", "ends-after-real"])
def test_acco_matches_the_reference_eagerly_on_two_ranks(calls):
    got, data = train(traced=False, calls=calls)
    want = reference(data, calls=calls)
    for weights in got:
        assert_same(weights, want)


def test_acco_matches_the_reference_inside_tf_function():
    got, data = train(traced=True, ranks=1)
    assert_same(got[0], reference(data, ranks=1, traced=True))


def test_acco_at_width_1_is_the_synchronous_update():
    got, data = train(traced=True, ranks=1, width=1)
    assert_same(got[0], reference(data, ranks=1, traced=True, width=1))


def test_acco_changes_the_update():
    got, data = train(traced=False, ranks=1)
    plain = reference(data, ranks=1, width=1)
    assert not all(np.array_equal(a, b) for a, b in zip(got[0], plain)), "acco changed nothing"


def test_acco_checkpoint_holds_its_state():
    data = batches(4, 1)
    model = make_model()
    opt = psgd.DistributedOptimizer(inner(), communicator=LocalWorld(1, TensorFlowOps()).communicator(0),
                                    staleness_correction="acco")
    opt.build(model.trainable_variables)
    for t in range(4):  # ends with a virtual step: the look-ahead in the model, avg B in flight
        opt.apply_gradients(zip(gradients(model, data[t][0]), model.trainable_variables))
    entry = opt.pipeline_state_dict()
    assert entry["corrections"]["kind"] == "acco" and entry["corrections"]["active"]
    assert len(entry["in_flight"]) == 1
