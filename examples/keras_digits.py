"""Digits on an MLP with Keras 3 ``model.fit``, trained data-parallel with horovodrun,
synchronous and pipelined side by side (the Keras twin of torch_digits.py).

    horovodrun -np 2 -H localhost:2 --mpi python examples/keras_digits.py
    horovodrun -np 2 -H localhost:2 --mpi python examples/keras_digits.py --configs 1:none 2:none 2:int8

Each configuration ``WIDTH:COMPRESSION`` trains its own copy of the same initial model; rank 0
prints test accuracy per epoch (Keras's progress bar) and a summary.
"""
from __future__ import annotations

import argparse
import time

import keras
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import pipesgd_hvd.keras as hvd


def load_data(rank: int, size: int):
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    return x_train[rank::size], y_train[rank::size], x_test, y_test  # each rank its own shard


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["1:none", "2:none", "2:int8"], help="WIDTH:COMPRESSION ...")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="per rank; scaled by the number of ranks")
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x_train, y_train, x_test, y_test = load_data(rank, size)
    summary = []
    for config in args.configs:
        width, compression = config.split(":")
        model = make_model(seed=rank)  # different on each rank: the broadcast callback aligns them
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * size, momentum=0.9),
                                       width=int(width), compression=compression)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        if rank == 0:
            print(f"== width={width} compression={compression}")
        start = time.perf_counter()
        history = model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
                            validation_data=(x_test, y_test), verbose=2 if rank == 0 else 0,
                            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                       hvd.callbacks.MetricAverageCallback(),
                                       hvd.callbacks.PipelineFlushCallback()])
        seconds = time.perf_counter() - start
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        accuracy = float(hvd.allreduce(np.float32(accuracy), name=f"acc.{config}"))
        summary.append((f"width={width} {compression}", accuracy, seconds, opt.stats.ratio,
                        history.history["val_accuracy"]))
    if rank == 0:
        print("final test accuracy:")
        for label, accuracy, seconds, ratio, _ in summary:
            print(f"  {label:<22} {accuracy:.4f}   ({seconds:.1f} s training, wire bytes {ratio:.3f}x of float32)")


if __name__ == "__main__":
    main()
