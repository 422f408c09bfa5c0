"""The accuracy study's language-model task: byte-level next-token prediction on Python's own
documentation text (``pydoc_data.topics.topics``, the text ``help()`` shows, about 466 KB of
UTF-8), with a tiny causal transformer.

Real text that ships with every Python, so the study needs no download. Byte-level (vocabulary
256) needs no tokenizer and no vocabulary built from the data, so the split cannot leak through
it. The split is deterministic: the topics concatenated in sorted key order, cut into blocks of
``BLOCK`` bytes, every ``HOLD_OUT``-th block held out for validation (in-distribution, the same
every run). Validation loss is the mean cross-entropy in nats per byte over fixed non-overlapping
windows of the held-out blocks; perplexity is its exponential. ::

    train, val = lm_data()
    model = TinyTransformer(seed=0)
    loss = val_loss(model, val_windows(val))
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np
import torch
from torch import nn

VOCAB = 256      # bytes
CONTEXT = 64     # tokens per training and validation window
BLOCK = 2048     # bytes per split block
HOLD_OUT = 25    # every 25th block is validation (4% of the text)
BATCH = 16       # windows per rank and step


def lm_data(block: int = BLOCK, hold_out: int = HOLD_OUT) -> Tuple[np.ndarray, np.ndarray]:
    """(train, validation) byte arrays (uint8), deterministic; see the module docstring."""
    from pydoc_data.topics import topics

    text = np.frombuffer("\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8"), dtype=np.uint8)
    blocks = [text[i:i + block] for i in range(0, len(text), block)]
    val = [b for i, b in enumerate(blocks) if i % hold_out == hold_out - 1]
    train = [b for i, b in enumerate(blocks) if i % hold_out != hold_out - 1]
    return np.concatenate(train), np.concatenate(val)


def train_batch(data: np.ndarray, batch: int, generator: torch.Generator,
                context: int = CONTEXT) -> Tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows at random offsets (from ``generator``): inputs and next-byte targets,
    each (batch, context) int64."""
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=generator)
    rows = torch.from_numpy(np.stack([data[s:s + context + 1] for s in starts.tolist()]).astype(np.int64))
    return rows[:, :-1], rows[:, 1:]


def val_windows(data: np.ndarray, context: int = CONTEXT) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every whole non-overlapping window of ``data``: inputs and targets, (n, context) int64."""
    n = (len(data) - 1) // context
    x = torch.from_numpy(data[:n * context].astype(np.int64)).view(n, context)
    y = torch.from_numpy(data[1:n * context + 1].astype(np.int64)).view(n, context)
    return x, y


class TinyTransformer(nn.Module):
    """A pre-norm causal transformer: byte and position embeddings, ``layers`` blocks of
    ``heads``-head self-attention and a GELU MLP (4 x ``dim``), a final LayerNorm and a linear
    head to 256 logits. Output (batch, time, 256). No dropout: the runs differ only by seed."""

    def __init__(self, seed: int, dim: int = 64, layers: int = 2, heads: int = 4, context: int = CONTEXT) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, dim)
        self.position = nn.Parameter(0.02 * torch.randn(context, dim))
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.position[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def val_loss(model: nn.Module, windows: Tuple[torch.Tensor, torch.Tensor], chunk: int = 256) -> float:
    """Mean cross-entropy (nats per byte) of ``model`` over ``windows``."""
    x, y = windows
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(x), chunk):
            logits = model(x[i:i + chunk])
            total += float(nn.functional.cross_entropy(logits.flatten(0, 1), y[i:i + chunk].flatten(),
                                                       reduction="sum"))
    return total / y.numel()


def perplexity(loss: float) -> float:
    return math.exp(loss)


class LanguageModel:
    """The study's view of this task on one rank (the same interface as the classification
    tasks' in ``benchmarks.accuracy``): ``steps`` per epoch, ``model(seed)``, ``batches(seed,
    epoch)`` and ``evaluate(model)`` (validation loss, lower is better). Each rank samples its
    windows from the whole training text with its own generator."""

    metric = "val_loss"

    def __init__(self, rank: int, steps: int, batch: int = BATCH) -> None:
        self.train, val = lm_data()
        self.windows = val_windows(val)
        self.rank, self.steps, self.batch = rank, steps, batch
        self.train_size, self.test_size = len(self.train), self.windows[1].numel()

    def model(self, seed: int) -> nn.Module:
        return TinyTransformer(seed)

    def batches(self, seed: int, epoch: int):
        generator = torch.Generator().manual_seed(10_000 * seed + 100 * epoch + self.rank)
        for _ in range(self.steps):
            yield train_batch(self.train, self.batch, generator)

    def evaluate(self, model: nn.Module) -> float:
        return val_loss(model, self.windows)
