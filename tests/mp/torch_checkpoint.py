"""Checkpoint mid-pipeline, restore in fresh processes, continue: same weights as an uninterrupted run.

The checkpoint holds the in-flight (already reduced) gradient and, with int8/int4, each rank's
error-feedback residuals, so each rank saves and restores its own file.

Usage: torch_checkpoint.py DIR COMPRESSION TOTAL_STEPS SAVE_AT MODE [PREDICTION], MODE one of
  full,part1  train TOTAL_STEPS uninterrupted, write each rank's final weights to DIR/full.<rank>.pt;
              then, with a new model and optimizer, train SAVE_AT steps, write model + optimizer
              state_dict to DIR/ckpt.<rank>.pt, exit (the step in flight is not flushed)
  part2       (new processes) load DIR/ckpt.<rank>.pt, train to TOTAL_STEPS, compare with DIR/full.<rank>.pt
PREDICTION "prediction": staleness_correction=True; part1 also saves the model inside
opt.real_weights() (DIR/ckpt-real.<rank>.pt) beside the model as it is between steps (holding the
prediction), and part2 resumes each in turn; both must continue exactly. Compared: the parameters
(the prediction, with the correction) and the real weights.
"""
import sys

import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import assert_replicas_identical, passed
from reference import loss_fn, make_batches, make_model

directory, compression, total, save_at, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
prediction = len(sys.argv) > 6 and sys.argv[6] == "prediction"
hvd.init()
rank = hvd.rank()
batches = make_batches(total, hvd.size())


def build():
    model = make_model()
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    named_parameters=model.named_parameters(), width=2, compression=compression,
                                    staleness_correction=prediction)
    return model, opt


def train(model, opt, start, stop):
    for t in range(start, stop):
        opt.zero_grad()
        loss_fn(model, batches[t][rank]).backward()
        opt.step()


def full():
    model, opt = build()
    train(model, opt, 0, total)
    with opt.real_weights():
        real = [p.detach().clone() for p in model.parameters()]
    torch.save([[p.detach() for p in model.parameters()], real], f"{directory}/full.{rank}.pt")
    passed("full")
    opt.flush()  # nothing left in flight before part 1 reuses the collective names


def part1():
    model, opt = build()
    train(model, opt, 0, save_at)
    state = opt.state_dict()
    assert len(state["pipesgd"]["in_flight"]) == 1, "width 2 keeps one step in flight"
    if compression in ("int8", "int4"):  # error feedback: this rank's residuals travel with the checkpoint
        residuals = state["pipesgd"]["codec"]["residuals"]
        # (not every one: a rank's reduced chunk of a step's last bucket may hold only the membership
        # flags, which quantize exactly, so its residual is zero)
        assert residuals and any(bool(r.any()) for r in residuals.values()), "no error-feedback residual saved"
    torch.save({"model": model.state_dict(), "optimizer": state}, f"{directory}/ckpt.{rank}.pt")
    if prediction:
        assert state["pipesgd"]["corrections"]["started"], "the prediction state travels with the checkpoint"
        with opt.real_weights():
            torch.save({"model": model.state_dict(), "optimizer": state}, f"{directory}/ckpt-real.{rank}.pt")
    passed("saved")


def part2():
    uninterrupted, uninterrupted_real = torch.load(f"{directory}/full.{rank}.pt")
    for variant in (["ckpt", "ckpt-real"] if prediction else ["ckpt"]):
        model, opt = build()
        ckpt = torch.load(f"{directory}/{variant}.{rank}.pt", weights_only=False)
        model.load_state_dict(ckpt["model"])  # the model first: the optimizer then writes the prediction
        opt.load_state_dict(ckpt["optimizer"])
        assert opt.engine.step == save_at, (opt.engine.step, save_at)
        train(model, opt, save_at, total)
        for (name, p), q in zip(model.named_parameters(), uninterrupted):
            assert torch.equal(p, q), f"{variant}: differs from uninterrupted at {name}: {(p - q).abs().max()}"
        with opt.real_weights():
            for (name, p), q in zip(model.named_parameters(), uninterrupted_real):
                assert torch.equal(p, q), f"{variant}: real {name} differs from uninterrupted: {(p - q).abs().max()}"
        assert_replicas_identical(model.parameters(), f"restored-{variant}")
        opt.flush()  # nothing left in flight before the next variant reuses the collective names
    passed("restored-equals-uninterrupted")


for part in mode.split(","):
    {"full": full, "part1": part1, "part2": part2}[part]()
