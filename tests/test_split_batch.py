"""staleness_correction="split_batch", the accurate mode (one all-reduce per update, each rank's
look-ahead from its own gradient: pipesgd_hvd/staleness/split_batch.py), through the PyTorch
optimizer core on 2 and 3 in-process ranks, against a plain torch reference of the rule written
here without the engine (bitwise); and its pairing at width 1 and in warm-up, flush, checkpoints
mid-pair, real weights, replicas, a GradScaler, and refusals."""
import copy

import pytest
import torch

import pipesgd_hvd.torch as psgd
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.testing import LocalWorld
from reference import loss_fn, make_batches, make_model
from threads import run_threads

CALLS = 11  # odd: the run ends after a call A (a part kept), so flush() reduces it on its own
FRESH = 0.5


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)


def gradient_at(model, weights, batch):
    """The gradient of ``batch``'s loss at ``weights`` (written into ``model`` first)."""
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    model.zero_grad()
    loss_fn(model, batch).backward()
    return [p.grad.clone() for p in model.parameters()]


def average(per_rank):
    """Rank order, then 1/N: what an averaging all-reduce computes."""
    out = []
    for i in range(len(per_rank[0])):
        acc = per_rank[0][i].clone()
        for grads in per_rank[1:]:
            acc = acc + grads[i]
        out.append(acc * (1.0 / len(per_rank)))
    return out


def reference(make_inner, batches, calls, ranks, warmup=0, width=2, flush=True, fresh=FRESH):
    """The rule written out with plain torch: the real weights theta and one optimizer (its state
    s); per rank, the point its part A is computed at (its look-ahead, or theta). Calls pair up:
    A keeps its gradient and applies the update in flight; B averages (1 - f) g_A + f g_B over the
    ranks, which is reduced in flight while each rank steps from theta to its own look-ahead with
    its own sum, the optimizer's state put back afterwards (a deep copy of its state dict here).
    Synchronous pairs (warm-up updates, width 1) apply the average at B. Returns theta."""
    model = make_model()
    opt = make_inner(model.parameters())
    params = list(model.parameters())
    theta = [p.detach().clone() for p in params]
    points, kept, in_flight = None, None, None

    def step(grads):
        with torch.no_grad():
            for p, w, g in zip(params, theta, grads):
                p.copy_(w)
                p.grad = g.clone()
        opt.step()
        return [p.detach().clone() for p in params]

    for c in range(calls):
        update = c // 2
        if c % 2 == 0:  # part A
            kept = [[g * (1.0 - fresh) for g in gradient_at(model, points[r] if points else theta, batches[c][r])]
                    for r in range(ranks)]
            if in_flight is not None:
                theta = step(in_flight)
            points, in_flight = None, None
        else:           # part B, at theta
            local = [[a + g * fresh for a, g in zip(kept[r], gradient_at(model, theta, batches[c][r]))]
                     for r in range(ranks)]
            kept = None
            if width == 1 or update < warmup:
                theta = step(average(local))
                continue
            in_flight = average(local)
            points = []
            for r in range(ranks):
                state = copy.deepcopy(opt.state_dict())
                points.append(step(local[r]))
                opt.load_state_dict(state)
    if flush and in_flight is not None:
        theta = step(in_flight)
    elif flush and kept is not None:
        theta = step(average([[g * (1.0 / (1.0 - fresh)) for g in k] for k in kept]))
    return theta


def train_ranks(make_inner, calls=CALLS, ranks=2, flush=True, **options):
    world, batches = LocalWorld(ranks, TORCH_OPS), make_batches(calls, ranks)

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(make_inner(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=comm, staleness_correction="split_batch",
                                        **{"width": 2, **options})
        for t in range(calls):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
        if flush:
            opt.flush()
        with opt.real_weights():
            return [p.detach().clone() for p in model.parameters()]

    return run_threads(world, rank_fn), batches


def assert_same(got, want):
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g - w).abs().max()


def rmsprop(params):
    """No stateless form (torch/tensors.py's StatelessStep): the look-ahead saves and restores the state."""
    return torch.optim.RMSprop(params, lr=0.01, momentum=0.5)


