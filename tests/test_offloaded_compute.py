"""benchmarks/offloaded_compute.py: the stand-in for compute on an accelerator that
`benchmarks/throughput.py --offload-compute` times pipesgd against. It must look like a backward
pass to the hooks (each layer's gradients after its slice, last layer first), give every step the
same gradients through autograd's own copy into `.grad`, and wait without holding the core."""
from __future__ import annotations

import time

import pytest
import torch

from benchmarks.offloaded_compute import OffloadedCompute


def model(layers: int = 3, dim: int = 8) -> list:
    torch.manual_seed(0)
    return [torch.nn.Linear(dim, dim) for _ in range(layers)]


def test_gradients_arrive_layer_by_layer_last_first_each_after_its_slice():
    layers = model(3)
    off = OffloadedCompute(layers, forward_s=0.0, backward_s=0.09)
    arrivals = []
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            p.register_post_accumulate_grad_hook(lambda _p, i=i: arrivals.append((i, time.perf_counter() - start)))
    loss = off.loss(layers)
    start = time.perf_counter()
    loss.backward()
    assert [i for i, _ in arrivals] == [2, 2, 1, 1, 0, 0]
    # a layer's gradients come after its slice and every slice after it: layer i after (3 - i) slices,
    # one slice after the layer above it (a sleep never ends early)
    for i, after in arrivals:
        assert after >= (3 - i) * 0.03 * 0.99, (i, after)
    first = {i: after for i, after in reversed(arrivals)}
    assert first[1] - first[2] >= 0.03 * 0.99 and first[0] - first[1] >= 0.03 * 0.99, first


def test_each_step_copies_the_same_fixed_gradients_into_grad():
    layers = model(2)
    off = OffloadedCompute(layers, forward_s=0.0, backward_s=0.0)
    params = [p for layer in layers for p in layer.parameters()]
    fixed = [g for grads in off.grads for g in grads]
    kept = [g.clone() for g in fixed]
    opt = torch.optim.SGD(params, lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        off.loss(layers).backward()
        for p, g in zip(params, fixed):
            assert torch.equal(p.grad, g) and p.grad.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
        opt.step()
        for p in params:
            p.grad.mul_(2.0)  # the job's own use of .grad does not reach the fixed tensors
    assert all(torch.equal(g, k) for g, k in zip(fixed, kept))


def test_the_waits_hold_no_core():
    layers = model(2)
    off = OffloadedCompute(layers, forward_s=0.1, backward_s=0.1)
    cpu, wall = time.thread_time(), time.perf_counter()
    off.loss(layers).backward()  # autograd runs a CPU backward on this thread
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    assert wall >= 0.2 * 0.99 and cpu < 0.5 * wall, (cpu, wall)


def test_bad_times_and_another_models_layers_are_refused():
    with pytest.raises(ValueError, match="device times must be >= 0, got forward -0.1 s"):
        OffloadedCompute(model(1), forward_s=-0.1, backward_s=0.0)
    with pytest.raises(ValueError, match="no layers"):
        OffloadedCompute([], forward_s=0.0, backward_s=0.0)
    with pytest.raises(ValueError, match="built for 2 layers, given 3"):
        OffloadedCompute(model(2), forward_s=0.0, backward_s=0.0).loss(model(3))
