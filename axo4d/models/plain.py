"""A plain PyTorch GPT (nn.Linear, nn.LayerNorm, F.cross_entropy): the baseline for
benchmarks and the unsharded reference that tests load axo4d's weights into.

Parameter names and full shapes equal those of :class:`axo4d.model.GPT`, so
``PlainGPT.load_state_dict(full_state_dict(gpt, comm))`` works; the QKV rows use
the same per-head ``[q k v]`` order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axo4d.config import ModelConfig


class PlainAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # (B, T, C)
        b, t, c = x.shape
        qkv = self.qkv(x).view(b, t, self.n_head, 3, self.head_dim)
        q, k, v = (u.transpose(1, 2) for u in qkv.unbind(3))  # (B, H, T, C/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class PlainMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, cfg.ffn_mult * cfg.n_embd, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn_mult * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class PlainBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, eps=cfg.ln_eps, bias=cfg.bias)
        self.attn = PlainAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, eps=cfg.ln_eps, bias=cfg.bias)
        self.mlp = PlainMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class PlainGPT(nn.Module):
    """Single-device GPT; ``vocab`` is the LM head's (padded) output size."""

    def __init__(self, cfg: ModelConfig, vocab: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab = vocab or cfg.vocab_size
        self.wte = nn.Parameter(torch.randn(cfg.vocab_size, cfg.n_embd) * cfg.init_std)
        self.wpe = nn.Parameter(torch.randn(cfg.seq_len, cfg.n_embd) * cfg.init_std)
        self.blocks = nn.ModuleList(PlainBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.ln_eps, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, self.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token losses (B, T) with ``targets``, else logits (B, T, vocab)."""
        x = F.embedding(idx, self.wte) + self.wpe[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))[..., : self.cfg.vocab_size]
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