@pytest.mark.parametrize("make_inner", [sgd, adamw, rmsprop], ids=["sgd-momentum", "adamw", "rmsprop-saved-state"])
@pytest.mark.parametrize("calls", [CALLS, CALLS + 1], ids=["ends-after-a", "ends-after-b"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_split_batch_matches_the_reference_rule(make_inner, calls, ranks):
    got, batches = train_ranks(make_inner, calls=calls, ranks=ranks)
    want = reference(make_inner, batches, calls, ranks)
    for weights in got:
        assert_same(weights, want)


def test_the_look_ahead_of_sgd_and_adam_copies_no_optimizer_state():
    """Their look-ahead is torch's own functional step on one parameter's state at a time: the
    optimizer's state is never saved whole (the reference rule above, bit for bit, shows the
    weights are as the saving path makes them)."""
    for make_inner, stateless in ((sgd, True), (adamw, True), (rmsprop, False)):
        model = make_model()
        opt = psgd.DistributedOptimizer(make_inner(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=LocalWorld(1, TORCH_OPS).communicator(0),
                                        staleness_correction="split_batch")
        correction = opt.core.correction
        assert (correction.stateless is not None, correction.snapshot is None) == (stateless, stateless)


def test_split_batch_is_not_plain_width_2_nor_acco():
    got, batches = train_ranks(adamw)
    world = LocalWorld(2, TORCH_OPS)

    def other(rank, comm, **options):
        model = make_model()
        opt = psgd.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=comm, width=2, **options)
        for t in range(CALLS):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
        opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    for options in ({}, {"staleness_correction": "acco"}):
        theirs = run_threads(world, lambda r, c: other(r, c, **options))[0]
        assert not all(torch.equal(a, b) for a, b in zip(got[0], theirs)), f"split_batch is {options}"


def test_warm_up_counts_updates_of_two_calls_each():
    got, batches = train_ranks(adamw, warmup_steps=2)
    assert_same(got[0], reference(adamw, batches, CALLS, 2, warmup=2))


def test_width_1_makes_each_pair_one_synchronous_update_of_the_whole_batch():
    """What a call means does not change with the width: at width 1 the pair is Horovod's
    synchronous update of both halves (the mean of the two parts)."""
    got, batches = train_ranks(sgd, calls=CALLS + 1, width=1)
    assert_same(got[0], reference(sgd, batches, CALLS + 1, 2, width=1))


def test_int8_replicas_stay_identical_and_the_look_aheads_differ():
    world, batches = LocalWorld(2, TORCH_OPS), make_batches(6, 2)

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=comm, width=2, staleness_correction="split_batch",
                                        compression=psgd.Compression.int8)
        for t in range(6):  # ends after a call B: the model holds this rank's look-ahead
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
        ahead = [p.detach().clone() for p in model.parameters()]
        with opt.real_weights():
            real = [p.detach().clone() for p in model.parameters()]
        opt.flush()
        return ahead, real, [p.detach().clone() for p in model.parameters()]

    (ahead0, real0, end0), (ahead1, real1, end1) = run_threads(world, rank_fn)
    assert_same(real0, real1)
    assert_same(end0, end1)
    assert not all(torch.equal(a, b) for a, b in zip(ahead0, ahead1)), "each rank's look-ahead is its own"


@pytest.mark.parametrize("correction", ["split_batch", "acco"])
def test_real_weights_shows_theta_and_puts_the_look_ahead_back(correction):
    """staleness/look_ahead.py, which both corrections share."""
    world, batches = LocalWorld(1, TORCH_OPS), make_batches(4, 1)
    model = make_model()
    opt = psgd.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                    communicator=world.communicator(0), width=2, staleness_correction=correction)
    for t in range(2):  # a pair (ACCO: fill, then a virtual step): the model holds the look-ahead
        opt.zero_grad()
        loss_fn(model, batches[t][0]).backward()
        opt.step()
    look_ahead = [p.detach().clone() for p in model.parameters()]
    real = [s.clone() for s in opt.core.correction.real]
    assert not all(torch.equal(a, b) for a, b in zip(look_ahead, real))
    with opt.real_weights():
        assert_same([p.detach() for p in model.parameters()], real)
        assert torch.is_grad_enabled()
    assert_same([p.detach() for p in model.parameters()], look_ahead)
    opt.flush()


