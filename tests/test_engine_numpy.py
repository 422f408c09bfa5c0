"""The framework-free layers on numpy alone: :class:`PipelineEngine` and :class:`OptimizerCore` over
``NumpyOps`` and in-process ranks, against a plain numpy reference of the update rule.

No framework is imported here: passing proves the engine and the core need none. Every
comparison is bitwise: the in-process all-reduce sums in rank order and scales by 1/size, and the
reference does the same float32 operations, so a wrong width, warm-up, flush order or a step
applied twice or never changes the weights.
"""
import contextlib
import pickle

import numpy as np
import pytest

from pipesgd_hvd.compression import resolve_compression
from pipesgd_hvd.compression.allreduce import compressed_allreduce, side_region
from pipesgd_hvd.ops.numpy import NUMPY_OPS
from pipesgd_hvd.optimizer.core import OptimizerCore
from pipesgd_hvd.optimizer.options import OptimizerOptions
from pipesgd_hvd.pipeline.config import PipelineConfig
from pipesgd_hvd.pipeline.engine import PipelineEngine
from pipesgd_hvd.pipeline.fusion import TensorSpec
from pipesgd_hvd.testing import LocalWorld
from counting_ops import CountingOps
from threads import run_threads

SHAPES = [(3, 4), (5,), (2, 2, 2)]
SPECS = [TensorSpec(f"t{i}", shape, "float32") for i, shape in enumerate(SHAPES)]
SIZE, STEPS, LR = 2, 9, np.float32(0.5)
THRESHOLD = 64  # bytes: the three tensors go to three buckets


def gradient(step, rank, i, w):
    """A quadratic loss's gradient at the weights ``w``: when a gradient is computed matters, so
    applying the right gradients at the wrong steps changes the result."""
    rng = np.random.default_rng([step, rank, i])
    return (w * rng.uniform(0.5, 1.5, SHAPES[i]) + rng.standard_normal(SHAPES[i])).astype(np.float32)


def mean_gradients(step, weights):
    return [(gradient(step, 0, i, w) + gradient(step, 1, i, w)) * np.float32(1.0 / SIZE) for i, w in enumerate(weights)]


def sgd_(weights, grads):
    for w, g in zip(weights, grads):
        w[...] = w - LR * g


def reference(width, warmup, steps, flush):
    """The rule: step t < warmup applies its own mean gradient; later steps queue theirs and apply
    the one ``width - 1`` steps older; flush applies what is queued, oldest first."""
    weights = [np.ones(s, np.float32) for s in SHAPES]
    pending, applied = [], 0
    for t in range(steps):
        if t < warmup:
            sgd_(weights, mean_gradients(t, weights))
            applied += 1
            continue
        pending.append(mean_gradients(t, weights))
        if len(pending) == width:
            sgd_(weights, pending.pop(0))
            applied += 1
    if flush:
        for grads in pending:
            sgd_(weights, grads)
            applied += 1
    return weights, applied


def make_engine(comm, width, warmup, first_step=0):
    config = PipelineConfig(width=width, warmup_steps=warmup, fusion_threshold_bytes=THRESHOLD, name="np")
    return PipelineEngine(SPECS, ops=NUMPY_OPS, comm=comm, codec=resolve_compression("none"), config=config,
                          first_step=first_step)


def run_engine(width, warmup, steps, flush, restart_at=None):
    def rank_fn(rank, comm):
        engine = make_engine(comm, width, warmup)
        weights = [np.ones(s, np.float32) for s in SHAPES]
        applied = 0
        for t in range(steps):
            if t == restart_at:  # a checkpoint written to disk and loaded by a fresh engine
                saved = pickle.dumps(engine.state_dict())
                engine.close()
                engine = make_engine(comm, width, warmup)
                engine.load_state_dict(pickle.loads(saved))
            engine.begin_step(range(len(SPECS)))
            for i in reversed(range(len(SPECS))):
                engine.add_gradient_(i, gradient(t, rank, i, weights[i]))
            for step in engine.end_step():
                sgd_(weights, [step.grads[i] for i in range(len(SPECS))])
                applied += 1
        if flush:
            for step in engine.flush():
                sgd_(weights, [step.grads[i] for i in range(len(SPECS))])
                applied += 1
        engine.close()
        return weights, applied

    return run_threads(LocalWorld(SIZE, NUMPY_OPS), rank_fn)


