"""Keras: bad arguments, models that differ across ranks, non-finite gradients, replica drift.

Each bad input gets a clear error on every rank (printed as RAISED rankN: ...), never a hang.
Usage: keras_reliability.py CASE [CASE ...], each of arguments|mismatch|sparse|nonfinite|drift
"""
import re
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import pipesgd_hvd.keras as psgd
from keras_common import BATCH, LOSS, assert_replicas_identical, make_model, passed, rank_data

hvd.init()
rank = hvd.rank()


def expect(error, needle, build):
    try:
        build()
    except error as e:
        assert needle in str(e), f"{needle!r} not in {e}"
        return str(e)
    raise AssertionError(f"no {error.__name__} for {needle!r}")


# Several cases may share one launch (TensorFlow starts once); "mismatch" ends the process.
for case in sys.argv[1:]:
    if case == "arguments":
        sgd = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
        cases = [
            (ValueError, "width must be an int >= 1", lambda: psgd.DistributedOptimizer(sgd(), width=0)),
            (ValueError, "width must be an int >= 1", lambda: psgd.DistributedOptimizer(sgd(), width="2")),
            (ValueError, "warmup_steps must be an int >= 0", lambda: psgd.DistributedOptimizer(sgd(), warmup_steps=-1)),
            (ValueError, "unknown compression 'zip'", lambda: psgd.DistributedOptimizer(sgd(), compression="zip")),
            (ValueError, "op=Adasum is not supported", lambda: psgd.DistributedOptimizer(sgd(), op=hvd.Adasum)),
            (ValueError, "gradient_accumulation_steps", lambda: psgd.DistributedOptimizer(sgd(), backward_passes_per_step=2)),
            (ValueError, "backward_passes_per_step must be an int >= 1",
             lambda: psgd.DistributedOptimizer(sgd(), backward_passes_per_step=0)),
            (ValueError, "fusion_threshold_mb must be a finite number >= 0",
             lambda: psgd.DistributedOptimizer(sgd(), fusion_threshold_mb=-1)),
            (ValueError, "gradient_predivide_factor must be",
             lambda: psgd.DistributedOptimizer(sgd(), gradient_predivide_factor=0)),
            (ValueError, "staleness_correction must be", lambda: psgd.DistributedOptimizer(sgd(), staleness_correction="x")),
            (ValueError, "global process set", lambda: psgd.DistributedOptimizer(sgd(), process_set=object())),
            (ValueError, "seed must be an int >= 0", lambda: psgd.DistributedOptimizer(sgd(), seed=-1)),
            (ValueError, "check_replicas_every must be an int >= 0 steps (0 or None: never), got -1",
             lambda: psgd.DistributedOptimizer(sgd(), check_replicas_every=-1)),
            (ValueError, "check_replicas_every must be an int >= 0 steps (0 or None: never), got 2.5",
             lambda: psgd.DistributedOptimizer(sgd(), check_replicas_every=2.5)),
            (ValueError, "auto_measure_steps must be an int >= 2",
             lambda: psgd.DistributedOptimizer(sgd(), width="auto", auto_measure_steps=1)),
            (TypeError, "must be a Keras 3 optimizer", lambda: psgd.DistributedOptimizer(tf.Variable(1.0))),
            (TypeError, "already a pipesgd_hvd DistributedOptimizer",
             lambda: psgd.DistributedOptimizer(psgd.DistributedOptimizer(sgd()))),
        ]
        for error, needle, build in cases:
            expect(error, needle, build)
        built = sgd()
        built.build(make_model().trainable_variables)
        expect(ValueError, "wrap the optimizer before it is used", lambda: psgd.DistributedOptimizer(built))
        # An integer "gradient" (a variable that is trainable but not a float) gets a named error.
        opt = psgd.DistributedOptimizer(sgd())
        counter = tf.Variable(0, dtype=tf.int32, name="counter")
        expect(TypeError, "counter", lambda: opt.apply_gradients([(tf.constant(1, tf.int32), counter)]))
        passed("keras-bad-arguments")

    elif case == "mismatch":
        model = make_model() if rank == 0 else keras.Sequential(
            [keras.Input((12,)), keras.layers.Dense(33, activation="tanh"), keras.layers.Dense(3)])
        opt = psgd.DistributedOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=opt, loss=LOSS)
        x, y = rank_data(rank, 2)
        try:
            model.fit(x, y, batch_size=BATCH, verbose=0)
        except ValueError as e:
            print(f"RAISED rank{rank}: {e}", flush=True)
            sys.exit(1)

    elif case == "sparse":
        # An Embedding's gradient is tf.IndexedSlices: reduced dense, as Horovod's sparse_as_dense.
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(50, 8),
                                  keras.layers.Flatten(), keras.layers.Dense(3)])
        opt = psgd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="int8")
        model.compile(optimizer=opt, loss=LOSS)
        rng = np.random.default_rng(rank)
        ids, labels = rng.integers(0, 50, (64, 4)), rng.integers(0, 3, 64)
        before = model.layers[0].embeddings.numpy().copy()
        model.fit(ids, labels, batch_size=16, shuffle=False, verbose=0)
        assert not np.array_equal(before, model.layers[0].embeddings.numpy()), "the embedding trained"
        assert_replicas_identical(model, "sparse")
        passed("keras-sparse-embedding")

    elif case == "nonfinite":
        # Rank 1's gradient turns non-finite at step 3: the policy (int8: the whole 512-value block
        # becomes NaN; casts: element-wise) is applied to the bytes both ranks decode, so both ranks
        # apply the same result and replicas stay bitwise equal.
        for name in ("int8", "bf16", "none"):
            model = make_model()
            opt = psgd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=name)
            x, y = rank_data(rank, 5)
            for t in range(5):
                with tf.GradientTape() as tape:
                    loss = LOSS(y[t * BATCH:(t + 1) * BATCH], model(x[t * BATCH:(t + 1) * BATCH]))
                grads = tape.gradient(loss, model.trainable_variables)
                if t == 3 and rank == 1:
                    grads[0] = tf.tensor_scatter_nd_update(grads[0], [[0, 0]], [np.inf])
                opt.apply_gradients(zip(grads, model.trainable_variables))
            opt.flush()
            assert_replicas_identical(model, f"nonfinite-{name}")
            kernel = model.trainable_variables[0].numpy()
            assert not np.isfinite(kernel).all(), "the non-finite value reached the weights (it is not hidden)"
            passed(f"keras-nonfinite-{name}")

    elif case == "drift":
        # check_replicas_every=N in the three ways a Keras optimizer steps: model.fit, a custom
        # tf.function loop and an eager loop. First while replicas agree (the checks run and pass),
        # then with rank 1 alone nudging one weight before step 7: with N = 5 every rank must fail at
        # step 10 naming that variable. Prints ``RAISED rank<r> <loop> <error type>: <message>``.
        from pipesgd_hvd.pipeline.guards import ReplicaDriftError

        STEPS = 14
        x, y = rank_data(rank, STEPS)

        def nudged(model):
            return model.trainable_variables[2]  # the second Dense layer's kernel

        def nudge(model):
            kernel = nudged(model)
            kernel.assign(tf.tensor_scatter_nd_add(kernel, [[1, 2]], [1e-6]))

        class Nudge(keras.callbacks.Callback):
            def __init__(self, at):
                super().__init__()
                self.at = at

            def on_train_batch_begin(self, batch, logs=None):
                if batch == self.at and rank == 1:
                    nudge(self.model)

        def train(model, loop, every, steps, corrupt_at=None):
            opt = psgd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression="int8",
                                            check_replicas_every=every)
            if loop == "fit":
                model.compile(optimizer=opt, loss=LOSS)
                model.fit(x[:steps * BATCH], y[:steps * BATCH], batch_size=BATCH, shuffle=False, verbose=0,
                          callbacks=[Nudge(corrupt_at)])
                return model, opt

            def step(xb, yb):
                with tf.GradientTape() as tape:
                    loss = LOSS(yb, model(xb))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))

            run = tf.function(step) if loop == "tf.function" else step
            for t in range(steps):
                if t == corrupt_at and rank == 1:
                    nudge(model)
                run(x[t * BATCH:(t + 1) * BATCH], y[t * BATCH:(t + 1) * BATCH])
            return model, opt

        # Ranks that disagree on the setting fail when the optimizer is built, on every rank.
        model = make_model()
        opt = psgd.DistributedOptimizer(keras.optimizers.SGD(0.1), check_replicas_every=5 if rank == 0 else 0)
        message = expect(ValueError, "settings differ across ranks", lambda: opt.build(model.trainable_variables))
        assert "('check_replicas_every', 5)" in message and "('check_replicas_every', 0)" in message, message
        passed("keras-drift-setting-checked-across-ranks")

        for loop, every in (("fit", 2), ("tf.function", 3), ("eager", 4)):
            model, opt = train(make_model(), loop, every, 12)
            opt.flush()
            assert_replicas_identical(model, f"drift-clean-{loop}")
            last = (12 - 1) // every * every  # the last step a check ran at, and passed
            assert opt.engine.step == 12, opt.engine.step
            assert int(opt.core.replicas.agreed_at.numpy()) == last, (loop, opt.core.replicas.agreed_at)
            passed(f"keras-drift-checks-pass-while-equal-{loop}")

        for loop in ("fit", "tf.function", "eager"):
            model = make_model()
            print(f"NUDGED rank{rank} {loop} {nudged(model).path}", flush=True)
            try:
                train(model, loop, 5, STEPS, corrupt_at=7)
            except (ReplicaDriftError, tf.errors.OpError) as exc:
                # Inside a graph TensorFlow re-raises it as an OpError; the message holds ours.
                found = re.search(r"ReplicaDriftError: (replicas differ at step \d+: .*?\(they were identical at step "
                                  r"\d+\))", str(exc)) if isinstance(exc, tf.errors.OpError) else None
                text = found.group(1) if found else str(exc)
                print(f"RAISED rank{rank} {loop} {type(exc).__name__}: {text}", flush=True)
            else:
                print(f"NO ERROR rank{rank} {loop}", flush=True)

    else:
        raise SystemExit(f"unknown case {case!r}: use arguments, mismatch, sparse, nonfinite or drift")
