"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2's attention (biases on the query, key and value
projections, no per-head norms) and in every block an MoE layer of ``num_experts`` SwiGLU experts
(width ``moe_intermediate_size``) behind a top-``num_experts_per_tok`` softmax router that
renormalises the chosen scores when ``norm_topk_prob`` says so, plus a dense shared expert (width
``shared_expert_intermediate_size``) every token passes through, its output times
``sigmoid(shared_expert_gate(x))``, added to the routed experts' (docs/design.md section 16).
Every block sparse (``decoder_sparse_step`` 1, no ``mlp_only_layers``), full attention."""

from __future__ import annotations

from pathlib import Path

from axo4d.config import ModelConfig
from axo4d.facts.archs.arch import Arch, unsupported
from axo4d.facts.archs.layout import RowMap
from axo4d.facts.archs.llama_family import decoder_to_hf_config
from axo4d.facts.archs.moe_family import moe_from_hf, moe_layout, moe_spec, moe_to_hf
from axo4d.facts.grid import Grid
from axo4d.facts.spec import ModelSpec


def qwen2_moe_spec(cfg: ModelConfig, grid: Grid) -> ModelSpec:
    return moe_spec(cfg, grid, "qwen2_moe", qk_norm=False, qkv_bias=True, shared=True)


def qwen2_moe_from_hf(raw: dict, folder: Path) -> dict:
    if not raw.get("qkv_bias", True):
        raise unsupported(folder, "qkv_bias", raw["qkv_bias"], "true (biases on q, k and v)")
    if raw.get("mlp_only_layers"):
        raise unsupported(folder, "mlp_only_layers", raw["mlp_only_layers"], "[] (every block an MoE layer)")
    if raw.get("decoder_sparse_step", 1) != 1:
        raise unsupported(folder, "decoder_sparse_step", raw["decoder_sparse_step"], "1 (every block an MoE layer)")
    layers = raw.get("layer_types") or []
    if any(kind != "full_attention" for kind in layers):
        raise unsupported(folder, "layer_types", sorted(set(layers)), "'full_attention' only")
    shared = int(raw.get("shared_expert_intermediate_size") or 0)
    if shared < 1:
        raise unsupported(folder, "shared_expert_intermediate_size", shared, "a positive width")
    out = moe_from_hf(raw, folder, "qwen2_moe", "moe_intermediate_size", None)
    out["shared_expert_ffn"] = shared
    return out


def qwen2_moe_to_hf(cfg: ModelConfig, template: dict, dtype: str, tied: bool) -> dict:
    out = decoder_to_hf_config(cfg, template, dtype, "Qwen2MoeForCausalLM", "qwen2_moe")
    out.update(
        moe_to_hf(cfg),
        num_experts=cfg.n_experts,
        moe_intermediate_size=out["intermediate_size"],
        intermediate_size=template.get("intermediate_size", out["intermediate_size"]),
        shared_expert_intermediate_size=cfg.shared_expert_ffn,
        norm_topk_prob=cfg.norm_topk_prob,
        qkv_bias=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
        layer_types=["full_attention"] * cfg.n_layer,
    )
    return out


def qwen2_moe_layout(cfg: ModelConfig) -> dict[str, RowMap]:
    return moe_layout(cfg, "mlp", "gate", ("gate_proj", "up_proj", "down_proj"), False, qkv_bias=True, shared=True)


ARCH = Arch(
    name="qwen2_moe",
    spec=qwen2_moe_spec,
    model="axo4d.models.moe:MoeDecoder",
    plain="axo4d.models.moe:PlainMoeDecoder",
    hf_architectures=("Qwen2MoeForCausalLM",),
    from_hf=qwen2_moe_from_hf,
    to_hf=qwen2_moe_to_hf,
    layout=qwen2_moe_layout,
)
