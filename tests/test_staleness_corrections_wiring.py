"""staleness_correction="delay_compensation" / "eager" / "adam_prediction" through the optimizer
core, on 2 in-process ranks at width 2, against plain torch references of each corrected rule
(written out here, op for op, so the comparisons are bitwise); and the refusals."""
import copy

import pytest
import torch

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.testing import LocalWorld
from reference import loss_fn, make_batches, make_model, mean_gradient
from threads import run_threads

STEPS, LAM = 8, 0.5


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train_ranks(make_inner, steps=STEPS, ranks=2, width=2, **options):
    """Each rank's final weights after ``steps`` steps and flush()."""
    world, batches = LocalWorld(ranks, TORCH_OPS), make_batches(steps, ranks)

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(make_inner(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=comm, width=width, **options)
        for t in range(steps):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
        opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    return run_threads(world, rank_fn), batches


def assert_same(got, want):
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()


# ------------------------------------------------------------------------ delay compensation
def reference_dc(batches, steps, lam, warmup=0, width=2):
    """g + (g * g * (w_now - w_then)) * lam for each stale average; w_then: the weights its
    gradients were computed at. Synchronous (warm-up) steps apply their own gradient as it is."""
    model = make_model()
    opt = sgd(model.parameters())
    params = list(model.parameters())

    def apply(grads, w_then):
        with torch.no_grad():
            for p, g, wt in zip(params, grads, w_then):
                p.grad = g + (g * g * (p - wt)) * lam
        opt.step()

    queue = []  # (average, the weights it was computed at), oldest first
    for t in range(steps):
        w_now = [p.detach().clone() for p in params]
        mean = mean_gradient(model, batches[t])
        if t < warmup:
            for p, g in zip(params, mean):
                p.grad = g
            opt.step()
            continue
        if len(queue) == width - 1:
            apply(*queue.pop(0))
        queue.append((mean, w_now))
    for pending in queue:  # flush(): the weights now against each step's own
        apply(*pending)
    return [p.detach().clone() for p in params]


def test_delay_compensation_matches_the_reference_rule_on_two_ranks():
    got, batches = train_ranks(sgd, staleness_correction="delay_compensation", dc_lambda=LAM)
    want = reference_dc(batches, STEPS, LAM)
    for weights in got:
        assert_same(weights, want)
    plain = reference_dc(batches, STEPS, 0.0)
    assert not all(torch.equal(a, b) for a, b in zip(want, plain)), "the correction changed nothing"


def test_delay_compensation_at_width_3_keeps_two_weight_copies_apart():
    got, batches = train_ranks(sgd, width=3, staleness_correction="delay_compensation", dc_lambda=LAM)
    assert_same(got[1], reference_dc(batches, STEPS, LAM, width=3))


def test_delay_compensation_leaves_warm_up_steps_alone():
    got, batches = train_ranks(sgd, staleness_correction="delay_compensation", dc_lambda=LAM, warmup_steps=3)
    assert_same(got[0], reference_dc(batches, STEPS, LAM, warmup=3))


def test_delay_compensation_at_width_1_is_synchronous_bit_for_bit():
    world, batches = LocalWorld(1, TORCH_OPS), make_batches(4, 1)
    out = []
    for options in ({}, {"staleness_correction": "delay_compensation"}):
        model = make_model()
        opt = psgd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=world.communicator(0), width=1, **options)
        for t in range(4):
            opt.zero_grad()
            loss_fn(model, batches[t][0]).backward()
            opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    assert_same(*out)


