"""Plain PyTorch GPT and Llama (nn.Linear, norms, F.cross_entropy): the baselines of benchmarks
and unsharded references that tests load axo4d's weights into.

Parameter names and full shapes equal those of :class:`axo4d.model.GPT`, so
``PlainGPT.load_state_dict(full_state_dict(gpt, comm))`` works; the QKV rows use
the same per-head ``[q k v]`` order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axo4d.config import ModelConfig
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid


class PlainAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
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


class _Proj(nn.Module):
    """Two linear layers under one name (``attn.{qkv,proj}``, ``mlp.{gate_up,down}``)."""

    def __init__(self, a: str, b: str, shapes: tuple[tuple[int, int], tuple[int, int]], bias_a: bool = False) -> None:
        super().__init__()
        self.names = (a, b)
        setattr(self, a, nn.Linear(*shapes[0], bias=bias_a))
        setattr(self, b, nn.Linear(*shapes[1], bias=False))


class PlainLlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.n_embd
        self.n_head, self.kv = cfg.n_head, cfg.n_kv_head or cfg.n_head
        self.hd = cfg.head_dim or h // cfg.n_head
        f = cfg.ffn_hidden or cfg.ffn_mult * h
        self.attn_norm = nn.RMSNorm(h, eps=cfg.ln_eps)
        self.mlp_norm = nn.RMSNorm(h, eps=cfg.ln_eps)
        # rows of qkv per kv group (queries, key, value); rows of gate_up interleaved gate/up
        qkv_bias = model_spec(cfg, Grid()).part("attn.qkv").bias  # the entry says (Llama: none)
        shapes = ((h, (self.n_head + 2 * self.kv) * self.hd), (self.n_head * self.hd, h))
        self.attn = _Proj("qkv", "proj", shapes, bias_a=qkv_bias)
        self.mlp = _Proj("gate_up", "down", ((h, 2 * f), (f, h)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        from axo4d.nn.rope import apply_rope

        b, t, _ = x.shape
        r = self.n_head // self.kv
        qkv = self.attn.qkv(self.attn_norm(x)).view(b, t, self.kv, r + 2, self.hd)
        q = qkv[:, :, :, :r].reshape(b, t, -1, self.hd).transpose(1, 2)
        k, v = qkv[:, :, :, r].transpose(1, 2), qkv[:, :, :, r + 1].transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn.proj(y.transpose(1, 2).reshape(b, t, -1))
        gu = self.mlp.gate_up(self.mlp_norm(x)).unflatten(-1, (-1, 2))
        return x + self.mlp.down(F.silu(gu[..., 0]) * gu[..., 1])


class PlainLlama(nn.Module):
    """Single-device Llama with axo4d's parameter names and layout (fused QKV per kv group,
    interleaved gate/up): the plain-PyTorch baseline of ``bench.llama`` and a reference that
    loads ``full_state_dict`` of :class:`axo4d.models.llama.Llama`."""

    def __init__(self, cfg: ModelConfig, vocab: int | None = None) -> None:
        super().__init__()
        from axo4d.nn.rope import inv_frequencies

        self.cfg = cfg
        self.vocab = vocab or cfg.vocab_size
        if not cfg.tie_embeddings:
            self.embed_tokens = nn.Parameter(torch.randn(cfg.vocab_size, cfg.n_embd) * cfg.init_std)
        self.blocks = nn.ModuleList(PlainLlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.ln_eps)
        self.lm_head = nn.Linear(cfg.n_embd, self.vocab, bias=False)
        self.register_buffer(
            "inv_freq", inv_frequencies(cfg, cfg.head_dim or cfg.n_embd // cfg.n_head), persistent=False
        )

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        from axo4d.nn.rope import rope_tables

        table = self.lm_head.weight if self.cfg.tie_embeddings else self.embed_tokens
        x = F.embedding(idx, table)
        cos, sin = rope_tables(self.inv_freq, torch.arange(idx.shape[1], device=idx.device), x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))[..., : self.cfg.vocab_size]
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