CASES = [(1, 0), (2, 0), (3, 0), (2, 3), (3, 2)]


@pytest.mark.parametrize("width,warmup", CASES)
@pytest.mark.parametrize("flush", [False, True])
def test_engine_follows_the_rule_bitwise(width, warmup, flush):
    want, count = reference(width, warmup, STEPS, flush)
    for weights, applied in run_engine(width, warmup, STEPS, flush):
        assert applied == count
        for w, r in zip(weights, want):
            assert np.array_equal(w, r)


@pytest.mark.parametrize("width,warmup", [(2, 0), (3, 2)])
def test_engine_state_dict_round_trip_resumes_exactly(width, warmup):
    want, _ = reference(width, warmup, STEPS, flush=True)
    for weights, _ in run_engine(width, warmup, STEPS, flush=True, restart_at=5):
        for w, r in zip(weights, want):
            assert np.array_equal(w, r)


class NumpyAdapter:
    """A framework of numpy arrays and plain SGD behind the optimizer core's adapter interface."""

    ops = NUMPY_OPS

    def __init__(self):
        self.params = [np.ones(s, np.float32) for s in SHAPES]
        self.grads = [None] * len(SHAPES)
        self.updates = 0
        self.ready = None

    def tensor_specs(self):
        return list(SPECS)

    def device_anchors(self):
        return {}

    def trainable(self):
        return list(range(len(SHAPES)))

    def has_local_gradient(self, index):
        return self.grads[index] is not None

    def local_gradient(self, index):
        return self.grads[index]

    def write(self, update):
        if update is None:  # nothing to apply while the pipeline fills
            for g in self.grads:
                if g is not None:
                    g[...] = 0
            return
        self.grads = [None if update.grads.get(i) is None else np.array(update.grads[i]) * update.scale
                      for i in range(len(SHAPES))]

    def apply(self, update, check_finite):
        if update is not None:
            self.write(update)
        sgd_(self.params, self.grads)
        self.updates += 1
        return True

    def loss_scale(self):
        return None

    def gradients_all_zero(self):
        return False

    def optimizer_has_state(self):
        return False  # plain SGD keeps none

    def weights(self):
        return self.params

    weights_guard = contextlib.nullcontext

    def replica_fingerprints(self):
        return [(s.name, p) for s, p in zip(SPECS, self.params)]

    def optimizer_state_dict(self):
        return {"updates": self.updates}

    def load_optimizer_state_dict(self, state):
        self.updates = state["updates"]

    def watch_gradients(self, ready):
        self.ready = ready

    def unwatch_gradients(self):
        self.ready = None

    def backward(self, step, rank, passes=1):
        """The framework's backward pass: gradients accumulate and each reports when produced."""
        for k in range(passes):
            for i in reversed(range(len(SHAPES))):
                g = gradient(step * passes + k, rank, i, self.params[i])
                self.grads[i] = g if self.grads[i] is None else self.grads[i] + g
                self.ready(i)

    def zero_grad(self):
        self.grads = [None] * len(SHAPES)


def step(core, adapter):
    """What a framework's step() does with the core (torch/distributed_optimizer.py's, less its checks)."""
    adapter.write(core.synchronize(adapter.loss_scale()))
    if not core.apply_pending:
        core.no_update()
        return
    with core.updating():
        sgd_(adapter.params, adapter.grads)
        adapter.updates += 1


def run_core(width, warmup, steps, flush, restart_at=None):
    options = OptimizerOptions.from_arguments(width=width, warmup_steps=warmup, fusion_threshold_mb=THRESHOLD / 2**20)

    def rank_fn(rank, comm):
        adapter = NumpyAdapter()
        core = OptimizerCore(options, [s.name for s in SPECS], adapter, comm)
        for t in range(steps):
            if t == restart_at:  # a fresh optimizer over the same arrays loads the checkpoint
                saved = pickle.loads(pickle.dumps((adapter.optimizer_state_dict(), core.state_dict())))
                params = adapter.params
                adapter = NumpyAdapter()
                adapter.params = params
                core = OptimizerCore(options, [s.name for s in SPECS], adapter, comm)
                adapter.load_optimizer_state_dict(saved[0])
                core.load_state_dict(saved[1])
            adapter.zero_grad()
            adapter.backward(t, rank)
            step(core, adapter)
        if flush:
            core.flush()
        return adapter.params, adapter.updates

    return run_threads(LocalWorld(SIZE, NUMPY_OPS), rank_fn)