# -------------------------------------------------------------------------------- eager
def reference_eager(batches, steps, ranks=2, width=2):
    """Each rank r: step t applies avg(s) + (l_r(t) - l_r(s)) * (1/N), s = t - width + 1, where
    l_r(s) counts only if step s applied it (a fill step does not); flush applies
    avg(s) + (0 - l_r(s)) * (1/N) for each step in flight. Replicas differ, so each rank's model
    is simulated with its own weights."""
    models = [make_model() for _ in range(ranks)]
    opts = [sgd(m.parameters()) for m in models]
    queue = []  # (avg, local per rank, whether that step applied its share), oldest first
    for t in range(steps):
        local = []
        for m, batch in zip(models, batches[t]):
            m.zero_grad()
            loss_fn(m, batch).backward()
            local.append([p.grad.clone() for p in m.parameters()])
        avg = [(a + b) * 0.5 for a, b in zip(*local)] if ranks == 2 else local[0]
        applies = len(queue) == width - 1
        if applies:
            stale_avg, stale_local, shared = queue.pop(0)
            for r, (m, opt) in enumerate(zip(models, opts)):
                stale = stale_local[r] if shared else [torch.zeros_like(a) for a in stale_avg]
                for p, a, f, s in zip(m.parameters(), stale_avg, local[r], stale):
                    p.grad = a + (f - s) * (1.0 / ranks)
                opt.step()
        queue.append((avg, local, applies))
    for stale_avg, stale_local, shared in queue:
        for r, (m, opt) in enumerate(zip(models, opts)):
            stale = stale_local[r] if shared else [torch.zeros_like(a) for a in stale_avg]
            for p, a, s in zip(m.parameters(), stale_avg, stale):
                p.grad = a + (torch.zeros_like(a) - s) * (1.0 / ranks)
            opt.step()
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def test_eager_matches_the_reference_rule_on_two_ranks():
    got, batches = train_ranks(sgd, staleness_correction="eager")
    want = reference_eager(batches, STEPS)
    for weights, ref in zip(got, want):
        assert_same(weights, ref)
    assert not all(torch.equal(a, b) for a, b in zip(got[0], got[1])), "each rank mixes its own gradient in"


def test_eager_at_width_3_matches_the_reference_rule():
    got, batches = train_ranks(sgd, width=3, staleness_correction="eager")
    for weights, ref in zip(got, reference_eager(batches, STEPS, width=3)):
        assert_same(weights, ref)


def test_eager_with_plain_sgd_ends_where_synchronous_would_be_near():
    """The local shares cancel at flush(): plain SGD ends close to stale SGD's own weights
    (not equal: the gradients were computed at weights that differ by a share)."""
    plain_sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    got, _ = train_ranks(plain_sgd, staleness_correction="eager")
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-3)  # replicas within O(lr^2 * grad) of each other


# ------------------------------------------------------------------------ adam prediction
def adam_direction_reference(opt, p):
    state, group = opt.state[p], opt.param_groups[0]
    step, (b1, b2) = int(state["step"]), group["betas"]
    m_hat = state["exp_avg"] * (1.0 / (1.0 - b1 ** step))
    v_hat = state["exp_avg_sq"] * (1.0 / (1.0 - b2 ** step))
    direction = m_hat * group["lr"] / (v_hat ** 0.5 + group["eps"])
    if isinstance(opt, torch.optim.AdamW) and group["weight_decay"]:
        direction = direction + p * (group["lr"] * group["weight_decay"])
    return direction


def reference_adam_prediction(make_inner, batches, steps):
    """Gradients computed at w - adam_direction(moments now) (at w before the first update)."""
    model = make_model()
    opt = make_inner(model.parameters())
    params = list(model.parameters())
    pending, predicted = None, [p.detach().clone() for p in params]
    for t in range(steps):
        real = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, q in zip(params, predicted):
                p.copy_(q)
        mean = mean_gradient(model, batches[t])
        with torch.no_grad():
            for p, r in zip(params, real):
                p.copy_(r)
        if pending is not None:
            for p, g in zip(params, pending):
                p.grad = g
            opt.step()
        pending = mean
        with torch.no_grad():
            predicted = [p - adam_direction_reference(opt, p) if p in opt.state else p.detach().clone()
                         for p in params]
    for p, g in zip(params, pending):
        p.grad = g
    opt.step()
    return [p.detach().clone() for p in params]


ADAMS = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
         "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}


@pytest.mark.parametrize("name", sorted(ADAMS))
def test_adam_prediction_matches_the_reference_rule_on_two_ranks(name):
    got, batches = train_ranks(ADAMS[name], staleness_correction="adam_prediction")
    want = reference_adam_prediction(ADAMS[name], batches, STEPS)
    for weights in got:
        assert_same(weights, want)


