"""benchmarks/models.py: the model-zoo shapes the benchmarks run (no download). Each model must
have the published parameter count, in the published number of tensors, in the published order
(what fusion buckets and hook order see), layers that own every parameter once, a forward pass
that gives every parameter a gradient, and a device step time whose source is named."""
from __future__ import annotations

import pytest
import torch

from benchmarks import models

# torchvision resnet50(); Hugging Face BertModel (bert-base-uncased, with its pooler); GPT2LMHeadModel
# (gpt2, head tied to wte). Counts as `sum(p.numel() for p in model.parameters())` prints them.
PUBLISHED = {"resnet50": (25_557_032, 161), "bert-base": (109_482_240, 199), "gpt2": (124_439_808, 148)}
# the first and last tensors, by shape, in the published order
ENDS = {"resnet50": [(64, 3, 7, 7), (64,), (64,), (64, 64, 1, 1)], "bert-base": [(30522, 768), (512, 768), (2, 768), (768,)],
        "gpt2": [(50257, 768), (1024, 768), (768,), (768,)]}
TAILS = {"resnet50": [(2048,), (2048,), (1000, 2048), (1000,)], "bert-base": [(768,), (768,), (768, 768), (768,)],
         "gpt2": [(768, 3072), (768,), (768,), (768,)]}


@pytest.fixture(scope="module", params=list(PUBLISHED))
def built(request):
    return request.param, models.build(request.param)


def test_published_parameter_counts_tensors_and_order(built):
    name, model = built
    params = list(model.parameters())
    assert (sum(p.numel() for p in params), len(params)) == PUBLISHED[name]
    assert (models.zoo(name).parameters, models.zoo(name).tensors) == PUBLISHED[name]
    shapes = [s for _, s in models.parameter_specs(model)]
    assert shapes[:4] == ENDS[name] and shapes[-4:] == TAILS[name]
    assert models.gradient_bytes(model) == 4 * PUBLISHED[name][0]


def test_layers_own_every_parameter_once_in_parameter_order(built):
    _, model = built
    owned = [p for layer in models.layers(model) for p in layer.parameters(recurse=False)]
    assert [id(p) for p in owned] == [id(p) for p in model.parameters()]


def test_a_forward_pass_gives_every_parameter_a_gradient(built):
    name, model = built
    spec = models.zoo(name)
    x = spec.inputs(2, torch.Generator().manual_seed(0), 64 if name == "resnet50" else 8)
    model(x).float().square().mean().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_device_steps_name_their_source_and_split_one_to_two():
    for spec in models.MODELS.values():
        step = spec.device_step
        assert 0.05 < step.seconds < 1.0 and step.source and step.batch
        forward, backward = step.forward_backward
        assert forward + backward == pytest.approx(step.seconds) and backward == pytest.approx(2 * forward)


def test_unknown_models_are_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'resnet18'; known: resnet50, bert-base, gpt2"):
        models.zoo("resnet18")
    assert models.sequence(["gpt2,resnet50"]) == ["resnet50", "gpt2"]
