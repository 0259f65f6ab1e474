"""The order of a run's samples: epochs without replacement, and mixtures of sources by weight.

A run's training samples form one stream of *positions* 0, 1, 2, ...; step ``s`` takes the next
``global_batch`` of them (:mod:`axo4d.training.datasets.dataset`). :class:`EpochOrder` maps a position to
``(epoch, sample)``: epoch ``e = position // n`` is a seeded permutation of the ``n`` samples, drawn
from ``(seed, stream, e)``, so every sample is seen once per epoch and the next epoch reshuffles.
:class:`MixtureOrder` does the same over several sources: each epoch holds ``count_i`` samples of
source ``i`` (its share of the weights, largest remainder), shuffled together, and source ``i``'s
samples come from its own epoch order, continuing from mixture epoch to mixture epoch (a source
whose share exceeds its size is repeated, each repetition in a new order).

The permutation is a keyed Feistel network over the next power of four with cycle walking
(:func:`permute`): a bijection of ``0..n-1`` evaluated elementwise, so a position maps to its sample
with O(1) memory and work, whatever ``n`` is -- no permutation array per epoch.
"""

from __future__ import annotations

import numpy as np

from axo4d.config.errors import DataError

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15
_ROUNDS = 6
#: streams of keys: the training order, the validation order, a mixture's epochs
STREAM_TRAIN, STREAM_VAL, STREAM_MIX = 1, 2, 3


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def key_of(*parts: int) -> int:
    """A 64-bit key from integers (seed, stream, epoch, ...)."""
    k = np.zeros(1, np.uint64)
    for p in parts:
        k = _splitmix(k + np.uint64((int(p) + _GOLDEN) % (1 << 64)))
    return int(k[0])


def hash64(values: np.ndarray, key: int) -> np.ndarray:
    """A keyed 64-bit hash of each integer of ``values`` (uint64)."""
    return _splitmix(np.asarray(values).astype(np.uint64) ^ np.uint64(key))


def permute(i: np.ndarray, n: int, key: int) -> np.ndarray:
    """``perm[i]`` of a pseudo-random permutation ``perm`` of ``0..n-1`` chosen by ``key`` (int64)."""
    i = np.asarray(i, dtype=np.int64)
    if n < 1:
        raise ValueError(f"permutation of {n} elements")
    if np.any((i < 0) | (i >= n)):
        raise ValueError(f"index outside 0..{n - 1}")
    half = max(1, (int(n - 1).bit_length() + 1) // 2)  # domain 4**half >= n, < 4n
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(key_of(key, r)) for r in range(_ROUNDS)]
    x = i.astype(np.uint64)
    todo = np.ones(x.shape, bool)
    while todo.any():  # cycle walking: re-encrypt values outside 0..n-1 (expected < 4 rounds)
        v = x[todo]
        lo, hi = v & mask, v >> np.uint64(half)
        for k in keys:
            lo, hi = hi ^ (_splitmix(lo ^ k) & mask), lo
        v = (hi << np.uint64(half)) | lo
        x[todo] = v
        todo[todo] = v >= np.uint64(n)
    return x.astype(np.int64)


class EpochOrder:
    """Positions of one source's stream -> ``(epoch, sample)``: a new permutation every epoch."""

    def __init__(self, n: int, seed: int, stream: int = STREAM_TRAIN) -> None:
        if n < 1:
            raise DataError("no training samples: the dataset is empty")
        self.n, self.seed, self.stream = int(n), int(seed), stream

    @property
    def epoch_size(self) -> int:
        return self.n

    def at(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(epoch, sample)`` of each position (int64 arrays shaped like ``pos``)."""
        pos = np.asarray(pos, dtype=np.int64)
        epoch, within = np.divmod(pos, self.n)
        out = np.empty_like(pos)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = permute(within[sel], self.n, key_of(self.seed, self.stream, int(e)))
        return epoch, out


def shares(weights: list[float], total: int) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainder; sums to ``total``)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    out = np.floor(exact).astype(np.int64)
    rest = total - int(out.sum())
    order = np.argsort(-(exact - out), kind="stable")
    out[order[:rest]] += 1
    return [int(c) for c in out]


class MixtureOrder:
    """Positions of a mixture -> ``(epoch, global sample)``: an epoch of ``epoch_size`` samples
    (by default the sources' total), ``count_i`` of them from source ``i`` (module docstring).
    Global sample ids are ``offset_i + sample`` of source ``i`` (sources laid end to end)."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int, epoch_size: int = 0) -> None:
        if len(sizes) != len(weights) or not sizes:
            raise ValueError("one weight per source")
        self.sizes, self.seed = [int(n) for n in sizes], int(seed)
        self.epoch_size = int(epoch_size or sum(self.sizes))
        self.counts = shares(weights, self.epoch_size)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)  # slots per source
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)  # global ids
        self.orders = [EpochOrder(n, key_of(seed, i), STREAM_TRAIN) if n else None for i, n in enumerate(self.sizes)]

    def at(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = np.asarray(pos, dtype=np.int64)
        epoch, within = np.divmod(pos, self.epoch_size)
        slot = np.empty_like(pos)
        for e in np.unique(epoch):
            sel = epoch == e
            slot[sel] = permute(within[sel], self.epoch_size, key_of(self.seed, STREAM_MIX, int(e)))
        src = np.searchsorted(self.starts, slot, side="right") - 1
        out = np.empty_like(pos)
        for i in np.unique(src):
            sel = src == i
            local = epoch[sel] * self.counts[i] + (slot[sel] - self.starts[i])  # source i's own stream
            out[sel] = self.offsets[i] + self.orders[i].at(local)[1]
        return epoch, out
