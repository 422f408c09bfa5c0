"""Uneven data per rank with ``join()`` (issue 17): rank 0 runs out of batches first.

Usage: join_uneven.py WIDTH CODEC   (under horovodrun -np 2)

Rank 0 trains 6 batches, rank 1 12; both call an unnamed ``hvd.allreduce`` of their loss after
each step (Horovod's metric pattern; Horovod's own join runs on the joined rank meanwhile), then ``psgd.join()`` where Horovod's code calls
``hvd.join()`` (``import pipesgd_hvd.torch as hvd`` makes it the same line), then broadcast the
model from the rank that joined last, as Horovod's documentation says. Every rank must end with
equal replicas, rank 1 must be the last, and at width 1 with no compression the weights must be
bitwise those Horovod's own optimizer reaches with ``hvd.join()`` on the same data (a joined rank
contributes zeros; the average divides by the number of ranks).
Prints ``PASS rank<r> join-<width>-<codec>``.
"""
import sys
import time

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import weights_digest
from reference import loss_fn, make_batches, make_model

width, codec = sys.argv[1], sys.argv[2]
hvd.init()
rank, size = hvd.rank(), hvd.size()
BATCHES = make_batches(12, size)
STEPS = 6 if rank == 0 else 12  # uneven: rank 0 has half the batches


def run(which):
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if which == "horovod":
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    else:
        opt = psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), width=int(which),
                                        compression=getattr(psgd.Compression, codec))
    for t in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model, BATCHES[t][rank])
        loss.backward()
        opt.step()
        if which != "horovod":  # unnamed, beside the pipeline; the joined rank's share is zero
            hvd.allreduce(loss.detach())
    last = hvd.join() if which == "horovod" else psgd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    return model, last


start = time.monotonic()
tag = f"join-{width}-{codec}"
model, last = run(width)
# Horovod's own after ours: uneven steps leave Horovod's per-process op counters apart, so only
# named ops (its optimizer's) can follow them.
reference = run("horovod")[0] if width == "1" and codec == "none" else None
assert last == 1, f"{tag}: rank {last} joined last, expected 1"
digests = hvd.allgather_object(weights_digest(model.parameters()), name="join.digest")
assert len(set(digests)) == 1, f"{tag}: replicas differ after the broadcast from rank {last}"
if reference is not None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), f"{tag}: {name} differs from Horovod's by {(p - q).abs().max().item():.3g}"
print(f"PASS rank{rank} {tag} in {time.monotonic() - start:.1f} s", flush=True)
