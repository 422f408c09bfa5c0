"""The PyTorch adapter's contract with user code, on in-process ranks."""
import threading

import pytest
import torch

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.testing import LocalWorld
from reference import loss_fn, make_batches, make_model
from threads import run_threads


def one_rank():
    return LocalWorld(1, TORCH_OPS).communicator(0)


def wrap(model, comm=None, inner=None, **kw):
    inner = inner or torch.optim.SGD(model.parameters(), lr=0.1)
    return psgd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                     communicator=comm or one_rank(), **kw)


@pytest.mark.parametrize("make_inner", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
])
def test_any_optimizer_matches_the_same_optimizer_on_stale_mean_gradients(make_inner):
    """The wrapped optimizer sees exactly mean_i g_i(t-1) at step t (here through 2 ranks)."""
    world, batches = LocalWorld(2, TORCH_OPS), make_batches(12, 2)

    def rank_fn(rank, comm):
        model = make_model()
        opt = wrap(model, comm, make_inner(model.parameters()), width=2)
        for t in range(12):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    got = run_threads(world, rank_fn)
    ref_model, ref_inner = make_model(), None
    ref_inner = make_inner(ref_model.parameters())
    pending = None
    for t in range(12):
        grads = []
        for r in range(2):
            ref_model.zero_grad()
            loss_fn(ref_model, batches[t][r]).backward()
            grads.append([p.grad.clone() for p in ref_model.parameters()])
        mean = [(a + b) * 0.5 for a, b in zip(*grads)]
        if pending is not None:
            for p, g in zip(ref_model.parameters(), pending):
                p.grad = g
            ref_inner.step()
        pending = mean
    for weights in got:
        for w, r in zip(weights, ref_model.parameters()):
            assert torch.equal(w, r)


def test_lr_scheduler_param_groups_and_state_dict_are_the_wrapped_optimizers():
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = wrap(model, inner=inner)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    batches = make_batches(5, 1)
    for t in range(5):
        opt.zero_grad()
        loss_fn(model, batches[t][0]).backward()
        opt.step()
        sched.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)
    state = opt.state_dict()
    assert "pipesgd" in state and len(state["pipesgd"]["in_flight"]) == 1 and state["state"]


def test_gradient_clipping_with_synchronize_and_skip_synchronize():
    model = make_model()
    opt = wrap(model, width=1)
    loss_fn(model, make_batches(1, 1)[0][0]).backward()
    opt.synchronize()
    norm_before = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert norm_before > 1e-3
    total = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    assert total == pytest.approx(1e-3, rel=1e-4)
    before = [p.detach().clone() for p in model.parameters()]
    with opt.skip_synchronize():
        opt.step()
    moved = max((b - p).abs().max() for b, p in zip(before, model.parameters()))
    assert 0 < moved <= 0.1 * 1e-3 + 1e-9  # the clipped gradient was applied


