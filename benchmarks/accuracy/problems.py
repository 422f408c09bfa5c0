"""The study's data and models, each behind one interface (``updates`` per segment, ``model(seed)``,
``batches(seed, segment)``, ``evaluate(model)``, ``metric``).

* ``digits``: sklearn's 8x8 digits (ships with scikit-learn), an MLP 64-128-10.
* ``shapes``: 16x16 images of 8 shape classes at random positions, sizes and intensities under
  Gaussian noise, generated from a fixed seed (translation-invariant features: a small CNN).
* ``stdlib``: byte-level next-byte prediction on the standard library's own source: the top-level
  ``*.py`` files of ``sysconfig.get_paths()["stdlib"]`` in sorted name order, joined by a newline
  (4.7 MB on Python 3.11; the record keeps its SHA-256). Every 20th block of 4 KiB is held out.
* ``pydoc``: the same on ``pydoc_data.topics`` (the text ``help()`` shows, 466 KB), every 25th
  block of 2 KiB held out: the stress task's data, unchanged.

Byte-level (vocabulary 256) needs no tokenizer, so nothing built from the data can leak the split.
"""
from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path
from typing import Iterator, Tuple

import numpy as np
import torch
from torch import nn

Batch = Tuple[torch.Tensor, torch.Tensor]
CONTEXT = 64           # bytes per window
VAL_WINDOWS = 512      # stdlib: validation windows evaluated (evenly spaced), to bound the evaluation's time
SPLITS = {"stdlib": (4096, 20), "pydoc": (2048, 25)}   # (block bytes, every n-th block held out)


# ------------------------------------------------------------------------------------ text
def stdlib_text() -> bytes:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: p.name)
    return b"\n".join(p.read_bytes() for p in files)


