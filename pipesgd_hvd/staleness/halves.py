"""``halves``: the two calls of an update in the accurate mode (``staleness_correction="split_batch"``),
from one batch. The one more line a training loop needs::

    for x, y in loader:
        for x, y in psgd.halves(x, y):          # the look-ahead part, then the fresh part
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        scheduler.step()                        # per update, as before

Each update then sees the batch a synchronous step would, and the loop makes as many updates as
before: the learning-rate schedule, logging per batch and the data loader stay as they are.
Framework-free: it slices along the first axis (PyTorch and TensorFlow tensors, numpy arrays),
through tuples, lists and dicts.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Mapping, Sequence

from .split_batch import DEFAULT_FRESH_FRACTION, check_fresh_fraction


def halves(*batch: Any, fresh_fraction: float = DEFAULT_FRESH_FRACTION) -> Iterator[Any]:
    """Yields the two parts of ``batch`` (one object, or several, then each part is a tuple): the
    first ``1 - fresh_fraction`` of the samples (the look-ahead part, computed at the rank's
    look-ahead), then the rest (the fresh part, at the real weights). Pass the optimizer's
    ``fresh_fraction`` if you set one. An odd count gives the extra sample to the first part;
    the optimizer weighs the parts by ``fresh_fraction``, not by their sizes."""
    fresh = check_fresh_fraction(fresh_fraction)
    if not batch:
        raise ValueError("halves() needs a batch: halves(x, y), halves(batch) or halves(**features) as one dict")
    sizes = sorted({_size(leaf) for leaf in _leaves(batch)})
    if len(sizes) != 1:
        raise ValueError(f"halves() splits along the first axis, but the batch's parts have {sizes} samples: pass "
                         "tensors with the same number of samples")
    n = sizes[0]
    fresh_count = int(round(n * fresh))
    cut = n - fresh_count
    if n < 2 or cut < 1 or fresh_count < 1:
        raise ValueError(f"a batch of {n} sample(s) cannot be split into a look-ahead part and a fresh part with "
                         f"fresh_fraction={fresh}: use batches of at least {max(2, int(1 / min(fresh, 1 - fresh)) + 1)} "
                         "samples per rank")
    for lo, hi in ((0, cut), (cut, n)):
        part = _slice(batch, lo, hi)
        yield part[0] if len(batch) == 1 else part


def _leaves(x: Any) -> List[Any]:
    if isinstance(x, Mapping):
        return [leaf for v in x.values() for leaf in _leaves(v)]
    if isinstance(x, (tuple, list)):
        return [leaf for v in x for leaf in _leaves(v)]
    return [x]


def _size(leaf: Any) -> int:
    shape = getattr(leaf, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    if isinstance(leaf, Sequence) and not isinstance(leaf, (str, bytes)):
        return len(leaf)
    raise ValueError(f"halves() splits tensors along their first axis, got {type(leaf).__name__} without one")


def _slice(x: Any, lo: int, hi: int) -> Any:
    if isinstance(x, Mapping):
        return {k: _slice(v, lo, hi) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(_slice(v, lo, hi) for v in x)
    if isinstance(x, list) and not _is_leaf_list(x):
        return [_slice(v, lo, hi) for v in x]
    return x[lo:hi]


def _is_leaf_list(x: list) -> bool:
    """A list of samples (numbers, strings) is a leaf; a list of tensors is a structure."""
    return not x or not hasattr(x[0], "shape")
