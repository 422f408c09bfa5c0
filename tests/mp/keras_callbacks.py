"""Horovod's Keras callbacks on Keras 3 through pipesgd_hvd.keras, and load_model."""
import os
import tempfile

import keras

import pipesgd_hvd.keras as hvd
from keras_common import BATCH, LOSS, assert_replicas_identical, digest, passed, rank_data

hvd.init()
STEPS = 8
x, y = rank_data(hvd.rank(), STEPS)


def unseeded_model():
    keras.utils.set_random_seed(1000 + hvd.rank())  # deliberately different weights per rank
    return keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])


# Broadcast: ranks start different and end identical (the run would diverge without it).
model = unseeded_model()
digests = hvd.allgather_object(digest([v.numpy() for v in model.variables]), name="before")
assert len(set(digests)) == 2, "the ranks must start from different weights for this check"
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))
model.compile(optimizer=opt, loss=LOSS, metrics=["accuracy"])
history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.05, warmup_epochs=2, verbose=0),
    hvd.callbacks.PipelineFlushCallback(),
])
assert_replicas_identical(model, "broadcast")
passed("keras-broadcast-callback")

# MetricAverage: every rank logged the same (averaged) loss, which differs from its own.
losses = hvd.allgather_object(history.history["loss"], name="losses")
assert losses[0] == losses[1], losses
passed("keras-metric-average-callback")

# Warm-up: per batch, lr = 0.05/size * (e * (size-1)/2 + 1) with e = epoch + (batch+1)/STEPS;
# the logged rate is the last batch's (e = epoch + 1). Epoch 2 is past warm-up.
lrs = history.history["learning_rate"]
size = hvd.size()
for epoch, lr in enumerate(lrs[:2]):
    expected = 0.05 / size * ((epoch + 1) * (size - 1) / 2 + 1)
    assert abs(lr - expected) < 1e-6, (epoch, lr, expected)
assert abs(lrs[2] - lrs[1]) < 1e-6, lrs  # unchanged after warm-up
passed("keras-lr-warmup-callback")

# PipelineFlushCallback applied the last gradient: iterations = steps run (fit's 3 epochs).
assert int(opt.iterations.numpy()) == 3 * STEPS, int(opt.iterations.numpy())
passed("keras-flush-callback")

# load_model wraps the loaded optimizer and keeps its state.
path = os.path.join(tempfile.gettempdir(), f"psgd_cb_{os.getpid()}.keras")
model.save(path)
loaded = hvd.load_model(path, compression=hvd.Compression.int8)
assert type(loaded.optimizer).__mro__[1].__name__ == "_PipelinedOptimizer"
assert int(loaded.optimizer.iterations.numpy()) == 3 * STEPS
loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
assert_replicas_identical(loaded, "loaded")
os.remove(path)
passed("keras-load-model")

# BestModelCheckpoint saves on rank 0 only.
best = os.path.join(tempfile.gettempdir(), f"psgd_best_{hvd.rank()}_{os.getpid()}.keras")
model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, validation_data=(x, y),
          callbacks=[hvd.callbacks.MetricAverageCallback(),
                     hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=best)])
assert os.path.exists(best) == (hvd.rank() == 0), (hvd.rank(), os.path.exists(best))
if os.path.exists(best):
    os.remove(best)
passed("keras-best-model-checkpoint")