@pytest.mark.parametrize("width,warmup", CASES)
@pytest.mark.parametrize("flush", [False, True])
def test_optimizer_core_follows_the_rule_bitwise(width, warmup, flush):
    """The whole policy (hooks, fill steps that apply nothing, warm-up, flush) with no framework."""
    want, count = reference(width, warmup, STEPS, flush)
    for params, updates in run_core(width, warmup, STEPS, flush):
        assert updates == count
        for p, r in zip(params, want):
            assert np.array_equal(p, r)


def test_optimizer_core_checkpoint_resumes_exactly():
    want, count = reference(2, 0, STEPS, flush=True)
    for params, updates in run_core(2, 0, STEPS, flush=True, restart_at=4):
        assert updates == count
        for p, r in zip(params, want):
            assert np.array_equal(p, r)


@pytest.mark.parametrize("codec", ["int8", "fp16"])
def test_byte_codec_buckets_are_reduced_where_they_lie(codec):
    """A byte codec's buckets sit in buffers with the room their compressed all-reduce's rows take,
    so no step copies a bucket into a padded one; the averages are those of the bucket reduced
    bare (the compressed all-reduce's own padding), error feedback carried across the steps."""
    steps = 4
    grads = {(t, r, i): gradient(t, r, i, np.ones(SHAPES[i], np.float32))
             for t in range(steps) for r in range(SIZE) for i in range(len(SPECS))}

    def engine_fn(rank, comm):
        ops = CountingOps()
        config = PipelineConfig(width=2, warmup_steps=0, fusion_threshold_bytes=THRESHOLD, name="np")
        engine = PipelineEngine(SPECS, ops=ops, comm=comm, codec=resolve_compression(codec), config=config)
        applied = []
        for t in range(steps):
            engine.begin_step(range(len(SPECS)))
            for i in reversed(range(len(SPECS))):
                engine.add_gradient_(i, grads[t, rank, i])
            applied += engine.end_step()
        applied += engine.flush()
        engine.close()
        return [{i: g.copy() for i, g in a.grads.items()} for a in applied], ops.concatenated

    def bare_fn(rank, comm):
        ops, reducer = CountingOps(), resolve_compression(codec)
        config = PipelineConfig(width=2, warmup_steps=0, fusion_threshold_bytes=THRESHOLD, name="np")
        buckets = PipelineEngine(SPECS, ops=NUMPY_OPS, comm=comm, codec=reducer, config=config).layout_for(
            range(len(SPECS))).buckets
        out = []
        for t in range(steps):
            averaged = {}
            for b in buckets:  # each bucket's members in their order, bare: the all-reduce pads them
                flat = np.concatenate([grads[t, rank, m.index].reshape(-1) for m in b.members])
                numel = None
                if b is buckets[-1]:  # the last one carries the membership flags, in a block of their own
                    at, numel = side_region(reducer, b.numel, SIZE, SIZE)
                    flat = np.concatenate([flat, np.zeros(numel - b.numel, np.float32)])
                    flat[at + rank] = 1.0
                reduced, _ = compressed_allreduce(ops, comm, reducer, flat, name=f"{t}.{b.index}", key=f"b{b.index}",
                                                  seed=0, numel=numel)
                averaged.update({m.index: reduced[m.offset:m.offset + m.numel].reshape(SHAPES[m.index])
                                 for m in b.members})
            out.append(averaged)
        return out, ops.concatenated

    engine_runs = run_threads(LocalWorld(SIZE, NUMPY_OPS), engine_fn)
    bare_runs = run_threads(LocalWorld(SIZE, NUMPY_OPS), bare_fn)
    for (got, copied), (want, copied_bare) in zip(engine_runs, bare_runs):
        assert copied_bare > 0  # the tensors' sizes need padding
        assert copied == 0
        assert len(got) == steps
        for g, w in zip(got, want):
            for i in range(len(SPECS)):
                assert np.array_equal(g[i], w[i])
