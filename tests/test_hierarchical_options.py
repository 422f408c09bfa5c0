"""``hierarchical=`` through PyTorch's DistributedOptimizer on in-process hosts: the training is
bitwise the plain rule with the hierarchical reference's averages (no engine code in the
reference); what each value of the argument does; errors that name the fix."""
import threading

import numpy as np
import pytest
import torch

import pipesgd_hvd.torch as psgd
from allreduce_reference import hierarchical_reference
from pipesgd_hvd.comm.topology import resolve_topology
from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.compression.allreduce import side_region
from pipesgd_hvd.ops.torch import TORCH_OPS
from pipesgd_hvd.testing import LocalCluster
from reference import loss_fn, make_batches, make_model
from threads import run_rank_threads

STEPS, LR = 6, 0.1


def train(cluster, name, hierarchical, width=2, steps=STEPS):
    batches = make_batches(steps, cluster.size)

    def rank_fn(rank):
        model = make_model(0)
        topo = cluster.topology(rank) if hierarchical == "topology" else hierarchical
        opt = psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                        named_parameters=model.named_parameters(), width=width,
                                        compression=name, communicator=cluster.world.communicator(rank),
                                        fusion_threshold_mb=0, hierarchical=topo)
        for t in range(steps):
            opt.zero_grad()
            loss_fn(model, batches[t][rank]).backward()
            opt.step()
        opt.flush()
        return [p.detach().clone() for p in model.parameters()], opt._core.engine

    return run_rank_threads(cluster.size, rank_fn, timeout=120), batches


def flagged(inputs, name):
    """Each rank's values with the membership flags the engine carries in a step's last bucket
    (here the first tensor's: buckets go in reverse order), in a codec block of their own."""
    size, n = len(inputs), inputs[0].size
    at, length = side_region(resolve_compression(name), n, size, size)
    out = []
    for rank, values in enumerate(inputs):
        row = np.zeros(length, np.float32)
        row[:n], row[at + rank] = values, 1.0  # every rank trains
        out.append(row)
    return out


def reference(name, hosts, per_host, batches, width=2, steps=STEPS):
    """Plain SGD under the width-K rule; each step's average is hierarchical_reference's, tensor by
    tensor (fusion_threshold_mb=0: one bucket per tensor), with error feedback by hand."""
    model = make_model(0)
    params = list(model.parameters())
    residuals = [dict() if name.startswith("int") else None for _ in params]
    pending = []
    for t in range(steps + width - 1):
        if t < steps:
            per_rank = []
            for rank in range(hosts * per_host):
                model.zero_grad()
                loss_fn(model, batches[t][rank]).backward()
                per_rank.append([p.grad.detach().reshape(-1).numpy().copy() for p in params])
            pending.append([torch.from_numpy(hierarchical_reference(
                name, flagged([g[i] for g in per_rank], name) if i == 0 else [g[i] for g in per_rank], hosts, per_host,
                residuals[i])[:p.numel()]).reshape(p.shape) for i, p in enumerate(params)])
        if len(pending) == width or (t >= steps and pending):
            with torch.no_grad():
                for p, g in zip(params, pending.pop(0)):
                    p.add_(g, alpha=-LR)  # what torch.optim.SGD does without momentum
    return [p.detach() for p in params]


@pytest.mark.parametrize("hosts,per_host", [(2, 2), (3, 2)])
@pytest.mark.parametrize("name", ["int8", "bf16"])
def test_training_equals_the_rule_with_the_hierarchical_averages(name, hosts, per_host):
    cluster = LocalCluster(hosts, per_host, TORCH_OPS)
    results, batches = train(cluster, name, "topology")
    expected = reference(name, hosts, per_host, batches)
    for weights, engine in results:
        assert engine.config.hierarchical == "float32" and engine.topology is not None
        for w, e in zip(weights, expected):
            assert torch.equal(w, e)


def test_width_1_applies_each_step_its_own_hierarchical_average():
    cluster = LocalCluster(2, 2, TORCH_OPS)
    results, batches = train(cluster, "int8", "topology", width=1)
    expected = reference("int8", 2, 2, batches, width=1)
    for weights, _ in results:
        for w, e in zip(weights, expected):
            assert torch.equal(w, e)


