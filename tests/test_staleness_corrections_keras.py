"""The staleness corrections of staleness/corrections.py in Keras 3's DistributedOptimizer: 2 in-process
ranks at width 2 (eager) and 1 rank inside tf.function, against a plain Keras optimizer fed the
corrected gradients (written out here with TensorFlow ops, bitwise); the refusals."""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import pipesgd_hvd.keras as psgd  # noqa: E402
from pipesgd_hvd.ops.tensorflow import TensorFlowOps  # noqa: E402
from pipesgd_hvd.testing import LocalWorld  # noqa: E402
from threads import run_threads  # noqa: E402

STEPS, LAM = 6, 0.5


def make_model():
    """Named layers: the ranks are threads of one process, so Keras's name counter is shared."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh", name="hidden"),
                              keras.layers.Dense(3, name="out")], name="net")
    rng = np.random.default_rng(0)
    for v in model.trainable_variables:
        v.assign(rng.standard_normal(tuple(v.shape)).astype("float32") * 0.5)
    return model


def batches(steps, ranks):
    rng = np.random.default_rng(1)
    return [[(rng.standard_normal((8, 4)).astype("float32"), rng.standard_normal((8, 3)).astype("float32"))
             for _ in range(ranks)] for _ in range(steps)]


def gradients(model, batch):
    x, y = batch
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    return tape.gradient(loss, model.trainable_variables)


def inner():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def train(traced, ranks=2, width=2, calls=STEPS, make_inner=inner, **options):
    """Each rank's final weights (after flush()) and the batches, ``calls`` of them per rank
    (test_acco_keras.py and test_split_batch_keras.py train with this too)."""
    data = batches(calls, ranks)

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(make_inner(), communicator=comm, width=width, **options)
        opt.build(model.trainable_variables)

        def step(x, y):
            opt.apply_gradients(zip(gradients(model, (x, y)), model.trainable_variables))

        run = tf.function(step) if traced else step
        for t in range(calls):
            run(*data[t][rank])
        opt.flush()
        return [v.numpy() for v in model.trainable_variables]

    return run_threads(LocalWorld(ranks, TensorFlowOps()), rank_fn, timeout=120), data


def reference(data, rule, ranks=2, width=2, traced=False):
    """``rule(rank, avg, local_now, local_then, w_now, w_then, shared)`` -> the gradient applied
    for a stale average (``local_now`` None at flush); one model per rank (eager's replicas differ).
    ``traced``: the gradients come from a tf.function too, because a traced graph's forward and
    backward pass need not match eager bitwise (with oneDNN on, the graph fuses matmul, bias and
    activation, and on an AVX-512 CPU that moves the gradient by an ulp)."""
    grads_of = tf.function(gradients) if traced else gradients
    models = [make_model() for _ in range(ranks)]
    opts = [inner() for _ in range(ranks)]
    for m, o in zip(models, opts):
        o.build(m.trainable_variables)
    queue = []  # (avg, locals, weights per rank, whether that step applied), oldest first

    def apply(pending, local):
        avg, stale_local, w_then, shared = pending
        for r, (m, o) in enumerate(zip(models, opts)):
            fresh = local[r] if local is not None else [None] * len(avg)
            applied = [rule(r, a, f, s, v, wt, shared) for a, f, s, v, wt in
                       zip(avg, fresh, stale_local[r], m.trainable_variables, w_then[r])]
            o.apply_gradients(zip(applied, m.trainable_variables))

    for t in range(STEPS):
        local = [grads_of(m, data[t][r]) for r, m in enumerate(models)]
        weights = [[tf.identity(v) for v in m.trainable_variables] for m in models]
        avg = [(a + b) * 0.5 for a, b in zip(*local)] if ranks == 2 else list(local[0])
        applies = len(queue) == width - 1
        if applies:
            apply(queue.pop(0), local)
        queue.append((avg, local, weights, applies))
    for pending in queue:
        apply(pending, None)
    return [[v.numpy() for v in m.trainable_variables] for m in models]


def dc_rule(rank, g, fresh, stale, w, w_then, shared):
    return g + (g * g * (tf.identity(w) - w_then)) * LAM


def eager_rule(rank, g, fresh, stale, w, w_then, shared, ranks=2):
    fresh = tf.zeros_like(g) if fresh is None else fresh
    return g + (fresh - (stale if shared else tf.zeros_like(g))) * (1.0 / ranks)




RULES = {"delay_compensation": dc_rule, "eager": eager_rule}


# Two ranks run eagerly (the in-process transport cannot reduce across two threads' graphs); the
# traced step is checked on one rank (eager mixing at size 1 applies the fresh gradient itself),
# at width 2 and at width 3 (two slots: the traced slot choice).
@pytest.mark.parametrize("traced, ranks, width", [(False, 2, 2), (True, 1, 2), (True, 1, 3)],
                         ids=["eager-2-ranks", "tf.function-1-rank", "tf.function-width-3"])
@pytest.mark.parametrize("kind", sorted(RULES))
def test_keras_correction_matches_the_reference_rule(kind, traced, ranks, width):
    got, data = train(traced, ranks, width, staleness_correction=kind, dc_lambda=LAM)
    rule = RULES[kind] if kind != "eager" else (lambda *a: eager_rule(*a, ranks=ranks))
    want = reference(data, rule, ranks, width, traced)
    for rank in range(ranks):
        for g, w in zip(got[rank], want[rank]):
            np.testing.assert_array_equal(g, w)  # same ops in the same order: bitwise


def keras_adam_prediction_reference(make_inner, data, ranks):
    """Gradients computed at w - d, d Keras's own next Adam step with the moments now:
    m * lr * sqrt(1 - b2^t) / (1 - b1^t) / (sqrt(v) + eps) + lr * wd * w (w itself before any update)."""
    model = make_model()
    opt = make_inner()
    opt.build(model.trainable_variables)
    variables = model.trainable_variables
    pending, predicted = None, [tf.identity(v) for v in variables]
    for t in range(STEPS):
        real = [tf.identity(v) for v in variables]
        for v, p in zip(variables, predicted):
            v.assign(p)
        local = [gradients(model, data[t][r]) for r in range(ranks)]
        mean = [(a + b) * 0.5 for a, b in zip(*local)] if ranks == 2 else list(local[0])
        for v, r in zip(variables, real):
            v.assign(r)
        if pending is not None:
            opt.apply_gradients(zip(pending, variables))
        pending = mean
        n = float(opt.iterations.numpy())
        predicted = []
        for v in variables:
            if n < 1:
                predicted.append(tf.identity(v))
                continue
            i = opt._get_variable_index(v)
            m, vv = tf.convert_to_tensor(opt._momentums[i]), tf.convert_to_tensor(opt._velocities[i])
            lr = float(opt.learning_rate.numpy())
            alpha = lr * (1 - opt.beta_2 ** n) ** 0.5 / (1 - opt.beta_1 ** n)
            d = m * alpha / (tf.sqrt(vv) + opt.epsilon) + tf.identity(v) * (lr * float(opt.weight_decay or 0.0))
            predicted.append(tf.identity(v) - d)
    opt.apply_gradients(zip(pending, variables))
    return [v.numpy() for v in variables]


# A decaying learning rate: with a constant one, Adam's next step from its moments now is exactly
# its last update, and the prediction would equal weight prediction's. A large eps: its placement
# (Keras adds it to sqrt(v), not sqrt(v_hat)) then shows.
def decaying():
    return keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=1, decay_rate=0.8)


KERAS_ADAMS = {"adam": lambda: keras.optimizers.Adam(decaying(), epsilon=1e-2),
               "adamw": lambda: keras.optimizers.AdamW(decaying(), weight_decay=0.1, epsilon=1e-2)}


@pytest.mark.parametrize("traced, ranks", [(False, 2), (True, 1)], ids=["eager-2-ranks", "tf.function-1-rank"])
@pytest.mark.parametrize("name", sorted(KERAS_ADAMS))
def test_keras_adam_prediction_matches_keras_own_next_step(name, traced, ranks):
    data = batches(STEPS, ranks)

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(KERAS_ADAMS[name](), communicator=comm, width=2,
                                        staleness_correction="adam_prediction")
        opt.build(model.trainable_variables)

        def step(x, y):
            opt.apply_gradients(zip(gradients(model, (x, y)), model.trainable_variables))

        run = tf.function(step) if traced else step
        for t in range(STEPS):
            run(*data[t][rank])
        opt.flush()
        return [v.numpy() for v in model.trainable_variables]

    got = run_threads(LocalWorld(ranks, TensorFlowOps()), rank_fn, timeout=120)
    want = keras_adam_prediction_reference(KERAS_ADAMS[name], data, ranks)
    for weights in got:
        for g, w in zip(weights, want):
            # The core computes lr m_hat / (sqrt(v_hat) + eps / sqrt(1 - b2^t)), Keras's form
            # rearranged: equal in exact arithmetic, float32 rounding differs by a few ulps.
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_keras_refusals_name_the_fix():
    comm = LocalWorld(1, TensorFlowOps()).communicator(0)
    model = make_model()
    opt = psgd.DistributedOptimizer(inner(), communicator=comm, staleness_correction="adam_prediction")
    with pytest.raises(ValueError, match="wrapped optimizer is SGD: wrap keras.optimizers.Adam or AdamW"):
        opt.build(model.trainable_variables)
    with pytest.raises(ValueError, match="needs op=hvd.Average"):
        psgd.DistributedOptimizer(inner(), communicator=comm, staleness_correction="eager", op="sum")
    with pytest.raises(ValueError, match="dc_lambda must be a finite number >= 0"):
        psgd.DistributedOptimizer(inner(), communicator=comm, staleness_correction="delay_compensation",
                                  dc_lambda=float("nan"))


@pytest.mark.parametrize("kind", sorted(RULES))
def test_keras_checkpoint_entry_resumes_the_correction_exactly(kind):
    """pipeline_state_dict() holds the in-flight step's w_then copy / local share; resumed into a
    fresh optimizer it continues as the uninterrupted run does."""
    comm = LocalWorld(1, TensorFlowOps()).communicator(0)
    data = batches(STEPS, 1)

    def build():
        model = make_model()
        opt = psgd.DistributedOptimizer(inner(), communicator=comm, width=2, staleness_correction=kind, dc_lambda=LAM)
        opt.build(model.trainable_variables)
        return model, opt

    def run(model, opt, steps):
        for t in steps:
            opt.apply_gradients(zip(gradients(model, data[t][0]), model.trainable_variables))

    model, opt = build()
    run(model, opt, range(3))
    entry = opt.pipeline_state_dict()
    assert entry["corrections"]["kind"] == kind
    saved = [v.numpy() for v in model.variables + opt.variables]
    run(model, opt, range(3, STEPS))
    opt.flush()

    resumed_model, resumed = build()
    for v, value in zip(resumed_model.variables + resumed.variables, saved):
        v.assign(value)
    resumed.load_pipeline_state_dict(entry)
    run(resumed_model, resumed, range(3, STEPS))
    resumed.flush()
    for a, b in zip(resumed_model.trainable_variables, model.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
