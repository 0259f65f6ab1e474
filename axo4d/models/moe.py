"""Mixture-of-experts decoders on the grid (Qwen3-MoE, Mixtral, Qwen2-MoE; docs/design.md section
16): the Llama model's attention (with Qwen3's per-head query and key norms, or Qwen2's q/k/v
biases, where the spec has them) and an MoE layer (:class:`axo4d.nn.experts.MoE`, or
:class:`~axo4d.nn.experts.SharedExpertMoE` where the spec has a shared expert) in place of the
MLP; and the plain single-device reference.

Shapes as in :mod:`axo4d.models.llama`. The router statistics of a forward are kept on the model
(:attr:`MoeDecoder.router_stats`); :meth:`MoeDecoder.router_loss` is the load-balancing loss the
trainer logs and adds to the training loss times :meth:`MoeDecoder.router_loss_weight`
(``model.router_aux_loss_coef`` when ``model.output_router_logits``, as ``transformers``, else 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axo4d.config import ModelConfig
from axo4d.dist.mappings import replicate_features, slice_features
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid
from axo4d.facts.spec import ModelSpec
from axo4d.models.base import DecoderLM
from axo4d.models.llama import Attention, Llama
from axo4d.nn.attention import Decoding, attend
from axo4d.nn.context import LayerContext, as_context
from axo4d.nn.embedding import embedding_table
from axo4d.nn.experts import GroupedExperts, HeadNorm, MoE, RouterStats, SharedExpertMoE
from axo4d.nn.linear import Linear3D
from axo4d.nn.norms import RMSNorm
from axo4d.nn.rope import apply_rope, inv_frequencies


class MoeAttention(Attention):
    """Llama's attention; with the spec's ``attn.q_norm``/``attn.k_norm`` each head's queries and
    keys are RMS-normalised before RoPE."""

    def __init__(self, s: ModelSpec, ctx: LayerContext, index: int, eps: float) -> None:
        super().__init__(s, ctx, index)
        names = {p.name for p in s.block}
        self.q_norm = HeadNorm(s, "attn.q_norm", eps, ctx.comm) if "attn.q_norm" in names else None
        self.k_norm = HeadNorm(s, "attn.k_norm", eps, ctx.comm) if "attn.k_norm" in names else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: torch.Tensor | None = None,
        decoding: Decoding | None = None,
    ) -> torch.Tensor:  # (B, T, C/(x*y))
        b, t, _ = x.shape
        # the norms' weights before any view of qkv (HeadNorm.forward: no compiled break between views)
        w = None if self.q_norm is None else (self.q_norm.used_weight(), self.k_norm.used_weight())
        qkv = self.qkv(x)  # (B, T, (H + 2K) D/(x*y))
        if not self.whole:  # fewer kv groups than x*y ranks: the y slice's groups on every x rank
            qkv = replicate_features(qkv, self.comm, "x")
        qkv = qkv.view(b, t, self.local_kv, self.group + 2, self.head_dim)  # (B, T, K/(x*y), H/K + 2, D)
        q = qkv[:, :, :, : self.group].reshape(b, t, -1, self.head_dim)  # (B, T, H/(x*y), D)
        k, v = qkv[:, :, :, self.group], qkv[:, :, :, self.group + 1]  # (B, T, K/(x*y), D)
        if w is not None:
            q, k = self.q_norm(q, w[0]), self.k_norm(k, w[1])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads/(x*y), T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache = None if decoding is None else decoding.caches[self.index]
        y = attend(q, k, v, cache, None if decoding is None else decoding.mask, documents)  # (B, H/(x*y), T, D)
        y = y.transpose(1, 2).reshape(b, t, -1)  # (B, T, H D/(x*y))
        if not self.whole:
            y = slice_features(y, self.comm, "x")
        return self.proj(y)  # (B, T, C/(x*y))


class MoeBlock(nn.Module):
    def __init__(self, s: ModelSpec, ctx: LayerContext, eps: float, index: int, stats: RouterStats) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(s.hidden, ctx.comm, eps, "attn_norm")
        self.attn = MoeAttention(s, ctx, index, eps)
        self.mlp_norm = RMSNorm(s.hidden, ctx.comm, eps, "mlp_norm")
        shared = any(p.name == "mlp.shared_expert_gate" for p in s.block)
        self.mlp = (SharedExpertMoE if shared else MoE)(s, ctx, stats)

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


class MoeDecoder(DecoderLM):
    """A Llama-like decoder whose blocks are :class:`MoeBlock` (``model.arch`` 'qwen3_moe',
    'mixtral', 'qwen2_moe'); embedding and head are Llama's."""

    embed = Llama.embed
    head = Llama.head

    def __init__(self, cfg: ModelConfig, ctx, *, seed: int | None = 0, spec: ModelSpec | None = None) -> None:
        ctx = as_context(ctx)
        s = model_spec(cfg, ctx.grid) if spec is None else spec
        super().__init__(s, ctx)
        self.cfg, self.tied = cfg, cfg.tie_embeddings
        self.router_stats = RouterStats(ctx.comm)
        if not self.tied:
            self.embed_tokens = embedding_table(s.part("embed"), ctx.grid)  # (V, C/x)
        self.blocks = nn.ModuleList(MoeBlock(s, ctx, cfg.ln_eps, i, self.router_stats) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, ctx.comm, cfg.ln_eps, "norm")
        self.lm_head = Linear3D.from_spec(s.part("lm_head"), ctx)
        self.register_buffer("inv_freq", inv_frequencies(cfg, s.attention().head_dim), persistent=False)
        self._finish_init(seed)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, **kw) -> torch.Tensor:
        self.router_stats.clear()
        return super().forward(idx, targets, **kw)

    def router_loss(self) -> torch.Tensor | None:
        """This rank's part of the last forward's load-balancing loss (:meth:`RouterStats.loss`)."""
        return self.router_stats.loss()

    def router_loss_weight(self) -> float:
        """What the training loss adds of :meth:`router_loss`: ``router_aux_loss_coef`` when
        ``output_router_logits`` is true (``transformers``' rule), else 0 (logged only)."""
        return self.cfg.router_aux_loss_coef if self.cfg.output_router_logits else 0.0

    def remote_shapes(self) -> dict[str, tuple[int, ...]]:
        """Logical shapes of the model's parameters that other ranks hold and this one does not:
        with expert parallelism, the experts of the other positions of its expert group."""
        out = {}
        for i, block in enumerate(self.blocks):
            for e in range(self.cfg.n_experts):
                if str(e) not in block.mlp.experts:
                    for w in ("gate_up", "down"):
                        pl = self.spec.part(f"mlp.experts.{e}.{w}").placements()["weight"]
                        out[f"blocks.{i}.mlp.experts.{e}.{w}.weight"] = tuple(pl.logical_shape)
        return out


