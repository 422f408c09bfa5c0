"""Keras: checkpoint mid-pipeline (tf.train.Checkpoint), restore in fresh processes, continue:
bitwise the weights of an uninterrupted run. Width 2, int8 with error feedback.

Usage: keras_checkpoint.py DIR TOTAL_STEPS SAVE_AT MODE, MODE one of
  full,part1  train TOTAL_STEPS uninterrupted, write each rank's final weights to DIR/full.<rank>.npz;
              then, with a new model and optimizer, train SAVE_AT steps, write a checkpoint to
              DIR/ckpt.<rank>, exit (nothing flushed)
  part2       (new processes) restore DIR/ckpt.<rank>, train to TOTAL_STEPS, compare with DIR/full.<rank>.npz
"""
import sys

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import pipesgd_hvd.keras as psgd
from keras_common import BATCH, LOSS, assert_replicas_identical, make_model, passed, rank_data

directory, total, save_at, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
hvd.init()
rank = hvd.rank()
x, y = rank_data(rank, total)


def run(part: str) -> None:
    model = make_model()
    opt = psgd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compression=psgd.Compression.int8)
    model.compile(optimizer=opt, loss=LOSS)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
    start, stop = 0, total
    if part == "part1":
        stop = save_at
    elif part == "part2":
        opt.build(model.trainable_variables)  # the pipeline's variables exist, so restore fills them now
        checkpoint.restore(f"{directory}/ckpt.{rank}-1").assert_consumed()
        start = opt.engine.step
        assert start == save_at, (start, save_at)

    model.fit(x[start * BATCH:stop * BATCH], y[start * BATCH:stop * BATCH], batch_size=BATCH, shuffle=False,
              verbose=0)
    if part == "part1":
        residuals = opt.engine.codec_state
        assert residuals and any(float(tf.reduce_max(tf.abs(r))) > 0 for r in residuals), "EF residuals are saved"
        assert float(tf.reduce_max(tf.abs(opt.engine.slots[0]))) > 0, "the in-flight gradient is saved"
        checkpoint.save(f"{directory}/ckpt.{rank}")
        passed("saved")
    elif part == "full":
        np.savez(f"{directory}/full.{rank}.npz", *[v.numpy() for v in model.variables])
        passed("full")
        opt.flush()  # nothing left in flight before part 1's optimizer starts its own pipeline
    else:
        uninterrupted = np.load(f"{directory}/full.{rank}.npz")
        for i, v in enumerate(model.variables):
            assert np.array_equal(v.numpy(), uninterrupted[f"arr_{i}"]), f"{v.path} differs from the uninterrupted run"
        assert_replicas_identical(model, "restored")
        passed("restored-equals-uninterrupted")


for part in mode.split(","):
    run(part)
