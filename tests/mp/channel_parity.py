"""The pipeline channel against Horovod's own ops on random data (2 ranks, --gloo or --mpi).

alltoall and allgather must return the same bytes; the float32/float64 all-reduce (sum, average,
pre/postscale) the same values bit for bit: with 2 ranks a sum is one addition, whichever
algorithm does it. Then the engine's compressed all-reduce (int8, fp16) through the channel
against the same through HorovodTorchCommunicator, and allgather_object against Horovod's.
Last, a second channel whose rank 1 arrives 2.5 s late: rank 0 waits without spinning a core.
"""
import time

import horovod.torch as hvd
import torch

from common import passed
from pipesgd_hvd.comm.base import ReduceOp
from pipesgd_hvd.comm.horovod_torch import HorovodTorchCommunicator
from pipesgd_hvd.comm.pipeline_channel import PipelineChannel
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.compression.allreduce import compressed_allreduce
from pipesgd_hvd.ops.torch import TORCH_OPS

hvd.init()
rank, size = hvd.rank(), hvd.size()
channel = PipelineChannel.from_horovod()
assert (channel.rank, channel.size) == (rank, size)
g = torch.Generator().manual_seed(100 + rank)  # different data on every rank

for dtype in (torch.uint8, torch.float32, torch.float16, torch.int64):
    for cols in (1, 1000, 1 << 18):
        x = (torch.randint(0, 255, (size, cols), generator=g).to(dtype) if not dtype.is_floating_point
             else torch.randn(size, cols, generator=g).to(dtype))
        ours = channel.alltoall_async(x, "a2a").wait()
        theirs = hvd.alltoall(x, name=f"a2a.{dtype}.{cols}")
        assert torch.equal(ours, theirs), f"alltoall {dtype} x{cols} differs"
        row = x[:1]
        ours = channel.allgather_async(row, "ag").wait()
        theirs = hvd.allgather(row, name=f"ag.{dtype}.{cols}")
        assert ours.shape == (size, cols) and torch.equal(ours, theirs), f"allgather {dtype} x{cols} differs"
passed("channel-alltoall-allgather-equal-horovod")

HVD_OPS = {ReduceOp.SUM: hvd.Sum, ReduceOp.AVERAGE: hvd.Average}
for dtype in (torch.float32, torch.float64):
    for op, prescale, postscale in ((ReduceOp.SUM, 1.0, 1.0), (ReduceOp.AVERAGE, 1.0, 1.0),
                                    (ReduceOp.AVERAGE, 0.5, 2.0), (ReduceOp.SUM, 0.25, 3.0)):
        x = torch.randn(100_003, generator=g).to(dtype)
        ours = x.clone()
        handle = channel.allreduce_async_(ours, "ar", op, prescale, postscale)
        assert handle.wait() is ours  # in place
        theirs = hvd.allreduce(x, op=HVD_OPS[op], prescale_factor=prescale, postscale_factor=postscale,
                               name=f"ar.{dtype}.{op}.{prescale}")
        assert torch.equal(ours, theirs), f"allreduce {dtype} {op} x{prescale}/{postscale}: " \
                                          f"max diff {(ours - theirs).abs().max()}"
passed("channel-allreduce-equal-horovod")

horovod_comm = HorovodTorchCommunicator()
for name in ("int8", "fp16"):
    flat = torch.randn(300_001, generator=g)
    results = []
    for comm in (channel, horovod_comm):
        codec = resolve_compression(name)  # a fresh codec per transport: same error-feedback state
        out, sent = compressed_allreduce(TORCH_OPS, comm, codec, flat.clone(), name=f"car.{name}", key="k", seed=7)
        results.append((out, sent))
    assert torch.equal(results[0][0], results[1][0]) and results[0][1] == results[1][1], f"compressed {name} differs"
passed("channel-compressed-allreduce-equal-horovod")

obj = {"rank": rank, "payload": list(range(rank * 50))}
assert channel.allgather_object(obj, "obj") == hvd.allgather_object(obj, name="obj")
passed("channel-allgather-object-equal-horovod")
channel.close()

# Building a channel waits for every rank (Horovod broadcasts): in a sleeping poll, where Horovod's
# synchronize() would spin a core for as long as the last rank takes to arrive.
if rank == 1:
    time.sleep(2.5)
cpu = time.thread_time()
late = PipelineChannel.from_horovod(name="psgd.late")
cpu = time.thread_time() - cpu
assert rank == 1 or cpu < 0.5, f"rank 0 spent {cpu:.2f} s of CPU waiting 2.5 s for rank 1 to build the channel"
late.close()
passed("channel-rendezvous-waits-without-spinning")