def apply_expert_gemm(model: nn.Module, kernel: str = "auto") -> int:
    """The experts of every MoE layer of ``model`` as grouped GEMMs (``train.expert_gemm``): each
    layer's :class:`~axo4d.nn.experts.ExpertSet` whose experts are whole on the rank (x, y and z of
    one rank for the expert layers, no FP8; experts over the data ranks by ``parallel.expert`` or
    not) replaced by a :class:`~axo4d.nn.experts.GroupedExperts` of the same experts (parameter
    names unchanged). Where the expert layers are split over x, y or z the per-expert loop stays:
    each :class:`~axo4d.nn.linear.Linear3D` runs its own collectives. ``kernel``: 'loop' (nothing
    replaced), 'grouped' or 'auto' (the grouped GEMM where this torch runs it for the dtype and
    device, :func:`~axo4d.nn.grouped_gemm.pick_kernel`). Returns the layers replaced."""
    if kernel == "loop":
        return 0
    layers = [m for m in model.modules() if isinstance(m, MoE) and not isinstance(m.experts, GroupedExperts)]
    whole = [m for m in layers if m.experts.whole()]
    for m in whole:
        m.experts = GroupedExperts(m.experts, kernel)
    return len(whole)


# ---- the plain single-device reference -------------------------------------------------------------
class PlainMoeLayer(nn.Module):
    """Router, experts and the shared expert with its gate (``shared``) as plain ``nn.Linear``
    (names as :class:`axo4d.nn.experts.MoE`'s and :class:`~axo4d.nn.experts.SharedExpertMoE`'s)."""

    def __init__(self, cfg: ModelConfig, norm_topk: bool, shared: bool = False) -> None:
        super().__init__()
        h, f, e = cfg.n_embd, cfg.ffn_hidden or cfg.ffn_mult * cfg.n_embd, cfg.n_experts
        self.k, self.norm_topk = cfg.experts_per_token, norm_topk
        self.router = nn.Linear(h, e, bias=False)
        self.experts = nn.ModuleList(_PlainExpert(h, f) for _ in range(e))
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        if shared:
            self.shared_expert = _PlainExpert(h, cfg.shared_expert_ffn)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(flat), -1, dtype=torch.float32)
        top, chosen = torch.topk(probs, self.k, -1)
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        self.seen.append((probs, chosen))
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out = out.index_add(0, token, expert(flat[token]) * top[token, slot, None].to(flat.dtype))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)


