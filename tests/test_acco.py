"""staleness_correction="acco" (ACCO) through the PyTorch optimizer core, on 2 in-process
ranks, against a plain torch reference of the rule written here without the engine (bitwise), at
widths 1 and 2; and its flush, checkpoint, real weights and refusals."""
import copy

import pytest
import torch

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.testing import LocalWorld
from pipesgd_hvd.ops.torch import TORCH_OPS
from reference import loss_fn, make_batches, make_model, mean_gradient
from threads import run_threads

CALLS = 9  # odd: the run ends after a virtual step, so flush() applies a real one


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)


def reference_split(make_inner, batches, calls, warmup=0, flush=True):
    """Final weights of the rule run from the start (see :func:`run_reference`)."""
    model = make_model()
    run_reference(model, make_inner(model.parameters()), batches[:calls], warmup, flush)
    return [p.detach().clone() for p in model.parameters()]


def run_reference(model, opt, batches, warmup=0, flush=True):
    """The rule of pipesgd_hvd/staleness/acco.py, written out with plain torch on ``model``
    and ``opt``: every call's averaged gradient is applied by the next call, alternately by a
    virtual step from theta_t (the optimizer's state put back afterwards: a deep copy of its state
    dict here) and by the real step from theta_t with the mean of both halves. Warm-up calls apply
    their own gradient; flush applies the real step, or a lone look-ahead half as it is."""
    params = list(model.parameters())
    real, first, pending = None, None, None

    def update(grads):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()

    def apply(avg):
        nonlocal real, first
        with torch.no_grad():
            if real is None:  # virtual: theta_t kept aside, the optimizer's state undone
                real, first = [p.detach().clone() for p in params], avg
                state = copy.deepcopy(opt.state_dict())
                update(avg)
                opt.load_state_dict(state)
            else:             # real: from theta_t with (avg A + avg B) / 2
                for p, w in zip(params, real):
                    p.copy_(w)
                update([(a + b) * 0.5 for a, b in zip(first, avg)])
                real = None

    for t, batch in enumerate(batches):
        mean = mean_gradient(model, batch)  # at the weights the model holds now
        if t < warmup:
            update(mean)
            continue
        if pending is not None:
            apply(pending)
        pending = mean
    if flush and pending is not None:
        if real is None:
            update(pending)
        else:
            apply(pending)


def train_ranks(make_inner, calls=CALLS, ranks=2, width=2, flush=True, **options):
    world, batches = LocalWorld(ranks, TORCH_OPS), make_batches(calls, ranks)

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(make_inner(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=comm, width=width, staleness_correction="acco",
                                        **options)
        for t in range(calls):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
        if flush:
            opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    return run_threads(world, rank_fn), batches


def assert_same(got, want):
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()


@pytest.mark.parametrize("make_inner", [sgd, adamw], ids=["sgd-momentum", "adamw"])
@pytest.mark.parametrize("calls", [CALLS, CALLS + 1], ids=["ends-after-virtual", "ends-after-real"])
def test_acco_matches_the_reference_rule_on_two_ranks(make_inner, calls):
    got, batches = train_ranks(make_inner, calls=calls)
    want = reference_split(make_inner, batches, calls)
    for weights in got:
        assert_same(weights, want)


def test_acco_differs_from_plain_width_2():
    got, batches = train_ranks(adamw)
    world = LocalWorld(2, TORCH_OPS)

    def plain(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=comm, width=2)
        for t in range(CALLS):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
        opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    delayed = run_threads(world, plain)[0]
    assert not all(torch.equal(a, b) for a, b in zip(got[0], delayed)), "acco changed nothing"


def test_acco_leaves_warm_up_calls_synchronous():
    got, batches = train_ranks(adamw, warmup_steps=3)
    assert_same(got[0], reference_split(adamw, batches, CALLS, warmup=3))


def test_acco_at_width_1_is_synchronous_bit_for_bit():
    world, batches = LocalWorld(2, TORCH_OPS), make_batches(5, 2)

    def rank_fn(rank, comm, **options):
        model = make_model()
        opt = psgd.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=comm, width=1, **options)
        for t in range(5):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    plain = run_threads(world, rank_fn)
    split = run_threads(LocalWorld(2, TORCH_OPS), lambda r, c: rank_fn(r, c, staleness_correction="acco"))
    assert_same(split[0], plain[0])
    assert_same(split[1], plain[0])


def test_a_flush_mid_training_ends_the_pair_and_training_goes_on():
    """flush() after call 5 (a virtual step in flight: its real step is applied), then 4 more calls
    from a fresh pipeline, against the reference run as two runs back to back."""
    world, batches = LocalWorld(2, TORCH_OPS), make_batches(9, 2)

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=comm, width=2, staleness_correction="acco")
        for t in range(9):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
            if t == 4:
                assert opt.flush() == 1
        opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    got = run_threads(world, rank_fn)
    model = make_model()
    opt = adamw(model.parameters())
    run_reference(model, opt, batches[:5])  # the first run ends with flush(), as above
    run_reference(model, opt, batches[5:])
    assert_same(got[0], [p.detach().clone() for p in model.parameters()])


def test_checkpoint_mid_pair_resumes_bit_for_bit(tmp_path):
    """A checkpoint after a virtual step (the model holds the look-ahead, avg B in flight), saved
    inside real_weights() even, resumes to the same weights as an uninterrupted run."""
    world, batches = LocalWorld(1, TORCH_OPS), make_batches(8, 1)

    def run(stop_at=None, resume=None):
        model = make_model()
        opt = psgd.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=world.communicator(0), width=2,
                                        staleness_correction="acco")
        start = 0
        if resume is not None:
            model.load_state_dict(resume["model"])
            opt.load_state_dict(resume["opt"])
            start = resume["t"]
        for t in range(start, 8):
            opt.zero_grad()
            loss_fn(model, batches[t][0]).backward()
            opt.step()
            if t + 1 == stop_at:
                with opt.real_weights():
                    saved = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
                             "t": t + 1}
                return saved
        opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    whole = run()
    saved = run(stop_at=4)  # calls 0..3: the last one, call 3, made a virtual step
    assert saved["opt"]["pipesgd"]["corrections"]["active"]
    torch.save(saved, tmp_path / "ckpt.pt")
    assert_same(run(resume=torch.load(tmp_path / "ckpt.pt", weights_only=False)), whole)


def test_int8_replicas_stay_identical():
    got, _ = train_ranks(adamw, compression=psgd.Compression.int8)
    assert_same(got[0], got[1])


@pytest.mark.parametrize("options, words", [
    ({"width": 3}, "needs width=2"),
    ({"width": "auto"}, "does not support width='auto'"),
    ({"grad_scaler": torch.amp.GradScaler("cpu")}, "does not support grad_scaler"),
])
def test_acco_refusals_name_the_fix(options, words):
    model = make_model()
    world = LocalWorld(1, TORCH_OPS)
    with pytest.raises(ValueError, match=words):
        psgd.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                  communicator=world.communicator(0), staleness_correction="acco",
                                  **{"width": 2, **options})
