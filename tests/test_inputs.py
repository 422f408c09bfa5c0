"""Issue 40: the last inputs checked, on in-process ranks (LocalWorld).

* settings the engine does not use but whose mismatch drifts the replicas apart silently
  (``staleness_correction``, ``dc_lambda``, ``backward_passes_per_step``, ``sparse_as_dense``),
  and ``seed`` (documented as the same on every rank), are compared across ranks at construction;
* ``width`` has an upper bound;
* a parameter that two live pipelined optimizers train is refused (reduced and stepped twice);
* zero-size parameters train beside the others;
* a checkpoint's error-feedback residuals record whose they are, and a resume that cannot use
  them (another rank's file, another world size or fusion threshold) says why and restarts them.

Each check's test failed on the code before it (checked by reverting the check): the settings
were accepted, width=1000 built a pipeline, the shared parameter was stepped twice without a
word, and rank 1 loaded rank 0's residuals silently.
"""
import re
import warnings

import pytest
import torch

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.testing import LocalWorld
from pipesgd_hvd.ops.torch import TORCH_OPS
from reference import loss_fn, make_batches, make_model
from threads import run_threads


def two_ranks(fn, timeout=10.0):
    return run_threads(LocalWorld(2, TORCH_OPS, timeout=timeout), fn, timeout=4 * timeout)


def train(model, opt, steps, rank, batches):
    for t in range(steps):
        opt.zero_grad()
        loss_fn(model, batches[t][rank]).backward()
        opt.step()


# ------------------------------------------------------------------ settings compared across ranks
MISMATCHES = [
    # (rank 0's arguments, rank 1's, the entry named)
    ({"staleness_correction": False}, {"staleness_correction": "weight_prediction"},
     r"\('staleness_correction', None\), rank 1 has \('staleness_correction', 'weight_prediction'\)"),
    ({"staleness_correction": "delay_compensation", "dc_lambda": 0.5},
     {"staleness_correction": "delay_compensation", "dc_lambda": 1.0}, r"\('dc_lambda', 0.5\), rank 1 has \('dc_lambda', 1.0\)"),
    ({"backward_passes_per_step": 1}, {"backward_passes_per_step": 2},
     r"\('backward_passes_per_step', 1\), rank 1 has \('backward_passes_per_step', 2\)"),
    ({"sparse_as_dense": False}, {"sparse_as_dense": True}, r"\('sparse_as_dense', False\), rank 1 has \('sparse_as_dense', True\)"),
    ({"seed": 0}, {"seed": 7}, r"\('seed', 0\), rank 1 has \('seed', 7\)"),
]


@pytest.mark.parametrize("mine, theirs, named", MISMATCHES,
                         ids=["staleness_correction", "dc_lambda", "backward_passes_per_step", "sparse_as_dense", "seed"])
def test_a_setting_that_differs_across_ranks_is_refused_on_every_rank(mine, theirs, named):
    def fn(rank, comm):
        model = make_model()
        with pytest.raises(ValueError, match=r"settings differ across ranks at entry \d+: rank 0 has " + named) as raised:
            psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), communicator=comm,
                                      named_parameters=model.named_parameters(), **(mine if rank == 0 else theirs))
        return str(raised.value)

    messages = two_ranks(fn)
    assert messages[0] == messages[1]  # the same words on every rank


def test_equal_settings_still_train():
    def fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), communicator=comm,
                                        named_parameters=model.named_parameters(), seed=3, dc_lambda=0.5,
                                        staleness_correction="delay_compensation", backward_passes_per_step=1)
        train(model, opt, 4, rank, make_batches(4, 2))
        opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    a, b = two_ranks(fn)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------- width
@pytest.mark.parametrize("width", [9, 1000])
def test_a_width_past_the_bound_is_refused_with_the_staleness_it_would_cost(width):
    model = make_model()
    with pytest.raises(ValueError, match=rf"width={width} is more than 8: a width-K pipeline applies nothing for its "
                                         rf"first K - 1 steps.*\({width - 1} here\); use width=2"):
        psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                  communicator=LocalWorld(1, TORCH_OPS).communicator(0), width=width)
    psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                              communicator=LocalWorld(1, TORCH_OPS).communicator(0), width=8)  # the bound itself


# ------------------------------------------------------------------------ shared parameters
def one_rank():
    return LocalWorld(1, TORCH_OPS).communicator(0)


def test_a_parameter_two_live_optimizers_train_is_refused_naming_it():
    model = make_model()
    first = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), communicator=one_rank(),
                                      named_parameters=model.named_parameters())
    shared = model[2]  # the head: a GAN-like second optimizer over part of the same model
    second = psgd.DistributedOptimizer(torch.optim.SGD(shared.parameters(), lr=0.1), communicator=one_rank(),
                                       named_parameters=[(f"head.{n}", p) for n, p in shared.named_parameters()])
    batch = make_batches(1, 1)[0][0]
    with pytest.raises(ValueError, match=r"parameter '2\.(weight|bias)' is trained by 2 pipesgd_hvd "
                                         r"DistributedOptimizers at once \(as '2\.(weight|bias)', 'head\.(weight|bias)'\): "
                                         r"its gradient would be reduced twice and the parameter stepped twice"):
        loss_fn(model, batch).backward()  # (handed to the pipeline as each gradient is ready)
        first.step()
    del second


