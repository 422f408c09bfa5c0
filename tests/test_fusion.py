"""Closed-form tests of the fusion plan (pipesgd_hvd/pipeline/fusion.py): which tensors share a bucket."""
from __future__ import annotations

import random
from typing import List, Sequence

import pytest

from pipesgd_hvd.pipeline.fusion import (DEFAULT_FUSION_THRESHOLD, FIRST_BUCKET_BYTES, SPREAD, FusionLayout, TensorSpec,
                                bucket_targets, plan_buckets)

KIB = 1024
MIB = 1024 * KIB


def linear_stack(layers: int, dim: int) -> List[TensorSpec]:
    """``layers`` x Linear(dim, dim) in registration order (weight, bias), as the benchmark's model."""
    specs = []
    for i in range(layers):
        specs += [TensorSpec(f"{i}.weight", (dim, dim), "float32"), TensorSpec(f"{i}.bias", (dim,), "float32")]
    return specs


def reverse(specs: Sequence[TensorSpec]) -> List[int]:
    return list(range(len(specs)))[::-1]


def names(layout: FusionLayout, specs: Sequence[TensorSpec]) -> List[List[str]]:
    return [[specs[m.index].name for m in b.members] for b in layout.buckets]


def counts(layout: FusionLayout) -> List[int]:
    return [len(b.members) for b in layout.buckets]


def test_targets_are_capped_by_the_threshold() -> None:
    assert bucket_targets(100 * MIB, DEFAULT_FUSION_THRESHOLD) == (FIRST_BUCKET_BYTES, 25 * MIB)
    assert bucket_targets(100 * MIB, 2 * MIB) == (MIB, 2 * MIB)
    assert bucket_targets(100 * MIB, 512 * KIB) == (512 * KIB, 512 * KIB)
    # a small gradient: later buckets are never smaller than the first
    assert bucket_targets(2 * MIB, DEFAULT_FUSION_THRESHOLD) == (MIB, MIB)
    assert bucket_targets(10, 0) == (0, 0)


def test_benchmark_model_gets_one_bucket_per_layer_in_backward_order() -> None:
    # 4 x Linear(1024, 1024): 16.8 MB; the first bucket passes 1 MiB with layer 3's weight, each
    # later one reaches a quarter of the gradient with one layer's bias and weight.
    specs = linear_stack(4, 1024)
    layout = plan_buckets(specs, reverse(specs))
    assert names(layout, specs) == [[f"{i}.bias", f"{i}.weight"] for i in (3, 2, 1, 0)]


def test_a_small_model_stays_one_bucket() -> None:
    specs = linear_stack(3, 64)  # 50 KB, under the first target
    assert counts(plan_buckets(specs, reverse(specs))) == [6]


def test_first_bucket_small_then_a_share_of_the_gradient() -> None:
    # 64 tensors of 256 KiB (16 MiB): the first bucket closes at 1 MiB (4 tensors), the later
    # ones at 16 MiB / SPREAD = 4 MiB (16 tensors); the rest goes in the last one.
    assert SPREAD == 4
    specs = [TensorSpec(f"t{i}", (64 * KIB,), "float32") for i in range(64)]
    layout = plan_buckets(specs, reverse(specs))
    assert counts(layout) == [4, 16, 16, 16, 12]
    assert [m.index for m in layout.buckets[0].members] == [63, 62, 61, 60]  # the first ready


def test_threshold_stays_a_hard_cap() -> None:
    specs = [TensorSpec(f"t{i}", (64 * KIB,), "float32") for i in range(64)]  # 256 KiB each
    assert counts(plan_buckets(specs, reverse(specs), 2 * MIB)) == [4] + [8] * 7 + [4]
    # a tensor over the cap goes alone, and does not join the bucket that was open
    big = [TensorSpec("a", (KIB,), "float32"), TensorSpec("big", (MIB,), "float32"), TensorSpec("b", (KIB,), "float32")]
    assert names(plan_buckets(big, [0, 1, 2], 2 * MIB), big) == [["a"], ["big"], ["b"]]


def test_threshold_zero_is_one_bucket_per_tensor() -> None:
    specs = linear_stack(2, 8)
    assert counts(plan_buckets(specs, reverse(specs), 0)) == [1, 1, 1, 1]


def test_groups_by_dtype_and_device_with_their_own_targets() -> None:
    specs = [TensorSpec("h0", (MIB,), "float16"), TensorSpec("f0", (16,), "float32"),
             TensorSpec("h1", (MIB,), "float16"), TensorSpec("f1", (16,), "float32"),
             TensorSpec("g0", (16,), "float32", "cuda:0")]
    layout = plan_buckets(specs, [0, 1, 2, 3, 4])
    # each float16 tensor (2 MiB) fills a bucket; the float32 ones stay together (tiny group)
    assert names(layout, specs) == [["h0"], ["f0", "f1"], ["h1"], ["g0"]]
    assert [(b.dtype, b.device) for b in layout.buckets] == [("float16", "cpu"), ("float32", "cpu"),
                                                               ("float16", "cpu"), ("float32", "cuda:0")]


@pytest.mark.parametrize("seed", range(20))
def test_random_plans_are_complete_contiguous_capped_and_deterministic(seed: int) -> None:
    rng = random.Random(seed)
    dtypes = ("float32", "float16")
    specs = [TensorSpec(f"p{i}", (rng.choice([1, 7, 1000, 70_000, 300_000, 1_500_000]),), rng.choice(dtypes))
             for i in range(rng.randint(1, 40))]
    order = list(range(len(specs)))
    rng.shuffle(order)
    threshold = rng.choice([0, 100_000, MIB, 3 * MIB, DEFAULT_FUSION_THRESHOLD])
    layout = plan_buckets(specs, order, threshold)
    assert sorted(layout.placement) == sorted(order)
    # buckets in the order their first tensor becomes ready; members in ready order
    firsts = [order.index(b.members[0].index) for b in layout.buckets]
    assert firsts == sorted(firsts)
    for b in layout.buckets:
        assert [order.index(m.index) for m in b.members] == sorted(order.index(m.index) for m in b.members)
        assert [m.offset for m in b.members] == [sum(x.numel for x in b.members[:k]) for k in range(len(b.members))]
        assert {specs[m.index].dtype for m in b.members} == {b.dtype}
        nbytes = sum(specs[m.index].nbytes for m in b.members)
        assert len(b.members) == 1 or nbytes <= threshold
    again = plan_buckets(list(specs), list(order), threshold)
    assert again == layout and again.key == layout.key and again.placement == layout.placement


def test_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="fusion threshold must be >= 0"):
        plan_buckets(linear_stack(1, 4), [1, 0], -1)
