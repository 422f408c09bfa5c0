"""Under torchrun (no Horovod initialized): the optimizer runs over torch.distributed.

Usage: torchrun_pipeline.py COMPRESSION [BACKEND]. BACKEND (default ``gloo``) is the default
process group's: ``cuda:gloo`` makes it a device-only group, as ``init_process_group("nccl")``
does on a GPU machine (a host tensor on it fails with "No backend type associated with device
type cpu"); the pipeline's host tensors (the membership flags, this CPU model) must then go to a
group that takes them."""
import sys

import torch
import torch.distributed as dist

import pipesgd_hvd.torch as psgd
from reference import loss_fn, make_batches, make_model, reference_sgd

compression = sys.argv[1]
backend = sys.argv[2] if len(sys.argv) > 2 else "gloo"
dist.init_process_group(backend)
rank, size = dist.get_rank(), dist.get_world_size()
checks = dist.new_group(backend="gloo")  # this script's own replica check: host objects
batches = make_batches(15, size)
model = make_model()
opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                width=2, compression=compression)
assert type(opt.engine.comm.inner).__name__ == "TorchDistributedCommunicator", type(opt.engine.comm.inner)
for t in range(15):
    opt.zero_grad()
    loss_fn(model, batches[t][rank]).backward()
    opt.step()
digests = [None] * size
dist.all_gather_object(digests, [p.detach().numpy().tobytes() for p in model.parameters()], group=checks)
assert all(d == digests[0] for d in digests), "replicas differ"
if compression == "none":
    for p, r in zip(model.parameters(), reference_sgd(15, size, 2, 0.1, batches=lambda t: batches[t])):
        assert torch.equal(p, r)
print(f"PASS rank{rank} torchrun-{compression}-{backend}", flush=True)
dist.destroy_process_group()
