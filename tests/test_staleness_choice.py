"""staleness_correction="auto" (pipesgd_hvd/staleness/choice.py): the wrapped optimizer's family,
the one-call correction the rule gives it in PyTorch and Keras (never a mode that makes an update
of two calls), and the advice printed at construction."""
import warnings

import pytest
import torch

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.testing import LocalWorld
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.staleness import choice
from pipesgd_hvd.staleness.registry import correction_class
from pipesgd_hvd.torch.checks import optimizer_family
from reference import make_model


class MyAdamW(torch.optim.AdamW):
    """A user's subclass keeps its torch base class's family."""


@pytest.mark.parametrize("make, family", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "sgd"),
    (lambda p: torch.optim.AdamW(p, lr=1e-3), "adam"),
    (lambda p: MyAdamW(p, lr=1e-3), "adam"),
    (lambda p: torch.optim.NAdam(p, lr=1e-3, decoupled_weight_decay=True), "adaptive"),
    (lambda p: torch.optim.RMSprop(p, lr=1e-3), "adaptive"),
    (lambda p: torch.optim.Rprop(p, lr=1e-3), "other"),
])
def test_torch_optimizer_families(make, family):
    assert optimizer_family(make(make_model().parameters())) == family


def _build(make_inner, correction="auto", **options):
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = psgd.DistributedOptimizer(make_inner(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=LocalWorld(1, TORCH_OPS).communicator(0),
                                        staleness_correction=correction, **options)
    advice = [str(w.message) for w in caught if issubclass(w.category, choice.AccuracyWarning)]
    return opt, advice


def _resolved(make_inner, **options):
    return _build(make_inner, **options)[0].core.options.staleness_correction


@pytest.mark.parametrize("family, make", [("adam", lambda p: torch.optim.AdamW(p, lr=1e-3)),
                                          ("adaptive", lambda p: torch.optim.NAdam(p, lr=1e-3)),
                                          ("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
                                          ("other", lambda p: torch.optim.Rprop(p, lr=1e-3))])
def test_auto_follows_the_rule_for_each_family(family, make):
    assert _resolved(make) == choice.RULE[family]


@pytest.mark.parametrize("family", choice.FAMILIES)
def test_auto_never_picks_a_mode_of_two_calls_per_update(family):
    """A loop left as it was must keep its meaning: one call, one update."""
    for picked in (choice.RULE[family], choice.FALLBACK[family]):
        assert correction_class(picked).calls_per_update == 1


def test_auto_falls_back_where_the_rule_s_correction_cannot_run():
    """adam_prediction reads Adam's moments through the wrapped optimizer; the fallback of the adam
    family runs with the settings that refuse... none today, so the rule is checked as a function."""
    assert choice.choose("adam", lambda name: name != "adam_prediction") == choice.FALLBACK["adam"]
    assert choice.choose("sgd", lambda name: False) is None


def test_keras_optimizer_families():
    keras = pytest.importorskip("keras")
    from pipesgd_hvd.keras.optimizer import optimizer_family as keras_family

    assert [keras_family(o) for o in (keras.optimizers.SGD(), keras.optimizers.AdamW(), keras.optimizers.Nadam(),
                                      keras.optimizers.Lion())] == ["sgd", "adam", "adaptive", "other"]


def test_a_bad_value_names_auto_among_the_choices():
    with pytest.raises(ValueError, match="'auto'"):
        psgd.DistributedOptimizer(
            torch.optim.SGD(make_model().parameters(), lr=0.1), communicator=LocalWorld(1, TORCH_OPS).communicator(0),
            staleness_correction="automatic")


# --------------------------------------------------------------------------------- the advice
def test_adamw_pipelined_without_the_accurate_mode_is_told_the_gap_and_the_fix():
    _, advice = _build(lambda p: torch.optim.AdamW(p, lr=1e-3), correction=False)
    assert len(advice) == 1
    assert "+21% perplexity" in advice[0] and "staleness_correction='split_batch'" in advice[0]
    assert "psgd.halves(x, y)" in advice[0] and "batch_size" in advice[0]


def test_auto_says_what_it_chose_and_what_that_cost():
    _, advice = _build(lambda p: torch.optim.AdamW(p, lr=1e-3))
    assert len(advice) == 1 and "'adam_prediction' (chosen by 'auto')" in advice[0] and "+5.6%" in advice[0]


def test_split_batch_says_that_two_calls_make_an_update():
    _, advice = _build(lambda p: torch.optim.AdamW(p, lr=1e-3), correction="split_batch")
    assert len(advice) == 1 and "two optimizer steps make one update" in advice[0]
    assert "half the updates, each of twice the batch" in advice[0]


def test_sgd_pipelined_is_told_what_the_study_lost_at_4_ranks():
    _, advice = _build(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert len(advice) == 1 and "'weight_prediction' (chosen by 'auto')" in advice[0]
    assert "up to 70 points lower at 4" in advice[0] and "staleness_correction='split_batch'" in advice[0]
    _, advice = _build(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), width="auto")
    assert len(advice) == 1 and "width='auto' (which may pipeline it)" in advice[0]


@pytest.mark.parametrize("make, options", [(lambda p: torch.optim.Rprop(p, lr=1e-3), {}),
                                           (lambda p: torch.optim.AdamW(p, lr=1e-3), {"width": 1})],
                         ids=["unmeasured-family", "adamw-synchronous"])
def test_no_advice_where_nothing_is_known_to_be_lost(make, options):
    assert _build(make, correction=False, **options)[1] == []
