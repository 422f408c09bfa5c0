"""inf/nan gradients on one rank only are applied the same way on every rank (2 ranks, horovodrun).

* none: rank 1's inf reaches the averaged gradient of both ranks; the weights go non-finite at
  exactly that element, identically (bytes) on both ranks, and stay identical afterwards;
* int8: the same, but the non-finite values fill one 512-value block (the codecs' policy) and the
  error-feedback residuals stay finite;
* GradScaler: the NaN step is skipped on every rank (scale halved once), weights finite and equal.
"""
import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import assert_replicas_identical, passed
from reference import loss_fn, make_batches

hvd.init()
rank = hvd.rank()
batches = make_batches(8, hvd.size())


def make_wide_model():
    model = torch.nn.Sequential(torch.nn.Linear(6, 200), torch.nn.Tanh(), torch.nn.Linear(200, 3))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.linspace(-0.3, 0.3, p.numel()).reshape(p.shape) * (i + 1))
    return model


def poison_when(param, flag, value):
    """A tensor hook runs inside backward, before the gradient is handed to the pipeline."""
    def hook(grad):
        if flag[0]:
            grad = grad.clone()
            grad.view(-1)[0] = value
        return grad

    param.register_hook(hook)


def bad_count(model):
    return int(sum((~torch.isfinite(p)).sum() for p in model.parameters()))


for compression in ("none", "int8"):
    model = make_wide_model()
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), width=2, compression=compression)
    flag = [False]
    poison_when(model[0].weight, flag, float("inf"))
    for t in range(6):
        flag[0] = t == 2 and rank == 1
        opt.zero_grad()
        loss_fn(model, batches[t][rank]).backward()
        opt.step()
        if t == 3:  # step 3 applied step 2's averaged gradient
            bad = bad_count(model)
            if compression == "none":
                assert bad == 1, f"none: {bad} non-finite weights, expected exactly the poisoned one"
            else:
                assert 1 <= bad <= 512, f"int8: {bad} non-finite weights, more than one block"
                residuals = opt.engine.codec.state_dict()["residuals"]
                assert all(torch.isfinite(r).all() for r in residuals.values()), "a residual kept a non-finite value"
        assert_replicas_identical(model.parameters(), f"{compression}.step{t}")
    passed("none-replicas-equal" if compression == "none" else "int8-one-block")

model = make_wide_model()
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                width=2, compression="int8", grad_scaler=scaler)
flag, skipped = [False], 0
poison_when(model[0].weight, flag, float("nan"))
for t in range(8):
    flag[0] = t == 3 and rank == 1
    opt.zero_grad()
    scaler.scale(loss_fn(model, batches[t][rank])).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    with opt.skip_synchronize():
        scaler.step(opt)
    before = scaler.get_scale()
    scaler.update()
    skipped += scaler.get_scale() < before
opt.flush()
assert skipped == 1, f"{skipped} steps skipped, expected the one that applies the NaN gradient"
assert bad_count(model) == 0
assert_replicas_identical(model.parameters(), "scaler")
passed("scaler-skips-on-every-rank")
