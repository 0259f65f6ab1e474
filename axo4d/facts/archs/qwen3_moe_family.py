"""Qwen3-MoE (``Qwen3MoeForCausalLM``): the Llama-like decoder with RMSNorms over each head's
queries and keys before RoPE, no biases, and in every block an MoE layer of ``num_experts``
SwiGLU experts (width ``moe_intermediate_size``) behind a top-``num_experts_per_tok`` softmax
router that renormalises the chosen scores when ``norm_topk_prob`` says so. Every block sparse
(``decoder_sparse_step`` 1, no ``mlp_only_layers``), full attention."""

from __future__ import annotations

from pathlib import Path

from axo4d.config import ModelConfig
from axo4d.facts.archs.arch import Arch, unsupported
from axo4d.facts.archs.layout import RowMap
from axo4d.facts.archs.llama_family import decoder_to_hf_config
from axo4d.facts.archs.moe_family import moe_from_hf, moe_layout, moe_spec, moe_to_hf
from axo4d.facts.grid import Grid
from axo4d.facts.spec import ModelSpec


def qwen3_moe_spec(cfg: ModelConfig, grid: Grid) -> ModelSpec:
    return moe_spec(cfg, grid, "qwen3_moe", qk_norm=True)


def qwen3_moe_from_hf(raw: dict, folder: Path) -> dict:
    if raw.get("attention_bias"):
        raise unsupported(folder, "attention_bias", raw["attention_bias"], "false")
    if raw.get("mlp_only_layers"):
        raise unsupported(folder, "mlp_only_layers", raw["mlp_only_layers"], "[] (every block an MoE layer)")
    if raw.get("decoder_sparse_step", 1) != 1:
        raise unsupported(folder, "decoder_sparse_step", raw["decoder_sparse_step"], "1 (every block an MoE layer)")
    return moe_from_hf(raw, folder, "qwen3_moe", "moe_intermediate_size", None)


def qwen3_moe_to_hf(cfg: ModelConfig, template: dict, dtype: str, tied: bool) -> dict:
    out = decoder_to_hf_config(cfg, template, dtype, "Qwen3MoeForCausalLM", "qwen3_moe")
    out.update(
        moe_to_hf(cfg),
        moe_intermediate_size=out["intermediate_size"],
        intermediate_size=template.get("intermediate_size", out["intermediate_size"]),
        norm_topk_prob=cfg.norm_topk_prob,
        attention_bias=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
    )
    return out


def qwen3_moe_layout(cfg: ModelConfig) -> dict[str, RowMap]:
    return moe_layout(cfg, "mlp", "gate", ("gate_proj", "up_proj", "down_proj"), qk_norm=True)


ARCH = Arch(
    name="qwen3_moe",
    spec=qwen3_moe_spec,
    model="axo4d.models.moe:MoeDecoder",
    plain="axo4d.models.moe:PlainMoeDecoder",
    hf_architectures=("Qwen3MoeForCausalLM",),
    from_hf=qwen3_moe_from_hf,
    to_hf=qwen3_moe_to_hf,
    layout=qwen3_moe_layout,
)
