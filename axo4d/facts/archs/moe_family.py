"""What the mixture-of-experts entries (:mod:`~axo4d.facts.archs.qwen3_moe_family`,
:mod:`~axo4d.facts.archs.mixtral_family`, :mod:`~axo4d.facts.archs.qwen2_moe_family`) share: the
Llama-like decoder whose MLP is an MoE layer (:mod:`axo4d.facts.moe_parts`), with or without a
shared expert, its Hugging Face fields and its tensor layout (one tensor per expert, as the
published checkpoints and ``save_pretrained`` store them)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from axo4d.config import ModelConfig
from axo4d.facts.archs.arch import unsupported
from axo4d.facts.archs.layout import Part, RowMap, one
from axo4d.facts.archs.llama_family import decoder_from_hf, decoder_layout, decoder_spec
from axo4d.facts.grid import Grid
from axo4d.facts.moe_parts import HeadNormSpec, moe_checks, moe_parts, shared_checks, shared_expert_parts
from axo4d.facts.spec import ModelSpec


def moe_spec(
    cfg: ModelConfig, grid: Grid, arch: str, qk_norm: bool, qkv_bias: bool = False, shared: bool = False
) -> ModelSpec:
    """A Llama-like decoder (:func:`decoder_spec`, biases on q/k/v with ``qkv_bias``) whose MLP is
    ``n_experts`` SwiGLU experts of width ``ffn_hidden`` behind a top-``experts_per_token`` router;
    with ``qk_norm`` RMSNorms over each head's queries and keys (``attn.q_norm``, ``attn.k_norm``,
    Qwen3) before RoPE; with ``shared`` a gated dense shared expert of width ``shared_expert_ffn``
    (Qwen2-MoE, :func:`~axo4d.facts.moe_parts.shared_expert_parts`) after the routed ones."""
    base = decoder_spec(cfg, grid, arch, qkv_bias=qkv_bias)
    f = cfg.ffn_hidden or cfg.ffn_mult * cfg.n_embd
    res_std = cfg.init_std / math.sqrt(2 * max(cfg.n_layer, 1))
    attn = tuple(p for p in base.block if not p.name.startswith("mlp."))
    if qk_norm:
        a = base.attention()
        i = [p.name for p in attn].index("attn.qkv") + 1
        norms = tuple(HeadNormSpec(f"attn.{w}_norm", a.head_dim, a.head_axes(grid)) for w in "qk")
        attn = attn[:i] + norms + attn[i:]
    experts = moe_parts(
        cfg.n_embd, cfg.n_experts, cfg.experts_per_token, f, cfg.norm_topk_prob, cfg.init_std, res_std, grid.expert
    )
    checks = base.checks + tuple(moe_checks(cfg.n_experts, cfg.experts_per_token, f, grid))
    if shared:
        experts += shared_expert_parts(cfg.n_embd, cfg.shared_expert_ffn, cfg.init_std, res_std)
        checks += tuple(shared_checks(cfg.shared_expert_ffn, grid))
    elif cfg.shared_expert_ffn:
        checks += (f"shared_expert_ffn={cfg.shared_expert_ffn}: model.arch={arch!r} has no shared expert (use 0)",)
    return dataclasses.replace(base, block=attn + experts, checks=tuple(dict.fromkeys(checks)))


def moe_from_hf(raw: dict, folder: Path, arch: str, ffn_key: str, norm_topk: bool | None) -> dict:
    """The ModelConfig fields of an MoE ``config.json``: the decoder's, the expert count, top-k,
    the expert width (``ffn_key``), the renormalisation (``norm_topk``: fixed by the family, or
    None to read ``norm_topk_prob``), the load-balancing loss's coefficient and whether the
    training loss adds it (``output_router_logits``)."""
    if raw.get("router_jitter_noise"):
        raise unsupported(folder, "router_jitter_noise", raw["router_jitter_noise"], "0 (no jitter)")
    if raw.get("use_sliding_window") or (raw.get("sliding_window") and arch == "mixtral"):
        key = "use_sliding_window" if raw.get("use_sliding_window") else "sliding_window"
        raise unsupported(folder, key, raw[key], "none (full attention)")
    out = decoder_from_hf(raw, folder, arch)
    out.update(
        ffn_hidden=int(raw[ffn_key]),
        n_experts=int(raw.get("num_experts") or raw["num_local_experts"]),
        experts_per_token=int(raw["num_experts_per_tok"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)) if norm_topk is None else norm_topk,
        router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
        output_router_logits=bool(raw.get("output_router_logits", False)),
    )
    return out


def moe_to_hf(cfg: ModelConfig) -> dict:
    """The MoE fields of an exported ``config.json``."""
    return {
        "num_local_experts": cfg.n_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": cfg.output_router_logits,
    }


def moe_layout(
    cfg: ModelConfig,
    mlp: str,
    router: str,
    names: tuple[str, str, str],
    qk_norm: bool,
    qkv_bias: bool = False,
    shared: bool = False,
) -> dict[str, RowMap]:
    """axo4d parameter name -> RowMap: the decoder's attention (q/k/v biases with ``qkv_bias``) and
    norms, ``mlp.router`` from ``model.layers.N.{mlp}.{router}``, expert ``e``'s gate_up
    interleaved from its ``names[0]`` (gate) and ``names[1]`` (up), its down from ``names[2]``;
    with ``shared`` the shared expert's alike from ``{mlp}.shared_expert.*`` and its gate from
    ``{mlp}.shared_expert_gate``."""
    out = {k: v for k, v in decoder_layout(cfg, qkv_bias).items() if ".mlp." not in k}
    f = cfg.ffn_hidden or cfg.ffn_mult * cfg.n_embd
    hd = cfg.head_dim or cfg.n_embd // cfg.n_head
    gate, up, down = names
    for i in range(cfg.n_layer):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        out[q + "mlp.router.weight"] = one(p + f"{mlp}.{router}.weight", cfg.n_experts)
        for e in range(cfg.n_experts):
            src = p + f"{mlp}.experts.{e}."
            out[q + f"mlp.experts.{e}.gate_up.weight"] = RowMap(
                (Part(src + f"{gate}.weight", 1), Part(src + f"{up}.weight", 1)), f
            )
            out[q + f"mlp.experts.{e}.down.weight"] = one(src + f"{down}.weight", cfg.n_embd)
        if shared:
            src, fs = p + f"{mlp}.shared_expert.", cfg.shared_expert_ffn
            out[q + "mlp.shared_expert.gate_up.weight"] = RowMap(
                (Part(src + f"{gate}.weight", 1), Part(src + f"{up}.weight", 1)), fs
            )
            out[q + "mlp.shared_expert.down.weight"] = one(src + f"{down}.weight", cfg.n_embd)
            out[q + "mlp.shared_expert_gate.weight"] = one(p + f"{mlp}.shared_expert_gate.weight", 1)
        if qk_norm:
            out[q + "attn.q_norm.weight"] = one(p + "self_attn.q_norm.weight", hd)
            out[q + "attn.k_norm.weight"] = one(p + "self_attn.k_norm.weight", hd)
    return out


__all__ = ["moe_spec", "moe_from_hf", "moe_to_hf", "moe_layout"]
