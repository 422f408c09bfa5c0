"""Model-zoo shapes for the benchmarks, built locally with random weights (no download, no
torchvision or transformers): ResNet-50, BERT-base and GPT-2 small as ``torch.nn`` modules whose
parameter tensors have the published shapes, in the published order.

What decides a data-parallel step is the gradient: its bytes, how many tensors, their sizes and the
order backward hands them in (fusion buckets, the first bucket's wait, codec cost per element). The
layers here are written so that ``model.parameters()`` lists the same tensors, of the same numel,
in the same order as torchvision's ``resnet50()`` and Hugging Face's ``BertModel`` and
``GPT2LMHeadModel`` (tests/test_models.py checks the published counts). Linear layers keep
PyTorch's (out, in) layout where GPT-2's checkpoints store Conv1D's (in, out): the same numel.

Each model also has a forward pass (``benchmarks/step_time.py --model`` trains it for real on your
cluster) and the device step times the emulated-cluster study waits in its place
(``DEVICE_STEPS``: where each number comes from).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn


# ------------------------------------------------------------------------------------- ResNet-50
class Bottleneck(nn.Module):
    """torchvision's ResNet v1.5 bottleneck: stride on the 3x3 convolution, projection shortcut
    (``downsample``) registered after the main branch, as torchvision registers it."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.downsample = (nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
                           if stride != 1 or inplanes != out else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """ResNet-50 for 1000 classes: 25,557,032 parameters in 161 tensors (53 convolutions, 53 batch
    norms' weight and bias, the classifier's weight and bias)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        inplanes, stages = 64, []
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stage = [Bottleneck(inplanes, planes, stride)]
            inplanes = planes * Bottleneck.expansion
            stage += [Bottleneck(inplanes, planes) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2, padding=1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# -------------------------------------------------------------------------------------- BERT-base
class BertLayer(nn.Module):
    """One post-LN encoder layer, parameters in ``BertLayer``'s order: query, key, value, the
    attention output and its LayerNorm, the intermediate (GELU) and output dense, their LayerNorm."""

    def __init__(self, hidden: int, heads: int, inner: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.attention_output = nn.Linear(hidden, hidden)
        self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, inner)
        self.output = nn.Linear(inner, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = _attention(x, self.query(x), self.key(x), self.value(x), self.heads, causal=False)
        x = self.attention_norm(x + self.attention_output(a))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))


class BertBase(nn.Module):
    """BERT-base (uncased) encoder with its pooler, ``BertModel``'s parameters: 109,482,240 in 199
    tensors (word, position and token-type embeddings and their LayerNorm; 12 layers of 16; the pooler)."""

    def __init__(self, vocab: int = 30522, hidden: int = 768, layers: int = 12, heads: int = 12,
                 inner: int = 3072, positions: int = 512) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(positions, hidden)
        self.token_type_embeddings = nn.Embedding(2, hidden)
        self.embeddings_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.layer = nn.ModuleList(BertLayer(hidden, heads, inner) for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings(
            torch.zeros_like(ids))
        x = self.embeddings_norm(x)
        for layer in self.layer:
            x = layer(x)
        return torch.tanh(self.pooler(x[:, 0]))


# ------------------------------------------------------------------------------------ GPT-2 small
class GPT2Block(nn.Module):
    """One pre-LN decoder block, ``GPT2Block``'s order: ln_1, c_attn (query, key and value in one),
    c_proj, ln_2, the MLP's c_fc and c_proj."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.attn_proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.c_fc = nn.Linear(hidden, 4 * hidden)
        self.mlp_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        q, k, v = self.c_attn(h).chunk(3, dim=-1)
        x = x + self.attn_proj(_attention(h, q, k, v, self.heads, causal=True))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2Small(nn.Module):
    """GPT-2 small (124M) with its language-model head tied to the token embedding, as
    ``GPT2LMHeadModel``: 124,439,808 parameters in 148 tensors (wte, wpe, 12 blocks of 12, ln_f)."""

    def __init__(self, vocab: int = 50257, hidden: int = 768, layers: int = 12, heads: int = 12,
                 positions: int = 1024) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(positions, hidden)
        self.h = nn.ModuleList(GPT2Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # the tied head: wte's gradient comes last


def _attention(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
               causal: bool) -> torch.Tensor:
    b, t, c = x.shape
    split = lambda y: y.view(b, t, heads, c // heads).transpose(1, 2)  # noqa: E731
    out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=causal)
    return out.transpose(1, 2).reshape(b, t, c)


# ---------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class DeviceStep:
    """A published training step on one GPU: ``seconds`` for ``batch`` (forward, backward and
    update), and where the number comes from. The study splits it 1 : 2 into forward and backward
    (a backward pass computes two products per forward product: the input's and the weight's
    gradient)."""

    seconds: float
    batch: str
    source: str

    @property
    def forward_backward(self) -> Tuple[float, float]:
        return self.seconds / 3, 2 * self.seconds / 3


@dataclass(frozen=True)
class ZooModel:
    """One model of the zoo: how to build it, its published size, an input batch for a real forward
    pass (``inputs(batch, generator, size)``: ``size`` is the image side or the sequence length), and the
    device step the emulated-cluster study waits in place of its compute."""

    name: str
    build: Callable[[], nn.Module]
    parameters: int
    tensors: int
    inputs: Callable[[int, torch.Generator, int], torch.Tensor]
    default_size: int
    sizes: Tuple[int, int]  # the input sizes it takes: an image side >= 64 (2x2 in the last stage: batch norm needs more than one value), a sequence up to its positions
    device_step: DeviceStep


def _images(batch: int, generator: torch.Generator, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=generator)


def _tokens(vocab: int) -> Callable[[int, torch.Generator, int], torch.Tensor]:
    return lambda batch, generator, size: torch.randint(0, vocab, (batch, size), generator=generator)


MODELS: Dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("resnet50", ResNet50, 25_557_032, 161, _images, 224, (64, 4096), DeviceStep(
        0.104, "256 images of 224x224", "NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5 README, training "
        "performance on DGX A100 80GB: 2470 img/s on 1 GPU, mixed precision, 256 images per GPU (the recipe's "
        "batch): 256 / 2470 = 104 ms")),
    ZooModel("bert-base", BertBase, 109_482_240, 199, _tokens(30522), 128, (1, 512), DeviceStep(
        0.101, "32 sequences of 384 tokens", "NVIDIA DeepLearningExamples, TensorFlow2 ELECTRA README (ELECTRA-base's "
        "discriminator is BERT-base's encoder), SQuAD fine-tuning on DGX A100 40GB: 317 sequences/s on 1 GPU, "
        "mixed precision, 32 sequences of 384 tokens per GPU: 32 / 317 = 101 ms")),
    ZooModel("gpt2", GPT2Small, 124_439_808, 148, _tokens(50257), 1024, (1, 1024), DeviceStep(
        0.135, "12 sequences of 1024 tokens", "karpathy/nanoGPT README, efficiency notes: 135 ms per iteration with "
        "torch.compile, bench.py's defaults (12 sequences of 1024 tokens, bfloat16; the repository's GPT-2 runs "
        "are on A100 40GB)")),
)}