@pytest.mark.parametrize("stop_at", [5, 6], ids=["after-a", "after-b"])
def test_checkpoint_mid_pair_resumes_bit_for_bit(tmp_path, stop_at):
    """After a call A (its part kept, this rank's own) or a call B (the look-ahead in the model,
    the update in flight), saved inside real_weights() even: the same weights as a run that never
    stopped, on both ranks."""
    world, batches = LocalWorld(2, TORCH_OPS), make_batches(10, 2)

    def rank_fn(rank, comm, stop=None, resume=None):
        model = make_model()
        opt = psgd.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=comm, width=2, staleness_correction="split_batch")
        start = 0
        if resume is not None:
            saved = torch.load(resume[rank], weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            start = saved["t"]
        for t in range(start, 10):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
            if t + 1 == stop:
                with opt.real_weights():
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "t": t + 1},
                               tmp_path / f"r{rank}.pt")
                return None
        opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    whole = run_threads(world, rank_fn)
    run_threads(LocalWorld(2, TORCH_OPS), lambda r, c: rank_fn(r, c, stop=stop_at))
    paths = [tmp_path / f"r{r}.pt" for r in range(2)]
    resumed = run_threads(LocalWorld(2, TORCH_OPS), lambda r, c: rank_fn(r, c, resume=paths))
    for got in resumed:
        assert_same(got, whole[0])


def test_a_flush_after_a_call_a_reduces_its_part_as_an_update_of_its_own():
    got, batches = train_ranks(sgd, calls=7)
    assert_same(got[0], reference(sgd, batches, 7, 2))
    assert_same(got[1], got[0])


@pytest.mark.parametrize("options, words", [
    ({"width": 3}, "needs width=2"),
    ({"fresh_fraction": 1.0}, "fresh_fraction must be a number between 0 and 1"),
])
def test_refusals_name_the_fix(options, words):
    model = make_model()
    with pytest.raises(ValueError, match=words):
        psgd.DistributedOptimizer(adamw(model.parameters()), named_parameters=model.named_parameters(),
                                  communicator=LocalWorld(1, TORCH_OPS).communicator(0),
                                  staleness_correction="split_batch", **{"width": 2, **options})


# ------------------------------------------------------------------------------ psgd.halves
def test_halves_splits_a_batch_along_the_first_axis_through_structures():
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    (xa, ya), (xb, yb) = list(psgd.halves(x, y))
    assert torch.equal(torch.cat([xa, xb]), x) and torch.equal(torch.cat([ya, yb]), y)
    assert len(xa) == 3 and len(xb) == 2, "an odd count gives the extra sample to the look-ahead part"
    a, b = list(psgd.halves({"ids": torch.zeros(8, 3), "mask": [torch.ones(8), torch.ones(8)]}))
    assert a["ids"].shape == (4, 3) and b["mask"][1].shape == (4,)
    quarter = [len(p) for p in psgd.halves(torch.zeros(8), fresh_fraction=0.25)]
    assert quarter == [6, 2]


@pytest.mark.parametrize("batch, words", [
    ((torch.zeros(1, 3),), "a batch of 1 sample"),
    ((torch.zeros(4), torch.zeros(5)), r"parts have \[4, 5\] samples"),
    ((torch.tensor(3.0),), "without one"),
])
def test_halves_names_what_cannot_be_split(batch, words):
    with pytest.raises(ValueError, match=words):
        list(psgd.halves(*batch))


def test_the_documented_loop_with_halves_trains_as_the_reference():
    """The one more line of docs/options.md: the loader's batches unchanged, each split by halves()."""
    world, batches = LocalWorld(2, TORCH_OPS), make_batches(6, 2)
    halved = [[None] * 2 for _ in range(12)]
    for t in range(6):
        for r in range(2):
            a, b = psgd.halves(*batches[t][r])
            halved[2 * t][r], halved[2 * t + 1][r] = a, b

    def rank_fn(rank, comm):
        model = make_model()
        opt = psgd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters(),
                                        communicator=comm, staleness_correction="split_batch")
        for t in range(6):
            for x, y in psgd.halves(*batches[t][rank]):
                opt.zero_grad()
                loss_fn(model, (x, y)).backward()
                opt.step()
        opt.flush()
        return [p.detach().clone() for p in model.parameters()]

    got = run_threads(world, rank_fn)
    assert_same(got[0], reference(sgd, halved, 12, 2))


def test_a_flush_in_warm_up_after_a_call_a_applies_its_part():
    """In warm-up a pair is one synchronous update; a run that ends after its first call still
    applies that part (the reduction ends at once in warm-up)."""
    got, batches = train_ranks(sgd, calls=5, warmup_steps=5)
    assert_same(got[0], reference(sgd, batches, 5, 2, warmup=5))
