"""Mixtral (``MixtralForCausalLM``): the Llama decoder (no biases, no per-head norms) whose MLP
is an MoE layer of ``num_local_experts`` SwiGLU experts (``w1`` gate, ``w3`` up, ``w2`` down;
width ``intermediate_size``) behind a top-``num_experts_per_tok`` softmax router whose chosen
scores are always renormalised. Full attention (no ``sliding_window``), no router jitter."""

from __future__ import annotations

from pathlib import Path

from axo4d.config import ModelConfig
from axo4d.facts.archs.arch import Arch
from axo4d.facts.archs.layout import RowMap
from axo4d.facts.archs.llama_family import decoder_to_hf_config
from axo4d.facts.archs.moe_family import moe_from_hf, moe_layout, moe_spec, moe_to_hf
from axo4d.facts.grid import Grid
from axo4d.facts.spec import ModelSpec


def mixtral_spec(cfg: ModelConfig, grid: Grid) -> ModelSpec:
    return moe_spec(cfg, grid, "mixtral", qk_norm=False)


def mixtral_from_hf(raw: dict, folder: Path) -> dict:
    return moe_from_hf(raw, folder, "mixtral", "intermediate_size", True)


def mixtral_to_hf(cfg: ModelConfig, template: dict, dtype: str, tied: bool) -> dict:
    out = decoder_to_hf_config(cfg, template, dtype, "MixtralForCausalLM", "mixtral")
    out.update(moe_to_hf(cfg), sliding_window=None, router_jitter_noise=0.0)
    return out


def mixtral_layout(cfg: ModelConfig) -> dict[str, RowMap]:
    return moe_layout(cfg, "block_sparse_moe", "gate", ("w1", "w3", "w2"), qk_norm=False)


ARCH = Arch(
    name="mixtral",
    spec=mixtral_spec,
    model="axo4d.models.moe:MoeDecoder",
    plain="axo4d.models.moe:PlainMoeDecoder",
    hf_architectures=("MixtralForCausalLM",),
    from_hf=mixtral_from_hf,
    to_hf=mixtral_to_hf,
    layout=mixtral_layout,
)