def test_parameters_without_gradient_and_requires_grad_changes():
    """A parameter unused on one rank counts as a zero gradient there; a frozen parameter is not
    reduced and not updated; unfreezing it later works; replicas stay identical."""
    world, batches = LocalWorld(2, TORCH_OPS), make_batches(10, 2)

    seeding = threading.Lock()  # the global RNG is shared by the rank threads: seed and draw as one

    def rank_fn(rank, comm):
        with seeding:
            torch.manual_seed(0)
            body, head_a, head_b = torch.nn.Linear(6, 5), torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
        modules = torch.nn.ModuleDict({"body": body, "a": head_a, "b": head_b})
        opt = wrap(modules, comm, torch.optim.SGD(modules.parameters(), lr=0.1, momentum=0.9), width=2)
        frozen_b_before = None
        for t in range(10):
            if t == 3:
                head_b.weight.requires_grad_(False)
                head_b.bias.requires_grad_(False)
            if t == 4:
                frozen_b_before = head_b.weight.detach().clone()
            if t == 7:
                assert torch.equal(head_b.weight, frozen_b_before), "a frozen parameter must not move"
                head_b.weight.requires_grad_(True)
                head_b.bias.requires_grad_(True)
            opt.zero_grad()
            x, y = batches[t][rank]
            head = head_a if (rank == 0 or t % 2) else head_b  # rank 1 skips head_a on even steps
            loss = ((head(body(x)) - y) ** 2).mean()
            if head is head_b and not head_b.weight.requires_grad:
                loss = ((head_a(body(x)) - y) ** 2).mean()
            loss.backward()
            opt.step()
        opt.flush()
        return [p.detach().clone() for p in modules.parameters()]

    a, b = run_threads(world, rank_fn)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_errors_name_the_problem():
    model = make_model()
    with pytest.raises(ValueError, match="width must be an int >= 1"):
        wrap(model, width=0)
    with pytest.raises(ValueError, match="unknown compression 'zip'"):
        wrap(model, compression="zip")
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        wrap(model, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="Adasum"):
        wrap(model, op=psgd.Adasum)
    with pytest.raises(ValueError, match="not in it"):
        psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=list(model.named_parameters())[:1], communicator=one_rank())
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        psgd.DistributedOptimizer(model, communicator=one_rank())

    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = psgd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                    named_parameters=emb.named_parameters(), communicator=one_rank())
    with pytest.raises(ValueError, match="'weight' has a sparse gradient: pass sparse_as_dense=True"):
        emb(torch.tensor([1, 2])).sum().backward()

    model = make_model()
    opt = wrap(model)
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()
    loss_fn(model, make_batches(1, 1)[0][0]).backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()


def test_sparse_as_dense_trains():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = psgd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), named_parameters=emb.named_parameters(),
                                    communicator=one_rank(), sparse_as_dense=True, width=1)
    before = emb.weight.detach().clone()
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    changed = (emb.weight != before).any(dim=1)
    assert changed.tolist() == [i in (1, 2) for i in range(10)]


def test_broadcast_optimizer_state_style_initialisation_is_a_local_step():
    """hvd.broadcast_optimizer_state sets zero gradients and calls step() to create optimizer state."""
    model = make_model()
    opt = wrap(model, inner=torch.optim.Adam(model.parameters(), lr=0.1))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert len(opt.state) == len(list(model.parameters())) and opt.engine.step == 0


def test_amp_grad_scaler_stale_gradient_is_rescaled_by_the_ratio_of_loss_scales():
    """The loss scale doubles every step (growth_interval=1): the stale gradient was computed at half
    the current scale, and must be corrected, so the update equals plain SGD on stale gradients."""
    model, batches = make_model(), make_batches(8, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_factor=2.0, growth_interval=1)
    opt = wrap(model, width=2, grad_scaler=scaler)
    for t in range(8):
        opt.zero_grad()
        scaler.scale(loss_fn(model, batches[t][0])).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() > 2.0 ** 8  # it did grow, so the ratio mattered
    ref = make_model()
    pending = None
    for t in range(8):
        ref.zero_grad()
        loss_fn(ref, batches[t][0]).backward()
        if pending is not None:
            with torch.no_grad():
                for p, g in zip(ref.parameters(), pending):
                    p.add_(g, alpha=-0.1)
        pending = [p.grad.clone() for p in ref.parameters()]
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)  # scale, unscale by powers of 2: exact up to ulps


def test_grad_scaler_without_synchronize_is_a_clear_error():
    model = make_model()
    scaler = torch.amp.GradScaler("cpu")
    opt = wrap(model, grad_scaler=scaler)
    scaler.scale(loss_fn(model, make_batches(1, 1)[0][0])).backward()
    with pytest.raises(RuntimeError, match="call optimizer.synchronize\\(\\) before scaler.step"):
        scaler.step(opt)


