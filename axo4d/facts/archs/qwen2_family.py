"""Qwen2: the Llama-like decoder (:mod:`axo4d.facts.archs.llama_family`) with biases on the query, key and value
projections (``Qwen2ForCausalLM`` checkpoints; full attention only, no sliding window). Built by the
Llama model class and reference: their layers read the bias from this entry's parts."""

from __future__ import annotations

from pathlib import Path

from axo4d.config import ModelConfig
from axo4d.facts.archs.arch import Arch, unsupported
from axo4d.facts.archs.layout import RowMap
from axo4d.facts.archs.llama_family import decoder_from_hf, decoder_layout, decoder_spec, decoder_to_hf_config
from axo4d.facts.grid import Grid
from axo4d.facts.spec import ModelSpec


def qwen2_spec(cfg: ModelConfig, grid: Grid) -> ModelSpec:
    return decoder_spec(cfg, grid, "qwen2", qkv_bias=True)


def qwen2_from_hf(raw: dict, folder: Path) -> dict:
    if raw.get("use_sliding_window"):
        raise unsupported(folder, "use_sliding_window", raw["use_sliding_window"], "false (full attention)")
    layers = raw.get("layer_types") or []
    if any(kind != "full_attention" for kind in layers):
        raise unsupported(folder, "layer_types", sorted(set(layers)), "'full_attention' only")
    return decoder_from_hf(raw, folder, "qwen2")


def qwen2_to_hf(cfg: ModelConfig, template: dict, dtype: str, tied: bool) -> dict:
    out = decoder_to_hf_config(cfg, template, dtype, "Qwen2ForCausalLM", "qwen2")
    out.update(use_sliding_window=False, layer_types=["full_attention"] * cfg.n_layer)
    return out


def qwen2_layout(cfg: ModelConfig) -> dict[str, RowMap]:
    return decoder_layout(cfg, qkv_bias=True)


ARCH = Arch(
    name="qwen2",
    spec=qwen2_spec,
    model="axo4d.models.llama:Llama",
    plain="axo4d.models.plain:PlainLlama",
    hf_architectures=("Qwen2ForCausalLM",),
    from_hf=qwen2_from_hf,
    to_hf=qwen2_to_hf,
    layout=qwen2_layout,
)