class _PlainExpert(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(h, 2 * f, bias=False), nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x).unflatten(-1, (-1, 2))
        return self.down(F.silu(gu[..., 0]) * gu[..., 1])


class PlainMoeDecoder(nn.Module):
    """Single-device MoE decoder with axo4d's parameter names: loads ``full_state_dict`` of
    :class:`MoeDecoder`; :meth:`router_loss` is the last forward's load-balancing loss."""

    def __init__(self, cfg: ModelConfig, vocab: int | None = None) -> None:
        super().__init__()
        from axo4d.models.plain import PlainLlama

        spec = model_spec(cfg, Grid())
        inner = PlainLlama(cfg, vocab)  # attention, norms, embeddings, head: its children become ours
        self.cfg, self.hd = cfg, spec.attention().head_dim
        names = {p.name for p in spec.block}
        qk, shared = "attn.q_norm" in names, "mlp.shared_expert_gate" in names
        for block in inner.blocks:
            block.mlp = PlainMoeLayer(cfg, cfg.norm_topk_prob, shared)
            if qk:
                block.attn.q_norm, block.attn.k_norm = nn.RMSNorm(self.hd, cfg.ln_eps), nn.RMSNorm(self.hd, cfg.ln_eps)
        for name, child in inner.named_children():
            self.add_module(name, child)
        if not cfg.tie_embeddings:
            self.embed_tokens = inner.embed_tokens
        self.register_buffer("inv_freq", inner.inv_freq, persistent=False)
        self.qk = qk

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            block.mlp.seen.clear()
        table = self.lm_head.weight if self.cfg.tie_embeddings else self.embed_tokens
        x = F.embedding(idx, table)
        from axo4d.nn.rope import rope_tables

        cos, sin = rope_tables(self.inv_freq, torch.arange(idx.shape[1], device=idx.device), x.dtype)
        for block in self.blocks:
            x = _plain_block(block, x, cos, sin, self.qk)
        logits = self.lm_head(self.norm(x))[..., : self.cfg.vocab_size]
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)

    def router_loss(self) -> torch.Tensor:
        """``transformers``' load_balancing_loss_func over the last forward's routers."""
        seen = [s for block in self.blocks for s in block.mlp.seen]
        probs = torch.cat([p for p, _ in seen])  # (L*N, E)
        e = probs.shape[1]
        counts = torch.cat([torch.bincount(c.reshape(-1), minlength=e)[None] for _, c in seen]).sum(0)
        return e * (counts.float() / probs.shape[0] * probs.mean(0)).sum()


def _plain_block(block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk: bool) -> torch.Tensor:
    b, t, _ = x.shape
    r = block.n_head // block.kv
    qkv = block.attn.qkv(block.attn_norm(x)).view(b, t, block.kv, r + 2, block.hd)
    q = qkv[:, :, :, :r].reshape(b, t, -1, block.hd)
    k, v = qkv[:, :, :, r], qkv[:, :, :, r + 1]
    if qk:
        q, k = block.attn.q_norm(q), block.attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + block.attn.proj(y.transpose(1, 2).reshape(b, t, -1))
    return x + block.mlp(block.mlp_norm(x))