def test_what_each_value_does():
    cluster = LocalCluster(2, 2, TORCH_OPS)
    # a plain all-reduce has no stages to split: the groups are not even used
    (_, none_engine), *_ = train(cluster, "none", "topology", steps=2)[0]
    assert none_engine.config.hierarchical is None and none_engine.topology is None
    # False, and None on a communicator that cannot build groups (in-process ranks): flat
    for choice in (False, None):
        (_, engine), *_ = train(LocalCluster(2, 2, TORCH_OPS), "int8", choice, steps=2)[0]
        assert engine.config.hierarchical is None and engine.topology is None


def test_forcing_it_on_a_transport_that_cannot_build_groups_names_the_fix():
    cluster = LocalCluster(1, 1, TORCH_OPS)  # one rank: construction's own collectives need no peer
    for choice in (True, "bf16"):
        model = make_model(0)
        with pytest.raises(ValueError, match=f"hierarchical={choice!r} builds its node groups on the pipeline's own "
                                             "channel .* not on LocalCommunicator: leave communicator= out, pass "
                                             "hierarchical=False, or pass hierarchical=Topology"):
            psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                      named_parameters=model.named_parameters(), compression="int8",
                                      communicator=cluster.world.communicator(0), hierarchical=choice)


def test_bad_values_name_the_fix():
    comm = LocalCluster(1, 1, TORCH_OPS).world.communicator(0)
    model = make_model(0)
    with pytest.raises(ValueError, match="hierarchical must be None .*True, False, 'fp16', 'bf16'"):
        psgd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters(),
                                  compression="int8", communicator=comm, hierarchical="yes")
    with pytest.raises(ValueError, match="Topology of 2 x 2 ranks for a communicator of 1"):
        resolve_topology(LocalCluster(2, 2, TORCH_OPS).topology(0), comm)


@pytest.mark.parametrize("choice", [True, None])
def test_hosts_of_different_sizes(monkeypatch, choice):
    """Hosts a:2, b:1 (Horovod's numbers for them), on a stand-in for the channel: True raises on
    every rank, naming the fix; None stays flat on every rank (each decides from everyone's layout)."""
    from pipesgd_hvd.comm import topology
    from pipesgd_hvd.testing import LocalWorld
    from pipesgd_hvd.comm.topology import NodeLayout
    from threads import run_threads

    layouts = [NodeLayout(0, 2, 0, 2), NodeLayout(1, 2, 0, 1), NodeLayout(0, 1, 1, 2)]
    monkeypatch.setattr(topology, "_is_channel", lambda comm: True)
    monkeypatch.setattr(topology, "_horovod_layout", lambda required: layouts[threading_rank()])

    ranks = {}

    def threading_rank():
        return ranks[threading.get_ident()]

    def rank_fn(rank, comm):
        ranks[threading.get_ident()] = rank
        try:
            return resolve_topology(choice, comm)
        except ValueError as exc:
            return str(exc)

    results = run_threads(LocalWorld(3, TORCH_OPS), rank_fn)
    if choice is None:
        assert results == [None, None, None]
    else:
        assert all("hierarchical=True needs the same number of ranks on every host: the hosts hold different numbers "
                   "of ranks (local sizes [1, 2], cross sizes [1, 2]); launch as many ranks on every host" in r
                   and "or pass hierarchical=False" in r for r in results), results


@pytest.mark.parametrize("choices, settings, want", [
    ((True, None), ("int8", "int8"), "raises"),       # the argument differs: an error naming it on every rank
    ((None, None), ("none", "int8"), "flat"),         # the codec differs: flat, the pipeline's check names it
])
def test_ranks_set_up_differently_issue_the_same_collectives(monkeypatch, choices, settings, want):
    """Each rank gathers once whatever its own settings are, so none waits for a group only
    some of them build (the reliability test of mismatched settings hung here before)."""
    from pipesgd_hvd.comm import topology
    from pipesgd_hvd.testing import LocalWorld
    from pipesgd_hvd.comm.topology import NodeLayout
    from threads import run_threads

    monkeypatch.setattr(topology, "_is_channel", lambda comm: True)
    monkeypatch.setattr(topology, "_horovod_layout", lambda required: NodeLayout(0, 1, 0, 2))

    def rank_fn(rank, comm):
        try:
            return resolve_topology(choices[rank], comm, settings=settings[rank], wanted=settings[rank] != "none")
        except ValueError as exc:
            return str(exc)

    results = run_threads(LocalWorld(2, TORCH_OPS), rank_fn, timeout=30)
    if want == "flat":
        assert results == [None, None]
    else:
        assert all("hierarchical= differs across ranks (rank 0: True, rank 1: None)" in r for r in results), results
