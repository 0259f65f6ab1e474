"""Llama (3.x) on the grid, written once: single-device code whose parallel parts follow
docs/design.md section 7. Its parts come from its registry entry (:mod:`axo4d.facts.archs.llama_family`).

Shapes: B = local batch, T = sequence, C = hidden, H = query heads, K = kv heads, D = head size,
F = MLP width, V = padded vocabulary. The residual stream ``(B, T, C/(x*y))`` is split on features
over x and y, as in the GPT. Each block: RMSNorm -> QKV (one non-transposed layer, rows per kv
group: the group's queries, its key, its value, so a y-slice holds whole groups, and so does each
x block of it: ``n_kv_head`` divides by G_x*G_y) -> RoPE ->
grouped-query attention (local heads) -> output projection (transposed) -> residual; RMSNorm ->
gate|up (one non-transposed layer, rows interleaved gate/up per feature) -> silu(gate) * up ->
down (transposed) -> residual. Tied embeddings read the LM head's weight vocabulary-parallel. On a
grid with x alone each pair is turned (docs/design.md section 2.2: QKV and gate|up transposed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axo4d.config import ModelConfig
from axo4d.dist.mappings import replicate_features, slice_features
from axo4d.facts.archs import model_spec
from axo4d.facts.spec import ModelSpec
from axo4d.models.base import DecoderLM
from axo4d.nn.attention import Decoding, attend
from axo4d.nn.context import LayerContext, as_context
from axo4d.nn.embedding import embedding_table, tied_embedding
from axo4d.nn.linear import Linear3D
from axo4d.nn.norms import RMSNorm
from axo4d.nn.rope import apply_rope, inv_frequencies, rope_tables


class Attention(nn.Module):
    def __init__(self, s: ModelSpec, ctx: LayerContext, index: int) -> None:
        super().__init__()
        a = s.attention()
        self.index, self.head_dim = index, a.head_dim
        self.comm, self.whole = ctx.comm, a.whole_heads(ctx.grid)  # whole kv groups per x*y block, or the fallback
        self.local_kv = a.n_kv_head // ctx.comm.size(a.head_axes(ctx.grid))
        self.group = a.n_head // a.n_kv_head  # queries per kv head
        self.qkv = Linear3D.from_spec(s.part("attn.qkv"), ctx)
        self.proj = Linear3D.from_spec(s.part("attn.proj"), ctx)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: torch.Tensor | None = None,
        decoding: Decoding | None = None,
    ) -> torch.Tensor:  # (B, T, C/(x*y))
        b, t, _ = x.shape
        qkv = self.qkv(x)  # (B, T, (H + 2K) D/(x*y))
        if not self.whole:  # the fallback (fewer kv groups than x*y ranks): the y slice's groups on every x rank
            qkv = replicate_features(qkv, self.comm, "x")  # (B, T, (H + 2K) D/y)
        qkv = qkv.view(b, t, self.local_kv, self.group + 2, self.head_dim)  # (B, T, K/(x*y), H/K + 2, D)
        q = qkv[:, :, :, : self.group].reshape(b, t, -1, self.head_dim).transpose(1, 2)  # (B, H/(x*y), T, D)
        k = qkv[:, :, :, self.group].transpose(1, 2)  # (B, K/(x*y), T, D)
        v = qkv[:, :, :, self.group + 1].transpose(1, 2)  # (B, K/(x*y), T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache = None if decoding is None else decoding.caches[self.index]
        y = attend(q, k, v, cache, None if decoding is None else decoding.mask, documents)  # (B, H/(x*y), T, D)
        y = y.transpose(1, 2).reshape(b, t, -1)  # (B, T, H D/(x*y))
        if not self.whole:
            y = slice_features(y, self.comm, "x")  # (B, T, H D/y) -> this x rank's block
        return self.proj(y)  # (B, T, C/(x*y))


class MLP(nn.Module):
    def __init__(self, s: ModelSpec, ctx: LayerContext) -> None:
        super().__init__()
        self.gate_up = Linear3D.from_spec(s.part("mlp.gate_up"), ctx)
        self.down = Linear3D.from_spec(s.part("mlp.down"), ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C/(x*y))
        gu = self.gate_up(x).unflatten(-1, (-1, 2))  # (B, T, F/(x*y), 2): gate, up
        return self.down(F.silu(gu[..., 0]) * gu[..., 1])  # (B, T, F/(x*y)) -> (B, T, C/(x*y))


class Block(nn.Module):
    def __init__(self, s: ModelSpec, ctx: LayerContext, eps: float, index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(s.hidden, ctx.comm, eps, "attn_norm")
        self.attn = Attention(s, ctx, index)
        self.mlp_norm = RMSNorm(s.hidden, ctx.comm, eps, "mlp_norm")
        self.mlp = MLP(s, ctx)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: torch.Tensor | None = None,
        decoding: Decoding | None = None,
    ) -> torch.Tensor:  # (B, T, C/(x*y))
        x = x + self.attn(self.attn_norm(x), cos, sin, documents, decoding)
        return x + self.mlp(self.mlp_norm(x))


class Llama(DecoderLM):
    """Llama on the grid of ``ctx`` (a :class:`~axo4d.nn.context.LayerContext`, or a bare
    :class:`~axo4d.dist.comm.Comm` for the eager schedule)."""

    def __init__(self, cfg: ModelConfig, ctx, *, seed: int | None = 0, spec: ModelSpec | None = None) -> None:
        ctx = as_context(ctx)
        s = model_spec(cfg, ctx.grid) if spec is None else spec
        super().__init__(s, ctx)
        self.cfg, self.tied = cfg, cfg.tie_embeddings
        if not self.tied:
            self.embed_tokens = embedding_table(s.part("embed"), ctx.grid)  # (V, C/x)
        self.blocks = nn.ModuleList(Block(s, ctx, cfg.ln_eps, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, ctx.comm, cfg.ln_eps, "norm")
        self.lm_head = Linear3D.from_spec(s.part("lm_head"), ctx)
        self.register_buffer("inv_freq", inv_frequencies(cfg, s.attention().head_dim), persistent=False)
        self._finish_init(seed)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, tuple]:
        if self.tied:
            x = tied_embedding(idx, self.lm_head)  # (B, T, C/(x*y))
        else:
            x = slice_features(F.embedding(idx, self.embed_tokens), self.comm, "y")  # (B, T, C/(x*y))
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        cos, sin = rope_tables(self.inv_freq, positions, x.dtype)  # (T, D) or (B, T, D)
        return x, (cos, sin)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))  # (B, T, V/(x*y))
