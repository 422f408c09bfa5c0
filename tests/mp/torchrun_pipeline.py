"""Under torchrun (no Horovod initialized): the optimizer runs over torch.distributed (Gloo)."""
import sys

import torch
import torch.distributed as dist

import pipesgd_hvd.torch as psgd
from reference import loss_fn, make_batches, make_model, reference_sgd

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
compression = sys.argv[1]
batches = make_batches(15, size)
model = make_model()
opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                width=2, compression=compression)
assert type(opt.engine.comm).__name__ == "TorchDistributedCommunicator", type(opt.engine.comm)
for t in range(15):
    opt.zero_grad()
    loss_fn(model, batches[t][rank]).backward()
    opt.step()
digests = [None] * size
dist.all_gather_object(digests, [p.detach().numpy().tobytes() for p in model.parameters()])
assert all(d == digests[0] for d in digests), "replicas differ"
if compression == "none":
    for p, r in zip(model.parameters(), reference_sgd(15, size, 2, 0.1, batches=lambda t: batches[t])):
        assert torch.equal(p, r)
print(f"PASS rank{rank} torchrun-{compression}", flush=True)
dist.destroy_process_group()