def names() -> Tuple[str, ...]:
    return tuple(MODELS)


def zoo(name: str) -> ZooModel:
    """The model named ``name``; an unknown name raises, naming the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def build(name: str, seed: int = 1) -> nn.Module:
    """``name``'s module with random weights (``seed``: the same weights for every copy)."""
    torch.manual_seed(seed)
    return zoo(name).build()


def layers(model: nn.Module) -> List[nn.Module]:
    """The modules that own ``model``'s parameters, in parameter order (a tied weight belongs to the
    first module that registers it): what ``benchmarks/offloaded_compute.py`` hands gradients to,
    one module after another, last first."""
    seen, out = set(), []
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        if own:
            seen.update(id(p) for p in own)
            out.append(module)
    return out


def parameter_specs(model: nn.Module) -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of every parameter, in order (a tied weight once)."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def sequence(names_: Sequence[str]) -> List[str]:
    """``names_`` checked and in the table's order (each may be a comma list)."""
    wanted = [n for part in names_ for n in part.split(",") if n]
    for n in wanted:
        zoo(n)
    return [n for n in MODELS if n in wanted]


__all__ = ["MODELS", "ZooModel", "DeviceStep", "build", "layers", "names", "parameter_specs", "zoo", "sequence",
           "gradient_bytes"]
