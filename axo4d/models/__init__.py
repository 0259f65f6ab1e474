"""Models on the grid, by ``model.arch``."""

from __future__ import annotations

from axo4d.config import ModelConfig
from axo4d.models.base import DecoderLM, apply_activation_checkpointing, apply_compile
from axo4d.nn.context import LayerContext


def build_model(cfg: ModelConfig, ctx: LayerContext, *, seed: int | None = 0) -> DecoderLM:
    """The model of ``cfg.arch`` on the grid of ``ctx``, initialised from ``seed`` (``None``: zeros,
    for a caller that loads weights next)."""
    from axo4d.models.gpt import GPT
    from axo4d.models.llama import Llama

    archs = {"gpt": GPT, "llama": Llama}
    arch = getattr(cfg, "arch", "gpt")
    if arch not in archs:
        from axo4d.errors import ConfigError

        raise ConfigError(f"model.arch={arch!r}; valid: {', '.join(sorted(archs))}")
    return archs[arch](cfg, ctx, seed=seed)


__all__ = ["build_model", "DecoderLM", "apply_activation_checkpointing", "apply_compile"]
