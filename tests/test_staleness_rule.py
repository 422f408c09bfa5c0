"""staleness_correction="auto": the wrapped optimizer's family, and the correction the rule of
staleness/rule.py gives it, in PyTorch and Keras."""
import pytest
import torch

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.staleness import rule
from pipesgd_hvd.testing import LocalWorld
from pipesgd_hvd.torch.checks import optimizer_family
from reference import make_model


class MyAdamW(torch.optim.AdamW):
    """A user's subclass keeps its torch base class's family."""


@pytest.mark.parametrize("make, family", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "sgd"),
    (lambda p: torch.optim.AdamW(p, lr=1e-3), "adaptive"),
    (lambda p: MyAdamW(p, lr=1e-3), "adaptive"),
    (lambda p: torch.optim.NAdam(p, lr=1e-3, decoupled_weight_decay=True), "adaptive"),
    (lambda p: torch.optim.RMSprop(p, lr=1e-3), "adaptive"),
    (lambda p: torch.optim.Rprop(p, lr=1e-3), "other"),
])
def test_torch_optimizer_families(make, family):
    assert optimizer_family(make(make_model().parameters())) == family


def _resolved(make_inner, **options):
    model = make_model()
    opt = psgd.DistributedOptimizer(make_inner(model.parameters()), named_parameters=model.named_parameters(),
                                    communicator=LocalWorld(1, TORCH_OPS).communicator(0),
                                    staleness_correction="auto", **options)
    return opt.core.options.staleness_correction


def test_auto_gives_adamw_the_split_batch_rule():
    assert _resolved(lambda p: torch.optim.AdamW(p, lr=1e-3)) == "split_batch"


@pytest.mark.parametrize("family, make", [("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
                                          ("other", lambda p: torch.optim.Rprop(p, lr=1e-3))])
def test_auto_follows_the_rule_for_each_family(family, make):
    assert _resolved(make) == rule.RULE[family]


@pytest.mark.parametrize("options", [dict(width="auto"), dict(compression="auto"), dict(width=3),
                                     dict(grad_scaler=torch.amp.GradScaler("cpu"))],
                         ids=["width-auto", "compression-auto", "width-3", "grad-scaler"])
def test_auto_falls_back_where_the_rule_s_correction_cannot_run(options):
    """The rule's split_batch refuses these settings by name; "auto" must not: it takes the
    fallback, which runs with all of them."""
    got = _resolved(lambda p: torch.optim.AdamW(p, lr=1e-3), **options)
    assert got == rule.FALLBACK["adaptive"] != rule.RULE["adaptive"]


def test_auto_keeps_the_rule_where_it_runs_synchronously():
    assert _resolved(lambda p: torch.optim.AdamW(p, lr=1e-3), width=1) == rule.RULE["adaptive"]


def test_a_named_correction_that_cannot_run_still_raises():
    with pytest.raises(ValueError, match="split_batch.*width=3"):
        _named("split_batch", width=3)
    with pytest.raises(ValueError, match="does not support grad_scaler"):
        _named("split_batch", grad_scaler=torch.amp.GradScaler("cpu"))


def _named(correction, **options):
    model = make_model()
    return psgd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                     named_parameters=model.named_parameters(),
                                     communicator=LocalWorld(1, TORCH_OPS).communicator(0),
                                     staleness_correction=correction, **options)


def test_keras_optimizer_families():
    keras = pytest.importorskip("keras")
    from pipesgd_hvd.tensorflow.optimizer import optimizer_family as keras_family

    assert [keras_family(o) for o in (keras.optimizers.SGD(), keras.optimizers.AdamW(), keras.optimizers.Nadam(),
                                      keras.optimizers.Lion())] == ["sgd", "adaptive", "adaptive", "other"]


def test_a_bad_value_names_auto_among_the_choices():
    with pytest.raises(ValueError, match="'auto'"):
        psgd.DistributedOptimizer(
            torch.optim.SGD(make_model().parameters(), lr=0.1), communicator=LocalWorld(1, TORCH_OPS).communicator(0),
            staleness_correction="automatic")