# ------------------------------------------------------------------------------ refusals
def wrap_one(inner=None, **options):
    model = make_model()
    inner = inner or sgd(model.parameters())
    return psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                     communicator=LocalWorld(1, TORCH_OPS).communicator(0), **options)


@pytest.mark.parametrize("options, message", [
    ({"staleness_correction": "delay"}, "staleness_correction must be False, True, 'auto' or 'acco' / "
                                        "'adam_prediction' / 'delay_compensation' / 'eager' / 'split_batch' / "
                                        "'weight_prediction', got 'delay'"),
    ({"staleness_correction": "delay_compensation", "dc_lambda": -1}, "dc_lambda must be a finite number >= 0"),
    ({"staleness_correction": "eager", "op": "sum"}, "needs op=hvd.Average .*drop op=hvd.Sum"),
    ({"staleness_correction": "eager", "check_replicas_every": 5}, "set check_replicas_every=0"),
    ({"staleness_correction": "delay_compensation", "width": "auto"}, "does not support width='auto'"),
    ({"staleness_correction": "adam_prediction"}, "the wrapped optimizer is SGD: wrap torch.optim.Adam or AdamW"),
])
def test_bad_combinations_are_refused_with_the_fix(options, message):
    with pytest.raises(ValueError, match=message):
        wrap_one(**options)


def test_grad_scaler_is_refused_with_gradient_corrections():
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="does not support grad_scaler"):
        wrap_one(staleness_correction="eager", grad_scaler=scaler)


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("kind", ["delay_compensation", "eager"])
def test_checkpoint_resumes_the_correction_exactly(kind):
    """Saved mid-run (the w_then copy / local share of the in-flight step in the one entry) and
    resumed: the same weights as the uninterrupted run."""
    world, batches = LocalWorld(1, TORCH_OPS), make_batches(STEPS, 1)
    comm = world.communicator(0)

    def build(model):
        return psgd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                         communicator=comm, width=2, staleness_correction=kind, dc_lambda=LAM)

    def train(opt, model, steps):
        for t in steps:
            opt.zero_grad()
            loss_fn(model, batches[t][0]).backward()
            opt.step()

    model = make_model()
    opt = build(model)
    train(opt, model, range(4))
    state, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())  # torch shares tensors
    assert state["pipesgd"]["corrections"]["kind"] == kind
    train(opt, model, range(4, STEPS))
    opt.flush()

    resumed_model = make_model(seed=9)
    resumed = build(resumed_model)
    resumed_model.load_state_dict(weights)
    resumed.load_state_dict(state)
    train(resumed, resumed_model, range(4, STEPS))
    resumed.flush()
    assert_same(list(resumed_model.parameters()), list(model.parameters()))


def test_a_checkpoint_with_correction_state_loaded_on_one_rank_only_is_refused_on_every_rank():
    """Horovod's load-on-rank-0-then-broadcast pattern cannot carry the per-rank correction state."""
    batches = make_batches(3, 2)
    model = make_model()
    solo = psgd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                     communicator=LocalWorld(1, TORCH_OPS).communicator(0), width=2,
                                     staleness_correction="delay_compensation")
    for t in range(2):
        solo.zero_grad()
        loss_fn(model, batches[t][0]).backward()
        solo.step()
    state = copy.deepcopy(solo.state_dict())

    def rank_fn(rank, comm):
        m = make_model()
        opt = psgd.DistributedOptimizer(sgd(m.parameters()), named_parameters=m.named_parameters(),
                                        communicator=comm, width=2, staleness_correction="delay_compensation")
        if rank == 0:
            opt.load_state_dict(state)
        opt.zero_grad()
        loss_fn(m, batches[2][rank]).backward()
        with pytest.raises(ValueError, match="load the same checkpoint on every rank"):
            opt.step()
        return True

    assert run_threads(LocalWorld(2, TORCH_OPS), rank_fn) == [True, True]
