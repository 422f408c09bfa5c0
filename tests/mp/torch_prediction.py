"""Staleness correction (weight prediction) of the PyTorch DistributedOptimizer under horovodrun -np 2.

* width=2 + staleness_correction equals the plain reference of the rule (gradients at
  w_t + (w_t - w_{t-1})) bit for bit, with warm-up 0 and 3, every rank with different batches;
* between steps the parameters hold the prediction; ``real_weights()`` shows the real weights and
  puts the prediction back bit for bit; ``flush()`` leaves the real weights plus the last update;
* replicas are bitwise identical.
"""
import horovod.torch as hvd
import torch

import pipesgd_hvd.torch as psgd
from common import assert_replicas_identical, passed
from reference import loss_fn, make_batches, make_model, reference_sgd

hvd.init()
rank, size = hvd.rank(), hvd.size()
STEPS, LR = 20, 0.1


def check_rule(warmup: int) -> None:
    batches = make_batches(STEPS, size)
    model = make_model()
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                    named_parameters=model.named_parameters(), width=2, warmup_steps=warmup,
                                    staleness_correction=True)
    for t in range(STEPS):
        opt.zero_grad()
        loss_fn(model, batches[t][rank]).backward()
        opt.step()
    ref = lambda **kw: reference_sgd(STEPS, size, 2, LR, warmup, batches=lambda t: batches[t], **kw)  # noqa: E731
    want, plain = ref(predict=True), ref()
    assert any(not torch.equal(a, b) for a, b in zip(want, plain)), "prediction must change the run"
    predicted = [p.detach().clone() for p in model.parameters()]
    with opt.real_weights():
        for (name, p), r in zip(model.named_parameters(), want):
            assert torch.equal(p, r), f"warmup={warmup}: real {name} off the reference by {(p - r).abs().max()}"
        assert_replicas_identical(model.parameters(), f"prediction-real-w{warmup}")
    for (name, p), q, r in zip(model.named_parameters(), predicted, want):
        assert torch.equal(p, q), f"real_weights() did not put the prediction of {name} back"
        assert not torch.equal(p, r), f"between steps {name} should hold the prediction, not the real weights"
    assert_replicas_identical(model.parameters(), f"prediction-w{warmup}")
    assert opt.flush() == 1
    flushed = ref(predict=True, flush=True)
    for (name, p), r in zip(model.named_parameters(), flushed):
        assert torch.equal(p, r), f"flush(): {name} off the reference by {(p - r).abs().max()}"
    with opt.real_weights():  # nothing predicted after flush(): a no-op
        assert all(torch.equal(p, r) for p, r in zip(model.parameters(), flushed))
    passed(f"prediction-reference-warmup{warmup}")


check_rule(warmup=0)
check_rule(warmup=3)
