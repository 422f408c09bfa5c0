"""Checkpoint mid-pipeline, restore in fresh processes, continue: same weights as an uninterrupted run.

The checkpoint holds the in-flight (already reduced) gradient and, with int8/int4, each rank's
error-feedback residuals, so each rank saves and restores its own file.

Usage: torch_checkpoint.py DIR COMPRESSION TOTAL_STEPS SAVE_AT MODE, MODE one of
  full    train TOTAL_STEPS uninterrupted, write each rank's final weights to DIR/full.<rank>.pt
  part1   train SAVE_AT steps, write model + optimizer state_dict to DIR/ckpt.<rank>.pt, exit
  part2   (new processes) load DIR/ckpt.<rank>.pt, train to TOTAL_STEPS, compare with DIR/full.<rank>.pt
"""
import sys

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import assert_replicas_identical, passed
from reference import loss_fn, make_batches, make_model

directory, compression, total, save_at, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
hvd.init()
rank = hvd.rank()
batches = make_batches(total, hvd.size())

model = make_model()
opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                named_parameters=model.named_parameters(), width=2, compression=compression)
start, stop = 0, total
if mode == "part1":
    stop = save_at
elif mode == "part2":
    ckpt = torch.load(f"{directory}/ckpt.{rank}.pt", weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    start = opt.engine.step
    assert start == save_at, (start, save_at)

for t in range(start, stop):
    opt.zero_grad()
    loss_fn(model, batches[t][rank]).backward()
    opt.step()

if mode == "part1":
    state = opt.state_dict()
    assert len(state["pipesgd"]["in_flight"]) == 1, "width 2 keeps one step in flight"
    if compression in ("int8", "int4"):  # error feedback: this rank's residuals travel with the checkpoint
        residuals = state["pipesgd"]["codec"]["residuals"]
        assert residuals and all(bool(r.any()) for r in residuals.values()), "no error-feedback residual saved"
    torch.save({"model": model.state_dict(), "optimizer": state}, f"{directory}/ckpt.{rank}.pt")
    passed("saved")
elif mode == "full":
    torch.save([p.detach() for p in model.parameters()], f"{directory}/full.{rank}.pt")
    passed("full")
else:
    full = torch.load(f"{directory}/full.{rank}.pt")
    for (name, p), q in zip(model.named_parameters(), full):
        assert torch.equal(p, q), f"restored run differs from uninterrupted at {name}: {(p - q).abs().max()}"
    assert_replicas_identical(model.parameters(), "restored")
    passed("restored-equals-uninterrupted")
