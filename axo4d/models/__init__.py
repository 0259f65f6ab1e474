"""Models on the grid, built by their architecture's registry entry (:mod:`axo4d.facts.archs`)."""

from __future__ import annotations

from axo4d.config import ModelConfig
from axo4d.facts.archs import get_arch
from axo4d.facts.spec import ModelSpec
from axo4d.models.base import DecoderLM, apply_activation_checkpointing, apply_compile
from axo4d.nn.context import LayerContext


def build_model(
    cfg: ModelConfig, ctx: LayerContext, *, seed: int | None = 0, spec: ModelSpec | None = None
) -> DecoderLM:
    """The model of ``cfg.arch`` on the grid of ``ctx``, initialised from ``seed`` (``None``: zeros,
    for a caller that loads weights next); ``spec``: its spec on that grid when known (the run plan's)."""
    return get_arch(cfg.arch).model_class()(cfg, ctx, seed=seed, spec=spec)


__all__ = ["build_model", "DecoderLM", "apply_activation_checkpointing", "apply_compile"]
