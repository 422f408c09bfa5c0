"""A Horovod Keras training script, written the way Horovod's Keras documentation shows.

The test (tests/test_drop_in.py) swaps only the import line below for pipesgd_hvd's.
"""
import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

# Initialize Horovod
hvd.init()

digits = load_digits()
x = (digits.data / 16.0).astype("float32")
y = digits.target.astype("int64")
x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
x_train, y_train = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).repeat().shuffle(1000, seed=hvd.rank()).batch(32)

model = tf.keras.Sequential([
    tf.keras.Input((64,)),
    tf.keras.layers.Dense(128, activation="relu"),
    tf.keras.layers.Dense(10),
])

# Horovod: adjust learning rate based on number of workers.
scaled_lr = 0.001 * hvd.size()
opt = tf.keras.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.none)

model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=opt, metrics=["accuracy"])

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),
    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
    # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
    # the first three epochs.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
]

# Horovod: write logs on worker 0.
verbose = 1 if hvd.rank() == 0 else 0

# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
model.fit(dataset, steps_per_epoch=1400 // 32 // hvd.size(), callbacks=callbacks, epochs=20, verbose=verbose)

loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
accuracy = float(hvd.allreduce(np.float32(accuracy), name="test_accuracy"))
weights = hvd.allgather(tf.reshape(tf.concat([tf.reshape(w, [-1]) for w in model.trainable_weights], 0), [1, -1]))
same = bool(np.array_equal(weights[0].numpy(), weights[-1].numpy()))
print(f"RESULT rank={hvd.rank()} test_accuracy={accuracy:.4f} replicas_equal={same}", flush=True)
