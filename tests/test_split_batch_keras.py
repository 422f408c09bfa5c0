"""staleness_correction="split_batch" (one all-reduce per update, each rank's look-ahead from its
own gradient) in Keras 3's DistributedOptimizer: 2 in-process ranks (eager) and 1 rank inside
tf.function, at widths 1 and 2, against a plain Keras reference of the rule written here with
TensorFlow ops (bitwise); model.fit with the optimizer built by Keras itself; the checkpoint entry."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import pipesgd_hvd.keras as psgd  # noqa: E402
from pipesgd_hvd.ops.tensorflow import TensorFlowOps  # noqa: E402
from pipesgd_hvd.testing import LocalWorld  # noqa: E402
from test_staleness_corrections_keras import batches, gradients, make_model  # noqa: E402
from test_staleness_corrections_keras import train as train_with  # noqa: E402

CALLS = 9  # odd: the run ends after a call A (its part kept): flush() reduces it on its own


def inner():
    return keras.optimizers.AdamW(0.05, beta_1=0.9, beta_2=0.95, weight_decay=0.1)


def train(traced, ranks=2, width=2, calls=CALLS, **options):
    """Each rank's final weights (after flush()) and the batches."""
    return train_with(traced, ranks, width, calls=calls, make_inner=inner, staleness_correction="split_batch", **options)


def reference(data, ranks=2, calls=CALLS, traced=False, width=2):
    """The rule written out on a plain Keras optimizer: theta and the optimizer's state are the
    real ones; calls pair up: A keeps (1 - f) g_A at the rank's look-ahead and applies the update
    in flight from theta; B adds f g_B at theta, averages over the ranks (in flight) and steps each
    rank from theta to its look-ahead with its own sum, the optimizer's variables put back. At
    width 1 B applies the average. ``traced``: gradients and updates from a tf.function (a traced
    graph need not match eager bitwise, see test_staleness_corrections_keras.py)."""
    grads_of = tf.function(gradients) if traced else gradients
    model, opt = make_model(), inner()
    variables = model.trainable_variables
    opt.build(variables)
    theta = [tf.identity(v) for v in variables]
    points, kept, in_flight = None, None, None

    def update(grads):
        opt.apply_gradients(zip(grads, variables))

    update_now = tf.function(update) if traced else update

    def step_from(weights, grads, virtual=False):
        for v, w in zip(variables, weights):
            v.assign(w)
        saved = [tf.identity(v) for v in opt.variables] if virtual else None
        update_now(grads)
        if virtual:
            for v, s in zip(opt.variables, saved):
                v.assign(s)
        return [tf.identity(v) for v in variables]

    def grads_at(weights, batch):
        for v, w in zip(variables, weights):
            v.assign(w)
        return grads_of(model, batch)

    def average(per_rank):
        return [(a + b) * 0.5 for a, b in zip(*per_rank)] if ranks == 2 else list(per_rank[0])

    for c in range(calls):
        if c % 2 == 0:
            kept = [[g * 0.5 for g in grads_at(points[r] if points else theta, data[c][r])] for r in range(ranks)]
            if in_flight is not None:
                theta = step_from(theta, in_flight)
            points, in_flight = None, None
        else:
            local = [[a + g * 0.5 for a, g in zip(kept[r], grads_at(theta, data[c][r]))] for r in range(ranks)]
            kept = None
            if width == 1:
                theta = step_from(theta, average(local))
                continue
            in_flight = average(local)
            points = [step_from(theta, local[r], virtual=True) for r in range(ranks)]
    update_now = update  # flush() runs eagerly
    if in_flight is not None:
        theta = step_from(theta, in_flight)
    elif kept is not None:
        theta = step_from(theta, average([[g * 2.0 for g in k] for k in kept]))
    return [w.numpy() for w in theta]


def assert_same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("calls", [CALLS, CALLS + 1], ids=["ends-after-a", "ends-after-b"])
def test_split_batch_matches_the_reference_eagerly_on_two_ranks(calls):
    got, data = train(traced=False, calls=calls)
    want = reference(data, calls=calls)
    for weights in got:
        assert_same(weights, want)


@pytest.mark.parametrize("calls", [CALLS, CALLS + 1], ids=["ends-after-a", "ends-after-b"])
def test_split_batch_matches_the_reference_inside_tf_function(calls):
    got, data = train(traced=True, ranks=1, calls=calls)
    assert_same(got[0], reference(data, ranks=1, calls=calls, traced=True))


def test_split_batch_at_width_1_makes_each_pair_one_synchronous_update():
    got, data = train(traced=True, ranks=1, width=1, calls=CALLS + 1)
    assert_same(got[0], reference(data, ranks=1, calls=CALLS + 1, traced=True, width=1))


def test_model_fit_builds_the_optimizer_itself_and_trains():
    """model.fit with the optimizer not built by hand (Keras builds it in a symbolic pass: the
    optimizer's snapshot once took that pass's placeholder shapes and failed at the first update);
    AdamW and SGD with momentum; the flush callback applies the kept part or the update in flight."""
    x = np.random.default_rng(0).normal(size=(96, 6)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    for make in (lambda: keras.optimizers.AdamW(3e-3), lambda: keras.optimizers.SGD(0.05, momentum=0.9)):
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
        opt = psgd.DistributedOptimizer(make(), communicator=LocalWorld(1, TensorFlowOps()).communicator(0),
                                        staleness_correction="split_batch")
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        before = model.evaluate(x, y, verbose=0)
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[psgd.callbacks.PipelineFlushCallback()])
        assert model.evaluate(x, y, verbose=0) < before
        assert not opt.core.correction.holds_other_weights(), "the flush callback left the real weights in place"


def test_checkpoint_entry_holds_the_pair():
    data = batches(4, 1)
    model = make_model()
    opt = psgd.DistributedOptimizer(inner(), communicator=LocalWorld(1, TensorFlowOps()).communicator(0),
                                    staleness_correction="split_batch")
    opt.build(model.trainable_variables)
    for t in range(3):  # A, B (the look-ahead in the model, update 0 in flight), A (update 0 applied, part kept)
        opt.apply_gradients(zip(gradients(model, data[t][0]), model.trainable_variables))
    entry = opt.pipeline_state_dict()
    saved = entry["corrections"]
    assert saved["kind"] == "split_batch" and saved["second"] and not saved["ahead"]
    assert entry["in_flight"] == [] and entry["step"] == 1
    opt.flush()
