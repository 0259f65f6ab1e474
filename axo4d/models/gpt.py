"""A GPT written once: single-device code whose parallel parts follow docs/design.md section 2.

On the grid 1x1x1x1 every collective is skipped and this is an ordinary GPT. Its parts and
their shapes come from its registry entry (:mod:`axo4d.facts.archs.gpt_family`; the performance model reads the same).
Shapes in comments use B = local batch (global micro-batch / (G_data*G_z)), T = sequence,
C = hidden, H = heads, V = padded vocabulary.

The residual stream is split on features over x and, inside each x slice, over y:
``(B, T, C/(x*y))`` (docs/design.md section 15: nothing between two GEMMs runs twice). Each block:
LayerNorm (statistics summed over x and y) -> QKV (non-transposed: input gathered over y, output
reduce-scattered over x by whole heads) -> causal attention (this rank's H/(x*y) heads) -> output
projection (transposed: input gathered over x, output reduce-scattered over y) -> residual;
LayerNorm -> MLP up -> GELU on 4C/(x*y) features -> MLP down -> residual. On a grid with x alone
each pair is turned (QKV and up transposed, projection and down not: only C-wide activations move,
docs/design.md section 2.2); the layers read their orientation from the spec.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axo4d.config import ModelConfig
from axo4d.dist.mappings import feature_slice, replicate_features, slice_features
from axo4d.facts.archs import model_spec
from axo4d.facts.spec import ModelSpec
from axo4d.models.base import DecoderLM
from axo4d.nn.attention import Decoding, attend
from axo4d.nn.context import LayerContext, as_context
from axo4d.nn.embedding import embedding_table
from axo4d.nn.linear import Linear3D
from axo4d.nn.norms import LayerNorm


class Attention(nn.Module):
    def __init__(self, s: ModelSpec, ctx: LayerContext, index: int) -> None:
        super().__init__()
        self.index = index  # which KV cache is ours
        a = s.attention()
        self.comm, self.whole = ctx.comm, a.whole_heads(ctx.grid)  # whole heads per x*y block, or the fallback
        self.head_dim, self.local_heads = a.head_dim, a.n_head // ctx.comm.size(a.head_axes(ctx.grid))
        # rows of the QKV weight ordered per head: [h0: q k v][h1: q k v]... so a y-slice holds whole heads,
        # and so does each x block of it (the output reduce-scattered over x)
        self.qkv = Linear3D.from_spec(s.part("attn.qkv"), ctx)
        self.proj = Linear3D.from_spec(s.part("attn.proj"), ctx)
        if self.qkv.bias is not None:
            # A key bias only adds q.b_k to every score of a query; softmax ignores it, so its
            # gradient is zero up to rounding, which AdamW would amplify. Keep it exactly 0.
            mask = torch.ones(a.n_head, 3, self.head_dim)
            mask[:, 1] = 0
            mask = feature_slice(mask.reshape(-1), ctx.comm, self.qkv.out_axis)  # the bias's rows: 3C/G_out
            self.qkv.bias.register_hook(lambda g, m=mask.clone(): g * m.to(g))

    def forward(
        self, x: torch.Tensor, documents: torch.Tensor | None = None, decoding: Decoding | None = None
    ) -> torch.Tensor:  # (B, T, C/(x*y))
        b, t, _ = x.shape
        qkv = self.qkv(x)  # (B, T, 3C/(x*y))
        if not self.whole:  # the fallback: the y slice's heads on every x rank
            qkv = replicate_features(qkv, self.comm, "x")  # (B, T, 3C/y)
        qkv = qkv.view(b, t, self.local_heads, 3, self.head_dim)  # (B, T, H/(x*y), 3, C/H)
        q, k, v = (u.transpose(1, 2) for u in qkv.unbind(3))  # (B, H/(x*y), T, C/H)
        if decoding is None and documents is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H/(x*y), T, C/H)
        elif decoding is None:
            y = attend(q, k, v, documents=documents)  # (B, H/(x*y), T, C/H), inside each document
        else:
            y = attend(q, k, v, decoding.caches[self.index], decoding.mask)
        y = y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim)  # (B, T, C/(x*y))
        if not self.whole:
            y = slice_features(y, self.comm, "x")  # (B, T, C/y) -> this x rank's block (B, T, C/(x*y))
        return self.proj(y)  # (B, T, C/(x*y))


class MLP(nn.Module):
    def __init__(self, s: ModelSpec, ctx: LayerContext) -> None:
        super().__init__()
        self.up = Linear3D.from_spec(s.part("mlp.up"), ctx)
        self.down = Linear3D.from_spec(s.part("mlp.down"), ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C/(x*y))
        return self.down(F.gelu(self.up(x), approximate="tanh"))  # (B, T, 4C/(x*y)) -> (B, T, C/(x*y))


class Block(nn.Module):
    def __init__(self, s: ModelSpec, ctx: LayerContext, eps: float, index: int) -> None:
        super().__init__()
        bias = s.part("ln1").bias
        self.ln1 = LayerNorm(s.hidden, ctx.comm, eps, bias, "ln1")
        self.attn = Attention(s, ctx, index)
        self.ln2 = LayerNorm(s.hidden, ctx.comm, eps, bias, "ln2")
        self.mlp = MLP(s, ctx)

    def forward(
        self, x: torch.Tensor, documents: torch.Tensor | None = None, decoding: Decoding | None = None
    ) -> torch.Tensor:  # (B, T, C/(x*y))
        x = x + self.attn(self.ln1(x), documents, decoding)
        return x + self.mlp(self.ln2(x))


class GPT(DecoderLM):
    """GPT on the grid of ``ctx``; ``GPT(cfg, Comm(Grid()))`` is a single-device model.

    ``ctx``: a :class:`~axo4d.nn.context.LayerContext` (its schedule decides whether collectives
    overlap, its tuner each GEMM's layout); a bare :class:`~axo4d.dist.comm.Comm` means eager.
    Call :meth:`finish_gradients` after the last backward of a step.
    """

    def __init__(self, cfg: ModelConfig, ctx, *, seed: int | None = 0, spec: ModelSpec | None = None) -> None:
        ctx = as_context(ctx)
        s = model_spec(cfg, ctx.grid) if spec is None else spec
        super().__init__(s, ctx)
        self.cfg = cfg
        self.wte = embedding_table(s.part("wte"), ctx.grid)  # (V, C/x)
        self.wpe = embedding_table(s.part("wpe"), ctx.grid)  # (T, C/x)
        self.blocks = nn.ModuleList(Block(s, ctx, cfg.ln_eps, i) for i in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, ctx.comm, cfg.ln_eps, cfg.bias, "ln_f")
        self.lm_head = Linear3D.from_spec(s.part("lm_head"), ctx)
        self._finish_init(seed)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, tuple]:
        pos = self.wpe[: idx.shape[1]] if positions is None else F.embedding(positions, self.wpe)
        return slice_features(F.embedding(idx, self.wte) + pos, self.comm, "y"), ()  # (B, T, C/(x*y))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V/(x*y))
