"""Horovod's own collectives work in this build: horovod.torch, and horovod.tensorflow eagerly and
inside tf.function (each rank contributes rank+1; the average over 2 ranks is 1.5)."""
import horovod.torch as hvd_torch
import numpy as np
import torch

hvd_torch.init()
rank, size = hvd_torch.rank(), hvd_torch.size()
expected = sum(r + 1 for r in range(size)) / size

out = hvd_torch.allreduce(torch.full((4,), float(rank + 1)), name="torch.avg")
assert torch.equal(out, torch.full((4,), expected)), out
print(f"rank {rank}: horovod.torch allreduce ok")

import horovod.tensorflow as hvd_tf  # noqa: E402
import tensorflow as tf  # noqa: E402

hvd_tf.init()
eager = hvd_tf.allreduce(tf.fill([4], float(rank + 1)), name="tf.eager")
np.testing.assert_array_equal(eager.numpy(), np.full(4, expected, np.float32))


@tf.function
def reduced(x):
    return hvd_tf.allreduce(x, name="tf.graph")


graph = reduced(tf.fill([4], float(rank + 1)))
np.testing.assert_array_equal(graph.numpy(), np.full(4, expected, np.float32))
print(f"rank {rank}: horovod.tensorflow allreduce ok (eager and tf.function)")
