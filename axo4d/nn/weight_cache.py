"""Weight caching: keep a layer's gathered z block from forward for its backward.

Without caching, a layer whose weight is split over z gathers its block in forward, again in
backward and, with activation checkpointing, a third time in the recompute. With
``parallel.cache_weights`` the schedule (:mod:`axo4d.nn.schedule`) keeps the forward block of the
cached layers and serves their recompute and backward requests from it, so those all-gathers
disappear -- what :meth:`axo4d.facts.spec.LinearSpec.collectives` declares with ``cached=True`` and the
performance model prices. The price is memory: one gathered block per cached layer, held from its
forward until its backward (:func:`perfmodel.model.cache_memory_bytes`).

Which layers: the last ``n`` registered with the schedule (:func:`cache_layer_count`: the last
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

from axo4d.config import RunConfig
from axo4d.config.errors import ConfigError
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid
from axo4d.facts.spec import ModelSpec, cached_blocks


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


def cache_layer_count(spec: ModelSpec, setting: str) -> int:
    """Layers whose blocks ``parallel.cache_weights = setting`` keeps: the last ``N`` blocks' linear
    layers and the LM head (registered last), ``N = cached_blocks(setting, n_layer)``."""
    try:
        n = cached_blocks(setting, spec.n_layer)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return n * len(spec.linears()) + 1 if n else 0


def cache_layers_for(cfg: RunConfig, grid: Grid) -> int:
    """:func:`cache_layer_count` of ``cfg``'s model on ``grid`` (``parallel.cache_weights``)."""
    return cache_layer_count(model_spec(cfg.model, grid), cfg.parallel.cache_weights)


__all__ = ["WeightCache", "cache_layer_count", "cache_layers_for"]