def test_an_optimizer_made_anew_over_the_same_parameters_and_disjoint_ones_are_accepted():
    model = make_model()
    batches = make_batches(3, 1)
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), communicator=one_rank(),
                                    named_parameters=model.named_parameters())
    train(model, opt, 1, 0, batches)
    opt.flush()
    # The notebook pattern: the old optimizer is still bound to `opt` while the new one is built.
    opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), communicator=one_rank(),
                                    named_parameters=model.named_parameters())
    train(model, opt, 2, 0, batches)
    other = make_model()
    body, head = other[0], other[2]
    a = psgd.DistributedOptimizer(torch.optim.SGD(body.parameters(), lr=0.1), communicator=one_rank(),
                                  named_parameters=body.named_parameters())
    b = psgd.DistributedOptimizer(torch.optim.SGD(head.parameters(), lr=0.1), communicator=one_rank(),
                                  named_parameters=head.named_parameters())
    for t in range(2):
        a.zero_grad()
        b.zero_grad()
        loss_fn(other, batches[t][0]).backward()
        a.step()
        b.step()


# --------------------------------------------------------------------- zero-size parameters
@pytest.mark.parametrize("codec, fusion_mb", [("none", 64), ("int8", 64), ("int8", 0), ("fp16", 0)])
def test_zero_size_parameters_train_beside_the_others(codec, fusion_mb):
    """Empty tensors (a Linear(3, 0), a (0,) bias) take part in every step and checkpoint; the
    others train as they would without them (exactly, where the bucket layout and so the
    stochastic rounding's seeds stay the same: fused buckets, or no stochastic codec)."""
    def fn(rank, comm, with_empty):
        w = torch.nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
        named = [("w", w)]
        if with_empty:
            named = [("empty.weight", torch.nn.Parameter(torch.zeros(0, 3)))] + named + \
                    [("empty.bias", torch.nn.Parameter(torch.zeros(0)))]
        opt = psgd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1), named_parameters=named,
                                        communicator=comm, compression=codec, fusion_threshold_mb=fusion_mb)
        data = torch.Generator().manual_seed(rank)
        for _ in range(5):
            opt.zero_grad()
            x = torch.randn(2, 4, generator=data)
            ((x @ w.t()).pow(2).sum() + sum(p.sum() for n, p in named if n != "w")).backward()
            opt.step()
        state = opt.state_dict()
        opt.flush()
        return w.detach().clone(), [tuple(p.shape) for _, p in named], state["pipesgd"]["step"]

    with_empty, without = two_ranks(lambda r, c: fn(r, c, True)), two_ranks(lambda r, c: fn(r, c, False))
    assert torch.equal(with_empty[0][0], with_empty[1][0])  # replicas equal
    assert with_empty[0][1] == [(0, 3), (3, 4), (0,)] and with_empty[0][2] == 5
    assert torch.isfinite(with_empty[0][0]).all()
    if codec != "int8" or fusion_mb:
        assert torch.equal(with_empty[0][0], without[0][0])


# ----------------------------------------------------------------------- checkpoint residuals
def _saved(size=2, fusion_mb=64):
    """Each rank's state_dict after 5 int8 steps (error-feedback residuals in it)."""
    def fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), communicator=comm,
                                        named_parameters=model.named_parameters(), compression="int8",
                                        fusion_threshold_mb=fusion_mb)
        train(model, opt, 5, rank, make_batches(5, size))
        return opt.state_dict()

    return run_threads(LocalWorld(size, TORCH_OPS, timeout=10.0), fn, timeout=40)


def _load(states, size=2, fusion_mb=64):
    """Each rank of a fresh world loads ``states[rank]``; returns (its residuals, its warnings)."""
    def fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), communicator=comm,
                                        named_parameters=model.named_parameters(), compression="int8",
                                        fusion_threshold_mb=fusion_mb)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.load_state_dict(states[rank])
        residuals = opt._core.engine.codec.state_dict()["residuals"]
        return residuals, [str(w.message) for w in caught if "residuals" in str(w.message)]

    return run_threads(LocalWorld(size, TORCH_OPS, timeout=10.0), fn, timeout=40)


def _same(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_residuals_record_their_rank_and_world_and_each_rank_resumes_its_own():
    saved = _saved()
    assert [s["pipesgd"]["residuals_of"] for s in saved] == [{"rank": 0, "size": 2}, {"rank": 1, "size": 2}]
    loaded = _load(saved)
    for rank, (residuals, said) in enumerate(loaded):
        assert said == [] and residuals and _same(residuals, saved[rank]["pipesgd"]["codec"]["residuals"])


def test_loading_rank_0s_file_on_every_rank_restarts_the_others_residuals_with_a_warning():
    saved = _saved()
    (zero, said0), (one, said1) = _load([saved[0], saved[0]])
    assert said0 == [] and _same(zero, saved[0]["pipesgd"]["codec"]["residuals"])
    assert not one, "rank 1 took rank 0's residuals"
    assert len(said1) == 1 and re.search(r"residuals were not loaded on rank 1: they are rank 0's, not this rank's "
                                         r"\(this rank loaded another rank's file.*They restart at zero", said1[0]), said1


def test_a_resume_in_another_world_size_or_with_another_fusion_threshold_says_so():
    saved = _saved()
    # three ranks resume a two-rank run (each from a file of the old world)
    for residuals, said in _load([saved[0], saved[1], saved[0]], size=3):
        assert not residuals and len(said) == 1
        assert "they were saved in a world of 2 ranks and this one has 3" in said[0], said
    for residuals, said in _load(saved, fusion_mb=0):
        assert not residuals and len(said) == 1
        assert re.search(r"saved with fusion_threshold_bytes=67108864 and this pipeline has 0", said[0]), said
