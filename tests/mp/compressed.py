"""Compressed all-reduce and compressed training on 2 real ranks (horovodrun).

* compressed_allreduce through Horovod's alltoall/allgather (and mpi4py under MPI) equals the
  decoded-sum reference computed here, for every codec and a size that does not divide by N;
* a width-2 int8/int4 training keeps replicas bitwise identical; wire bytes <= 0.27x / 0.14x.
"""
import os

import horovod.torch as hvd
import numpy as np
import torch

import pipesgd_hvd.torch as psgd
from allreduce_reference import decoded_sum_reference
from common import assert_replicas_identical, passed
from pipesgd_hvd.comm.base import ReduceOp
from pipesgd_hvd.comm.horovod_torch import HorovodTorchCommunicator
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.compression.allreduce import compressed_allreduce
from pipesgd_hvd.ops.torch import TORCH_OPS

hvd.init()
rank, size = hvd.rank(), hvd.size()
communicators = {"horovod": HorovodTorchCommunicator()}
if os.environ.get("OMPI_COMM_WORLD_SIZE"):  # an MPI world exists (horovodrun --mpi)
    from pipesgd_hvd.comm.mpi4py import Mpi4pyCommunicator

    communicators["mpi4py"] = Mpi4pyCommunicator(TORCH_OPS)

n = 100_003
inputs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) * (r + 1) for r in range(size)]
for comm_name, comm in communicators.items():
    for name in ["fp16", "bf16", "truncate16", "int8", "int4"]:
        out, sent = compressed_allreduce(TORCH_OPS, comm, resolve_compression(name), torch.from_numpy(inputs[rank].copy()),
                                         name=f"car.{name}", key="k", seed=rank, op=ReduceOp.AVERAGE)
        expected = decoded_sum_reference(name, inputs)
        assert np.array_equal(out.numpy(), expected), f"{comm_name}/{name}: differs from the decoded-sum reference"
        assert_replicas_identical([out], f"car.{comm_name}.{name}")
        passed(f"compressed-allreduce-{comm_name}-{name}")

for name, limit in [("int8", 0.27), ("int4", 0.14)]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                    named_parameters=model.named_parameters(), compression=name)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(10):
        opt.zero_grad()
        x, y = torch.randn(32, 256, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.flush()
    assert_replicas_identical(model.parameters(), f"train.{name}")
    assert opt.stats.ratio <= limit, f"{name}: wire ratio {opt.stats.ratio:.4f} > {limit}"
    print(f"rank{rank} {name} wire ratio {opt.stats.ratio:.4f}", flush=True)
    passed(f"train-{name}")
