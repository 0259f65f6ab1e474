"""Weight caching: keep a layer's gathered z block from forward for its backward.

Without caching, a layer whose weight is split over z gathers its block in forward, again in
backward and, with activation checkpointing, a third time in the recompute. With
``parallel.cache_weights`` the schedule (:mod:`axo4d.nn.schedule`) keeps the forward block of the
cached layers and serves their recompute and backward requests from it, so those all-gathers
disappear -- what :meth:`axo4d.facts.spec.LinearSpec.collectives` declares with ``cached=True`` and the
performance model prices. The price is memory: one gathered block per cached layer, held from its
forward until its backward (:func:`perfmodel.model.cache_memory_bytes`).

Which layers: the last ``n`` registered with the schedule (the run plan's ``cache_layers``,
:class:`axo4d.facts.run.RunFacts`: the last
``N`` blocks' linear layers and the LM head, ``N`` from :func:`axo4d.facts.spec.cached_blocks`). Their
forward-to-backward interval is the shortest and, with prefetching, the first backward gathers
(which nothing hides) are the ones that disappear.

A gather is an exact copy, so a kept block equals a fresh one bit for bit: results do not change.
A kept block whose weight changed since it was gathered (version counter) is dropped and gathered
again; blocks left by a forward pass whose backward never ran are dropped when the next training
forward pass begins.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch


@dataclass
class _Kept:
    block: torch.Tensor
    version: int
    uses: int


class WeightCache:
    """Kept forward blocks of the last ``n_layers`` registered layers (``0``: caching off)."""

    def __init__(self, n_layers: int = 0) -> None:
        if n_layers < 0:
            raise ValueError(f"cache_layers must be >= 0, got {n_layers}")
        self.n_layers = n_layers
        self.cached: frozenset[int] = frozenset()
        self.stats: Counter = Counter()
        self._on = False  # the open forward pass keeps blocks
        self._kept: dict[tuple[int, torch.dtype], _Kept] = {}

    def plan(self, registered: int, g_z: int) -> None:
        """Decide the cached layer indices once every layer has registered (none when ``G_z = 1``:
        there is no gather to save)."""
        n = min(self.n_layers, registered) if g_z > 1 else 0
        self.cached = frozenset(range(registered - n, registered))

    def open(self, training: bool) -> None:
        """A forward pass begins; it keeps blocks when a backward will follow."""
        self._on = bool(self.cached) and training and torch.is_grad_enabled()
        if self._on:
            self._kept.clear()

    def keep(self, index: int, weight: torch.Tensor, block, forward: bool, how=None) -> None:
        """After a gather: keep it if it is a cached layer's forward (not recompute) block; ``how``:
        what it was gathered in (a dtype, or an FP8 :class:`~axo4d.nn.fp8.WeightCast`; default the
        block's dtype), the key a later request must match."""
        if not (forward and self._on and index in self.cached):
            return
        key = (index, block.dtype if how is None else how)
        old = self._kept.get(key)
        self._kept[key] = _Kept(block, weight._version, (old.uses if old else 0) + 1)

    def take(self, index: int, weight: torch.Tensor, dtype, backward: bool):
        """The kept block for a recompute request (stays kept) or a backward request (one forward
        use consumed); ``None`` when there is none and the caller gathers."""
        k = self._kept.get((index, dtype)) if self._kept else None
        if k is None:
            return None
        if k.version != weight._version:
            del self._kept[(index, dtype)]
            self.stats["cache_stale"] += 1
            return None
        if backward:
            k.uses -= 1
            if k.uses <= 0:
                del self._kept[(index, dtype)]
        self.stats["cache_hits"] += 1
        return k.block

    @property
    def kept_bytes(self) -> int:
        """Bytes of the blocks kept right now."""
        return sum(_nbytes(k.block) for k in self._kept.values())


def _nbytes(block) -> int:
    nb = getattr(block, "nbytes", None)  # an FP8 block and its scale
    return int(nb) if nb is not None else block.numel() * block.element_size()


__all__ = ["WeightCache"]