def pydoc_text() -> bytes:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def split_blocks(text: bytes, block: int, hold_out: int) -> Tuple[np.ndarray, np.ndarray]:
    """(train, validation) uint8 arrays: the text cut into ``block``-byte blocks, every
    ``hold_out``-th (the last of each run of ``hold_out``) to validation, order kept."""
    data = np.frombuffer(text, dtype=np.uint8)
    starts = range(0, len(data), block)
    val = [data[s:s + block] for s in starts if (s // block) % hold_out == hold_out - 1]
    train = [data[s:s + block] for s in starts if (s // block) % hold_out != hold_out - 1]
    return np.concatenate(train), np.concatenate(val)


def val_windows(data: np.ndarray, limit: int = 0, context: int = CONTEXT) -> Batch:
    """Non-overlapping windows of ``data`` (inputs, next-byte targets; (n, context) int64); with
    ``limit``, that many of them, evenly spaced."""
    n = (len(data) - 1) // context
    rows = np.arange(n) if not limit or limit >= n else np.linspace(0, n - 1, limit).round().astype(int)
    idx = rows[:, None] * context + np.arange(context + 1)[None, :]
    windows = torch.from_numpy(data[idx].astype(np.int64))
    return windows[:, :-1], windows[:, 1:]


class Transformer(nn.Module):
    """Pre-norm causal transformer: byte and learned position embeddings, ``layers`` blocks
    (``heads``-head attention, GELU MLP 4 x ``dim``), final LayerNorm, a linear head to 256 logits.
    No dropout: runs differ only by seed."""

    def __init__(self, seed: int, dim: int, layers: int, heads: int, context: int = CONTEXT) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(256, dim)
        self.position = nn.Parameter(0.02 * torch.randn(context, dim))
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.blocks(self.embed(tokens) + self.position[:t], mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


class LanguageModel:
    """One rank's view: ``batches(seed, segment)`` draws ``updates`` batches of ``batch`` windows at
    random offsets of the training text (a generator per seed, segment and rank); ``evaluate`` is
    the mean cross-entropy in nats per byte over the validation windows (lower is better)."""

    metric = "val_loss"

    def __init__(self, name: str, rank: int, batch: int, updates: int, model: dict) -> None:
        text = stdlib_text() if name == "stdlib" else pydoc_text()
        self.sha256 = hashlib.sha256(text).hexdigest()
        self.train, val = split_blocks(text, *SPLITS[name])
        self.windows = val_windows(val, VAL_WINDOWS if name == "stdlib" else 0)
        self.rank, self.batch, self.updates, self.shape = rank, batch, updates, model
        self.train_size, self.test_size = len(self.train), self.windows[1].numel()

    def model(self, seed: int) -> nn.Module:
        return Transformer(seed, **self.shape)

    def batches(self, seed: int, segment: int) -> Iterator[Batch]:
        generator = torch.Generator().manual_seed(10_000 * seed + 100 * segment + self.rank)
        for _ in range(self.updates):
            starts = torch.randint(0, len(self.train) - CONTEXT - 1, (self.batch,), generator=generator).numpy()
            rows = torch.from_numpy(self.train[starts[:, None] + np.arange(CONTEXT + 1)].astype(np.int64))
            yield rows[:, :-1], rows[:, 1:]

    def evaluate(self, model: nn.Module, chunk: int = 256) -> float:
        x, y = self.windows
        with torch.no_grad():
            total = sum(float(nn.functional.cross_entropy(model(x[i:i + chunk]).flatten(0, 1), y[i:i + chunk].flatten(),
                                                          reduction="sum")) for i in range(0, len(x), chunk))
        return total / y.numel()


# ------------------------------------------------------------------------- classification
SHAPE_CLASSES = ("horizontal bar", "vertical bar", "square outline", "filled square", "ring", "filled disk",
                 "plus", "diagonal cross")


def digits_data() -> Tuple[np.ndarray, ...]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    return tuple(train_test_split((digits.data / 16.0).astype("float32"), digits.target, test_size=0.25,
                                  random_state=0, stratify=digits.target))


def shapes_data(n_train: int = 3000, n_test: int = 1000, size: int = 16, noise: float = 0.2,
                seed: int = 1234) -> Tuple[np.ndarray, ...]:
    """Balanced classes; each image one shape, centre, half-size (2-5 px) and intensity (0.4-1)
    drawn at random, plus N(0, noise^2) pixel noise."""
    rng = np.random.default_rng(seed)
    labels = np.arange(n_train + n_test) % len(SHAPE_CLASSES)
    rng.shuffle(labels)
    yy, xx = np.mgrid[0:size, 0:size].astype("float32")
    images = np.empty((len(labels), 1, size, size), dtype="float32")
    for i, label in enumerate(labels):
        r = rng.uniform(2.0, 5.0)
        cy, cx = rng.uniform(r, size - 1 - r, size=2)
        dy, dx = yy - cy, xx - cx
        box, dist = np.maximum(np.abs(dy), np.abs(dx)), np.hypot(dy, dx)
        mask = [(np.abs(dy) <= 0.6) & (np.abs(dx) <= r), (np.abs(dx) <= 0.6) & (np.abs(dy) <= r),
                np.abs(box - r) <= 0.5, box <= r, np.abs(dist - r) <= 0.6, dist <= r,
                ((np.abs(dy) <= 0.6) | (np.abs(dx) <= 0.6)) & (box <= r),
                ((np.abs(dy - dx) <= 0.8) | (np.abs(dy + dx) <= 0.8)) & (box <= r)][int(label)]
        images[i, 0] = mask * rng.uniform(0.4, 1.0) + rng.normal(0.0, noise, (size, size))
    return images[:n_train], images[n_train:], labels[:n_train], labels[n_train:]


class Classification:
    """One rank's view: its shard (every size-th training sample), ``updates`` batches per epoch
    in an order of their own per seed, epoch and rank; ``evaluate``: test accuracy, a fraction."""

    metric = "accuracy"

    def __init__(self, name: str, rank: int, size: int, batch: int) -> None:
        x_train, x_test, y_train, y_test = (torch.from_numpy(np.asarray(a)) for a in
                                            (digits_data() if name == "digits" else shapes_data()))
        self.x, self.y = x_train[rank::size], y_train[rank::size].long()
        self.x_test, self.y_test = x_test, y_test.long()
        self.name, self.rank, self.batch = name, rank, batch
        self.updates = len(self.x) // batch
        self.train_size, self.test_size, self.sha256 = len(x_train), len(x_test), None

    def model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        if self.name == "digits":
            return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(32 * 4 * 4, len(SHAPE_CLASSES)))

    def batches(self, seed: int, segment: int) -> Iterator[Batch]:
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(
            10_000 * seed + 100 * segment + self.rank))
        for s in range(self.updates):
            idx = order[s * self.batch:(s + 1) * self.batch]
            yield self.x[idx], self.y[idx]

    def evaluate(self, model: nn.Module) -> float:
        with torch.no_grad():
            return float((model(self.x_test).argmax(dim=1) == self.y_test).double().mean())


def problem(name: str, rank: int, size: int, batch: int, updates: int, model: dict):
    """The problem of a task (``updates`` per segment: the LM's; classification: a pass)."""
    if name in SPLITS:
        return LanguageModel(name, rank, batch, updates, model)
    return Classification(name, rank, size, batch)
