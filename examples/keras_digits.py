"""Digits on an MLP with Keras 3 ``model.fit``, trained data-parallel with horovodrun,
synchronous and pipelined side by side (the Keras twin of torch_digits.py).

    horovodrun -np 2 -H localhost:2 --mpi python examples/keras_digits.py
    horovodrun -np 2 -H localhost:2 --mpi python examples/keras_digits.py --configs 1:none 2:none 2:int8
    horovodrun -np 2 -H localhost:2 --mpi python examples/keras_digits.py --optimizer adamw \
        --configs 1:none 2:int8:split_batch

Each configuration ``WIDTH:COMPRESSION[:CORRECTION]`` trains its own copy of the same initial
model; rank 0 prints test accuracy per epoch (Keras's progress bar) and a summary, with whether the
ranks' weights are bitwise equal. ``split_batch`` (the accurate mode) makes one update of two calls,
so fit gets half the batch size: the one line it changes.
"""
from __future__ import annotations

import argparse
import hashlib
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
    parser.add_argument("--configs", nargs="+", default=["1:none", "2:none", "2:int8"],
                        help="WIDTH:COMPRESSION[:CORRECTION] ...")
    parser.add_argument("--optimizer", nargs="+", choices=["sgd", "adamw"], default=["sgd"],
                        help="each configuration with each")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, help="per rank; scaled by the number of ranks (default: SGD 0.02, "
                        "AdamW 0.001)")
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x_train, y_train, x_test, y_test = load_data(rank, size)
    summary = []
    for name, config in [(o, c) for o in args.optimizer for c in args.configs]:
        width, compression, *correction = config.split(":")
        model = make_model(seed=rank)  # different on each rank: the broadcast callback aligns them
        lr = (args.lr or (0.02 if name == "sgd" else 0.001)) * size
        inner = keras.optimizers.SGD(lr, momentum=0.9) if name == "sgd" else keras.optimizers.AdamW(lr)
        opt = hvd.DistributedOptimizer(inner, width=int(width), compression=compression,
                                       staleness_correction=correction[0] if correction else False)
        # split_batch: an update is two calls of half the batch (the one line the accurate mode changes)
        batch_size = args.batch_size // 2 if correction and correction[0] == "split_batch" else args.batch_size
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        if rank == 0:
            print(f"== {name} {config}")
        start = time.perf_counter()
        model.fit(x_train, y_train, batch_size=batch_size, epochs=args.epochs,
                            validation_data=(x_test, y_test), verbose=2 if rank == 0 else 0,
                            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                       hvd.callbacks.MetricAverageCallback(),
                                       hvd.callbacks.PipelineFlushCallback()])
        seconds = time.perf_counter() - start
        _, accuracy = model.evaluate(x_test, y_test, verbose=0)
        accuracy = float(hvd.allreduce(np.float32(accuracy), name=f"acc.{name}.{config}"))
        digest = hashlib.sha256(b"".join(np.asarray(v).tobytes() for v in model.trainable_variables)).hexdigest()
        equal = len(set(hvd.allgather_object(digest, name=f"digest.{name}.{config}"))) == 1
        summary.append((f"{name} {config}", accuracy, seconds, opt.stats.ratio, equal))
    if rank == 0:
        print("final test accuracy:")
        for label, accuracy, seconds, ratio, equal in summary:
            print(f"  {label:<28} {accuracy:.4f}   ({seconds:.1f} s training, wire bytes {ratio:.3f}x of float32, "
                  f"replicas {'equal' if equal else 'DIFFER'})")


if __name__ == "__main__":
    main()
