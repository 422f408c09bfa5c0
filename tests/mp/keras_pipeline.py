"""model.fit with pipesgd_hvd's Keras optimizer: the update rule, replicas, codecs, saving."""
import os
import subprocess
import sys
import tempfile

import horovod.tensorflow as hvd
import keras
import numpy as np

import pipesgd_hvd.keras as psgd
from keras_common import BATCH, LOSS, assert_replicas_identical, make_model, passed, rank_data, reference_weights

hvd.init()
STEPS = 12
x, y = rank_data(hvd.rank(), STEPS)


def sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def adam():
    return keras.optimizers.Adam(0.01)


def fit(make_optimizer, **kwargs):
    model = make_model()
    opt = psgd.DistributedOptimizer(make_optimizer(), **kwargs)
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model, opt


# 1. The update rule, against the same rule computed in one process (to float32 round-off: the
#    traced step and the eager reference fuse ops differently), and bitwise-equal replicas.
for make_optimizer, width, warmup in [(sgd, 1, 0), (sgd, 2, 0), (adam, 2, 0), (sgd, 2, 3), (sgd, 3, 0)]:
    label = f"{make_optimizer.__name__}-width{width}-warmup{warmup}"
    model, opt = fit(make_optimizer, width=width, warmup_steps=warmup)
    assert_replicas_identical(model, label)
    want = reference_weights(make_optimizer, STEPS, hvd.size(), width, warmup)
    for got, ref in zip(model.trainable_variables, want):
        np.testing.assert_allclose(got.numpy(), ref, rtol=2e-5, atol=2e-6, err_msg=label)
    applied = STEPS - max(0, width - 1) if warmup < STEPS else STEPS
    assert int(opt.iterations.numpy()) == applied, (label, int(opt.iterations.numpy()), applied)
    passed(f"keras-rule-{label}")

# Staleness correction (weight prediction): the same rule with gradients at predicted weights.
# Between steps the model holds the prediction; the real weights are kept by the optimizer.
model, opt = fit(sgd, width=2, staleness_correction=True)
assert_replicas_identical(model, "prediction")
real = [v.numpy() for v in opt.core.correction.current]
want = reference_weights(sgd, STEPS, hvd.size(), 2, predict=True)
for got, ref in zip(real, want):
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6, err_msg="weight prediction")
plain = reference_weights(sgd, STEPS, hvd.size(), 2)
assert not all(np.allclose(a, b, rtol=2e-5, atol=2e-6) for a, b in zip(want, plain)), "prediction changes the run"
predicted = [v.numpy() for v in model.trainable_variables]
assert not all(np.array_equal(a, b) for a, b in zip(predicted, real)), "the model holds the prediction"
opt.flush()  # restores the real weights, then applies the last in-flight gradient
assert not opt.core.correction.started.is_set()
assert_replicas_identical(model, "prediction-flushed")
passed("keras-rule-weight-prediction")

# 2. Codecs: replicas stay bitwise equal, the loss goes down, the wire carries what it should.
for name, ratio in [("fp16", 0.5), ("bf16", 0.5), ("truncate16", 0.5), ("int8", 0.26), ("int4", 0.14)]:
    model, opt = fit(sgd, compression=name)
    assert_replicas_identical(model, name)
    first = float(LOSS(y[:BATCH], make_model()(x[:BATCH])))
    last = float(LOSS(y, model(x)))
    assert last < first, (name, first, last)
    assert abs(opt.stats.ratio - ratio) < 0.02, (name, opt.stats)
    passed(f"keras-codec-{name}")

# 3. flush() applies the last in-flight gradient on every rank; a saved model loads without us.
model, opt = fit(sgd, compression="int8")
before = int(opt.iterations.numpy())
assert opt.flush() == 1 and int(opt.iterations.numpy()) == before + 1
assert_replicas_identical(model, "flushed")
path = os.path.join(tempfile.gettempdir(), f"psgd_keras_{os.getpid()}.keras")
model.save(path)
check = ("import sys; sys.modules['pipesgd_hvd'] = None\n"  # any import of pipesgd_hvd would fail
         "import keras, numpy as np\n"
         f"m = keras.models.load_model({path!r})\n"
         "print(type(m.optimizer).__module__, type(m.optimizer).__name__, m.optimizer.iterations.numpy())\n")
out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
assert out.returncode == 0, out.stderr[-2000:]
assert "keras.src.optimizers.sgd SGD" in out.stdout and str(before + 1) in out.stdout, out.stdout
os.remove(path)
passed("keras-save-load-without-pipesgd")
