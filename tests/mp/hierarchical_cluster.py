"""Hierarchical reductions on emulated hosts, several ranks each, under horovodrun --gloo
(tests/test_hierarchical_cluster.py launches it through tools/cluster/horovodrun.py).

* the node and cross-node groups built on the pipeline channel from Horovod's topology give, for
  every codec, bitwise the reference computed here without any communicator;
* counted per collective, the hierarchical int8 reduction sends 1/local_size of the flat one's
  bytes to other hosts;
* training through DistributedOptimizer, flat (hierarchical=False) and with the default
  (hierarchical=None, on here), keeps replicas bitwise identical, and the kernel's counter of
  each host's link (eth0's transmitted bytes) shows what crossed between hosts.

Prints ``HOSTBYTES <mode> <bytes>`` per host (local rank 0) for the test to compare.
"""
import sys

import horovod.torch as hvd
import numpy as np
import torch

import pipesgd_hvd.torch as psgd
from allreduce_reference import hierarchical_reference
from common import assert_replicas_identical, passed
from pipesgd_hvd.comm.pipeline_channel import PipelineChannel
from pipesgd_hvd.comm.topology import Topology, resolve_topology
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.compression.allreduce import compressed_allreduce
from pipesgd_hvd.compression.hierarchical import hierarchical_allreduce
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.testing import CountingComm

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 6

hvd.init()
torch.set_num_threads(1)
rank, size, L, C = hvd.rank(), hvd.size(), hvd.local_size(), hvd.cross_size()
assert L > 1 and C > 1 and L * C == size, (L, C, size)
channel = PipelineChannel.from_horovod(name="hier.channel")
topology = resolve_topology(True, channel, name="hier.topology")
places = [tuple(p) for p in channel.allgather_object([hvd.cross_rank(), hvd.local_rank()], "hier.places")]
host_of = [p[0] for p in places]
by_place = sorted(range(size), key=lambda r: places[r])  # the reference's order: host by host, local rank within

n = 100_003
inputs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) * (r + 1) for r in range(size)]
for name in ["fp16", "bf16", "truncate16", "int8", "int4"]:
    out, _ = hierarchical_allreduce(TORCH_OPS, topology, resolve_compression(name), torch.from_numpy(inputs[rank].copy()),
                                    name=f"h.{name}", key="k", seed=rank)
    expected = hierarchical_reference(name, [inputs[r] for r in by_place], C, L)
    assert np.array_equal(out.numpy(), expected), f"{name}: differs from the hierarchical reference"
    assert_replicas_identical([out], f"hier.{name}")
    passed(f"hierarchical-{name}")

out, _ = hierarchical_allreduce(TORCH_OPS, topology, resolve_compression("int8"), torch.from_numpy(inputs[rank].copy()),
                                name="h.bf16node", key="k16", seed=rank, local_dtype="bfloat16")
assert np.array_equal(out.numpy(), hierarchical_reference("int8", [inputs[r] for r in by_place], C, L,
                                                          local_dtype="bfloat16"))
passed("hierarchical-int8-bf16-node")

# Bytes to other hosts, counted per collective on the same transports.
flat = CountingComm(channel, lambda peer: host_of[peer])
compressed_allreduce(TORCH_OPS, flat, resolve_compression("int8"), torch.from_numpy(inputs[rank].copy()),
                     name="count.flat", key="cf", seed=0)
local, cross = CountingComm(topology.local, lambda peer: 0), CountingComm(topology.cross, lambda peer: peer)
hierarchical_allreduce(TORCH_OPS, Topology(topology.layout, local, cross), resolve_compression("int8"),
                       torch.from_numpy(inputs[rank].copy()), name="count.hier", key="ch", seed=0)
counted = channel.allgather_object([flat.cross_bytes, cross.cross_bytes, local.cross_bytes], "hier.counted")
flat_bytes, hier_bytes = sum(c[0] for c in counted), sum(c[1] for c in counted)
assert sum(c[2] for c in counted) == 0
assert hier_bytes * L <= flat_bytes, f"hierarchical int8 sent {hier_bytes} B across hosts, flat {flat_bytes} B"
print(f"rank{rank} COUNTED cross-host bytes flat {flat_bytes} hierarchical {hier_bytes}", flush=True)
passed("counted-cross-host-bytes")
topology.close()


def eth0_tx() -> int:
    """Bytes this host's link has sent (the kernel's counter; this process is in the host's namespace)."""
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("eth0:"):
                return int(line.split(":", 1)[1].split()[8])
    raise RuntimeError("no eth0 here: not on the emulated cluster")


def barrier(tag: str) -> None:
    channel.allgather_object(0, f"hier.barrier.{tag}")


for mode, choice in (("flat", False), ("hierarchical", None)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                    named_parameters=model.named_parameters(), compression="int8",
                                    hierarchical=choice)
    assert opt._core.engine.config.hierarchical == (None if mode == "flat" else "float32"), mode
    gen = torch.Generator().manual_seed(rank)
    barrier(f"{mode}.start")
    before = eth0_tx()
    for _ in range(STEPS):
        opt.zero_grad()
        x = torch.randn(16, 1024, generator=gen)
        model(x).square().mean().backward()
        opt.step()
    opt.flush()
    barrier(f"{mode}.end")
    sent = eth0_tx() - before
    assert_replicas_identical(model.parameters(), f"train.{mode}")
    if hvd.local_rank() == 0:
        print(f"HOSTBYTES {mode} {sent}", flush=True)
    passed(f"train-{mode}")

# A second hierarchical optimizer in the same process, the first still open: its node groups are
# built on the same shared channel, under keys of its own (under the first one's, Gloo's rendezvous
# never completed: the throughput benchmark, which builds one optimizer per configuration, hung).
second_model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
second = psgd.DistributedOptimizer(torch.optim.SGD(second_model.parameters(), lr=0.01),
                                   named_parameters=second_model.named_parameters(), compression="int4",
                                   hierarchical=True)
for _ in range(3):
    second.zero_grad()
    second_model(torch.randn(8, 64, generator=gen)).square().mean().backward()
    second.step()
second.flush()
assert_replicas_identical(second_model.parameters(), "train.second")
passed("train-second-hierarchical")
