"""Helpers for the Keras rank scripts (run under horovodrun): data, a small model, the reference rule."""
from __future__ import annotations

import hashlib
from typing import Any, List, Sequence

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

FEATURES, CLASSES, BATCH = 12, 3, 16


def rank_data(rank: int, steps: int) -> tuple:
    """``steps`` batches for ``rank`` (a different slice on every rank, the same on every run)."""
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal((steps * BATCH, FEATURES)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32")
    return x, y


def make_model() -> keras.Model:
    keras.utils.set_random_seed(7)  # the same initial weights on every rank
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def reference_weights(make_optimizer, steps: int, size: int, width: int, warmup: int = 0,
                      predict: bool = False) -> List[np.ndarray]:
    """The update rule computed in one process: step t applies mean over ranks of the gradient of
    step t-width+1 (t-0 while t < warmup), nothing while the pipeline fills. ``predict``: each
    gradient is computed at w_t + (w_t - w_{t-1}) (weight prediction; w_{-1} = w_0)."""
    model, opt = make_model(), make_optimizer()
    data = [rank_data(r, steps) for r in range(size)]
    pending: List[List[tf.Tensor]] = []
    real = [v.numpy() for v in model.trainable_variables]
    previous = None
    for t in range(steps):
        if predict:
            at = real if previous is None else [2.0 * r - p for r, p in zip(real, previous)]
            for v, value in zip(model.trainable_variables, at):
                v.assign(value)
        per_rank = []
        for x, y in data:
            with tf.GradientTape() as tape:
                loss = LOSS(y[t * BATCH:(t + 1) * BATCH], model(x[t * BATCH:(t + 1) * BATCH]))
            per_rank.append(tape.gradient(loss, model.trainable_variables))
        mean = [tf.add_n(list(gs)) * (1.0 / size) for gs in zip(*per_rank)]
        if predict:
            for v, value in zip(model.trainable_variables, real):
                v.assign(value)
        if t < warmup:
            opt.apply(mean, model.trainable_variables)
        else:
            pending.append(mean)
            if len(pending) == width:
                opt.apply(pending.pop(0), model.trainable_variables)
        updated = [v.numpy() for v in model.trainable_variables]
        previous = updated if previous is None else real
        real = updated
    if predict:  # between steps the model holds the prediction; compare real weights
        return real
    return [v.numpy() for v in model.trainable_variables]


def digest(arrays: Sequence[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def assert_replicas_identical(model: keras.Model, what: str) -> None:
    digests = hvd.allgather_object(digest([v.numpy() for v in model.variables]), name=f"digest.{what}")
    assert len(set(digests)) == 1, f"{what}: replicas differ across ranks: {digests}"


def passed(name: str) -> None:
    print(f"PASS rank{hvd.rank()} {name}", flush=True)


def reference_weights_compressed(make_optimizer, steps: int, size: int, name: str, width: int = 2) -> List[np.ndarray]:
    """Width ``width`` with a byte codec: each step's gradients, flattened as the pipeline fuses
    them (one bucket, variables in reverse order), reduced by the decoded-sum reference (one
    codec kept across steps, so error feedback carries over), applied ``width - 1`` steps late."""
    from allreduce_reference import decoded_sum_reference

    model, opt = make_model(), make_optimizer()
    variables = model.trainable_variables
    order = list(range(len(variables)))[::-1]
    data = [rank_data(r, steps) for r in range(size)]
    residuals: dict = {}  # error feedback, done by the reference itself
    pending: List[List[tf.Tensor]] = []
    for t in range(steps):
        flats = []
        for x, y in data:
            with tf.GradientTape() as tape:
                loss = LOSS(y[t * BATCH:(t + 1) * BATCH], model(x[t * BATCH:(t + 1) * BATCH]))
            grads = tape.gradient(loss, variables)
            flats.append(np.concatenate([grads[i].numpy().ravel() for i in order]))
        reduced = decoded_sum_reference(name, flats, residuals)
        mean: List[Any] = [None] * len(variables)
        offset = 0
        for i in order:
            n = int(np.prod(variables[i].shape))
            mean[i] = tf.constant(reduced[offset:offset + n].reshape(variables[i].shape))
            offset += n
        pending.append(mean)
        if len(pending) == width:
            opt.apply(pending.pop(0), variables)
    return [v.numpy() for v in variables]