def test_staleness_correction_argument_and_resuming_with_it_switched_on_or_off():
    with pytest.raises(ValueError, match="staleness_correction must be False, True, 'auto' or 'acco' / 'adam_prediction'"):
        wrap(make_model(), staleness_correction="yes")
    batches = make_batches(6, 1)

    def train(opt, model, steps):
        for t in range(steps):
            opt.zero_grad()
            loss_fn(model, batches[t][0]).backward()
            opt.step()

    model = make_model()
    opt = wrap(model, staleness_correction="weight_prediction")
    train(opt, model, 6)
    state = opt.state_dict()
    with opt.real_weights():
        real = [p.detach().clone() for p in model.parameters()]
    assert not all(torch.equal(p, r) for p, r in zip(model.parameters(), real)), "the model holds the prediction"

    # Resumed without the correction: the real weights go into the parameters.
    plain_model = make_model()
    plain_model.load_state_dict(model.state_dict())
    plain = wrap(plain_model)
    plain.load_state_dict(state)
    assert all(torch.equal(p, r) for p, r in zip(plain_model.parameters(), real))

    # A checkpoint without prediction state, loaded into an optimizer with the correction that has
    # been predicting already (width 1: nothing in flight, so loading is allowed): it starts
    # afresh from the weights as loaded; nothing of its old prediction state is used.
    sync_model = make_model()
    sync = wrap(sync_model, width=1)
    train(sync, sync_model, 3)
    loaded = [p.detach().clone() for p in sync_model.parameters()]
    again_model = make_model()
    again = wrap(again_model, width=1, staleness_correction=True)
    train(again, again_model, 2)
    again_model.load_state_dict(sync_model.state_dict())
    again.load_state_dict(sync.state_dict())
    with again.real_weights():
        assert all(torch.equal(p, r) for p, r in zip(again_model.parameters(), loaded))
    again.zero_grad()
    loss_fn(again_model, batches[3][0]).backward()
    again.step()
    sync_model.zero_grad()
    loss_fn(sync_model, batches[3][0]).backward()
    sync.step()  # the first step after a fresh start is computed at the loaded weights
    with again.real_weights():
        assert all(torch.equal(p, q) for p, q in zip(again_model.parameters(), sync_model.parameters()))


def test_checkpoint_entry_is_format_2_and_format_1_still_loads():
    """One versioned entry (pipesgd_hvd/optimizer/checkpoint.py); a checkpoint written before it (the
    auto and prediction parts in keys of their own) loads the same."""
    world, batches = LocalWorld(1, TORCH_OPS), make_batches(6, 1)
    comm = world.communicator(0)
    model = make_model()
    opt = wrap(model, comm, width=2, staleness_correction=True)
    for t in range(4):
        opt.zero_grad()
        loss_fn(model, batches[t][0]).backward()
        opt.step()
    state = opt.state_dict()
    entry = state["pipesgd"]
    saved = entry["corrections"]
    assert entry["format"] == 2 and saved["kind"] == "weight_prediction" and saved["started"] and entry["auto"] is None
    assert len(entry["in_flight"]) == 1 and entry["step"] == 4
    old = dict(state)  # format 1: the prediction's state (without a kind) in a key of its own
    old["pipesgd"] = {k: v for k, v in entry.items() if k not in ("auto", "prediction", "corrections")} | {"format": 1}
    old["pipesgd_prediction"] = {k: v for k, v in saved.items() if k not in ("kind", "real_weights")}

    def resume(saved):
        resumed_model = make_model()
        resumed = wrap(resumed_model, comm, width=2, staleness_correction=True)
        resumed_model.load_state_dict(model.state_dict())
        resumed.load_state_dict(saved)
        for t in range(4, 6):
            resumed.zero_grad()
            loss_fn(resumed_model, batches[t][0]).backward()
            resumed.step()
        resumed.flush()
        return [p.detach().clone() for p in resumed_model.parameters()]

    for a, b in zip(resume(state), resume(old)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="format 3"):
        resume({**state, "pipesgd": {**entry, "format": 3}})
