"""Rotary position embedding in the convention of Hugging Face ``transformers``' Llama: the head
is split in two halves (``rotate_half``), frequencies ``theta^(-2i/d)``, optionally rescaled as
Llama 3.1 does ('llama3': low frequencies divided by ``factor``, a smooth blend in between).
Applied per head after QKV, locally: no communication."""

from __future__ import annotations

import math

import torch

from axo4d.config import ModelConfig


def inv_frequencies(cfg: ModelConfig, head_dim: int) -> torch.Tensor:
    """``(head_dim/2,)`` inverse frequencies, fp32, with ``cfg.rope_scaling`` applied."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if cfg.rope_scaling == "":  # else 'llama3' (the config's choices)
        return inv
    old, lo, hi, factor = (
        cfg.rope_original_max_positions,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
        cfg.rope_factor,
    )
    low_wavelen, high_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``(*positions.shape, head_dim)`` for integer ``positions``."""
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``(B, H, T, D)``; ``cos``/``sin``: ``(B, T, D)`` or ``(T, D)``."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin
