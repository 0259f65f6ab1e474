"""Llama 3.x: RMSNorm, RoPE (with Llama 3.1's frequency scaling), grouped-query attention with one
QKV layer whose rows are ordered per kv group, SwiGLU with gate and up in one layer, tied or untied
embeddings, no biases (``LlamaForCausalLM`` checkpoints). :func:`decoder_spec` and the Hugging Face
helpers here are shared by the Llama-like entries."""

from __future__ import annotations

import math
from pathlib import Path

from axo4d.config import ModelConfig
from axo4d.facts.archs.arch import Arch, unsupported
from axo4d.facts.archs.layout import Part, RowMap, one
from axo4d.facts.grid import Grid
from axo4d.facts.spec import (
    AttentionSpec,
    CrossEntropySpec,
    EmbeddingSpec,
    LinearSpec,
    ModelSpec,
    NormSpec,
    TiedEmbeddingSpec,
    padded_vocab,
    shape_checks,
)


def decoder_spec(cfg: ModelConfig, grid: Grid, arch: str, qkv_bias: bool = False) -> ModelSpec:
    """The parts of a Llama-like decoder named ``arch``: per block attn_norm, attn.qkv (rows per kv
    group: that group's queries, its key, its value; with ``qkv_bias`` a bias on those rows),
    attention, attn.proj, mlp_norm, mlp.gate_up (rows interleaved gate/up per feature), mlp.down;
    the embedding (or the head's weight, tied); head norm, lm_head, the loss."""
    h, l = cfg.n_embd, cfg.n_layer
    checks = shape_checks(cfg)
    hd = cfg.head_dim or (h // cfg.n_head if cfg.n_head else 0)
    kv = cfg.n_kv_head or cfg.n_head
    f = cfg.ffn_hidden or cfg.ffn_mult * h
    if kv < 1 or (cfg.n_head and cfg.n_head % kv):
        checks.append(f"n_head={cfg.n_head} not divisible by n_kv_head={kv}")
    if hd % 2:
        checks.append(f"head_dim={hd} must be even (RoPE rotates pairs)")
    if f % (grid.x * grid.y):  # gate/up pairs whole in every rank's block (section 15)
        checks.append(f"ffn_hidden={f} not divisible by G_x*G_y={grid.x * grid.y}")
    std, res_std = cfg.init_std, cfg.init_std / math.sqrt(2 * max(l, 1))
    vocab = padded_vocab(cfg.vocab_size, cfg.vocab_multiple, grid.x * grid.y)
    block = (
        NormSpec("attn_norm", h, bias=False, rms=True),
        LinearSpec("attn.qkv", h, (cfg.n_head + 2 * kv) * hd, bias=qkv_bias, init_std=std),
        AttentionSpec("attn", cfg.n_head, kv, hd, cfg.seq_len),
        LinearSpec("attn.proj", cfg.n_head * hd, h, transposed=True, init_std=res_std),
        NormSpec("mlp_norm", h, bias=False, rms=True),
        LinearSpec("mlp.gate_up", h, 2 * f, init_std=std),
        LinearSpec("mlp.down", f, h, transposed=True, init_std=res_std),
    )
    lm_head = LinearSpec("lm_head", h, vocab, n_logical=cfg.vocab_size, init_std=std)
    head = (NormSpec("norm", h, bias=False, rms=True), lm_head, CrossEntropySpec())
    emb = (
        (TiedEmbeddingSpec("embed", lm_head),)
        if cfg.tie_embeddings
        else (EmbeddingSpec("embed", cfg.vocab_size, h, std),)
    )
    return ModelSpec(arch, l, h, cfg.seq_len, cfg.vocab_size, vocab, grid, emb, block, head, tuple(checks))


def llama_spec(cfg: ModelConfig, grid: Grid) -> ModelSpec:
    return decoder_spec(cfg, grid, "llama")


# ---- Hugging Face ---------------------------------------------------------------------------------
def rope_from_hf(raw: dict, folder: Path) -> dict:
    """RoPE fields of a ``config.json``: the base and 'default' or 'llama3' scaling."""
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(rp.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = rp.get("rope_type", rp.get("type", "default")) if rp else "default"
    if kind in (None, "default"):
        return {"rope_theta": theta, "rope_scaling": ""}
    if kind != "llama3":
        raise unsupported(folder, "rope_scaling type", kind, "none/'default' or 'llama3'")
    return {
        "rope_theta": theta,
        "rope_scaling": "llama3",
        "rope_factor": float(rp["factor"]),
        "rope_low_freq_factor": float(rp["low_freq_factor"]),
        "rope_high_freq_factor": float(rp["high_freq_factor"]),
        "rope_original_max_positions": int(
            rp.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    }


def decoder_from_hf(raw: dict, folder: Path, arch: str) -> dict:
    """The ModelConfig fields every Llama-like ``config.json`` shares (``arch`` named)."""
    if raw.get("hidden_act", "silu") != "silu":
        raise unsupported(folder, "hidden_act", raw["hidden_act"], "'silu'")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise unsupported(folder, "pretraining_tp", raw["pretraining_tp"], "1")
    h, nh = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    hd = int(raw.get("head_dim") or h // nh)
    return {
        "arch": arch,
        "n_layer": int(raw["num_hidden_layers"]),
        "n_embd": h,
        "n_head": nh,
        "n_kv_head": int(raw.get("num_key_value_heads") or nh),
        "head_dim": 0 if hd * nh == h else hd,
        "ffn_hidden": int(raw["intermediate_size"]),
        "vocab_size": int(raw["vocab_size"]),
        "seq_len": int(raw.get("max_position_embeddings", 2048)),
        "bias": False,
        "ln_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "init_std": float(raw.get("initializer_range", 0.02)),
        **rope_from_hf(raw, folder),
    }


def llama_from_hf(raw: dict, folder: Path) -> dict:
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise unsupported(folder, key, raw[key], "false (Llama has no biases)")
    return decoder_from_hf(raw, folder, "llama")


def decoder_to_hf(cfg: ModelConfig, template: dict, dtype: str) -> dict:
    """The shape fields every Llama-like ``config.json`` shares."""
    hd = cfg.head_dim or cfg.n_embd // cfg.n_head
    rope: dict = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling == "llama3":
        rope.update(
            rope_type="llama3",
            factor=cfg.rope_factor,
            low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_positions,
        )
    return {
        "hidden_size": cfg.n_embd,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head or cfg.n_head,
        "head_dim": hd,
        "intermediate_size": cfg.ffn_hidden or cfg.ffn_mult * cfg.n_embd,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": template.get("max_position_embeddings", cfg.seq_len),
        "rms_norm_eps": cfg.ln_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def decoder_to_hf_config(cfg: ModelConfig, template: dict, dtype: str, architecture: str, model_type: str) -> dict:
    """The source folder's ``config.json`` (``template``) with a Llama-like model's fields set."""
    out = {k: v for k, v in template.items() if k != "rope_scaling"}
    out.update(architectures=[architecture], model_type=model_type, **decoder_to_hf(cfg, template, dtype))
    return out


def llama_to_hf(cfg: ModelConfig, template: dict, dtype: str, tied: bool) -> dict:
    out = decoder_to_hf_config(cfg, template, dtype, "LlamaForCausalLM", "llama")
    out.update(attention_bias=False, mlp_bias=False)
    return out


def decoder_layout(cfg: ModelConfig, qkv_bias: bool = False) -> dict[str, RowMap]:
    """axo4d parameter name -> RowMap of a Llama-like checkpoint (``model.layers.N.self_attn.q_proj``
    ...); with ``qkv_bias`` the q/k/v biases too."""
    h, nh = cfg.n_embd, cfg.n_head
    kv, hd = cfg.n_kv_head or nh, cfg.head_dim or cfg.n_embd // cfg.n_head
    f = cfg.ffn_hidden or cfg.ffn_mult * h
    out: dict[str, RowMap] = {}
    for i in range(cfg.n_layer):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        kinds = ("weight", "bias") if qkv_bias else ("weight",)
        for kind in kinds:
            out[q + f"attn.qkv.{kind}"] = RowMap(
                (
                    Part(p + f"self_attn.q_proj.{kind}", nh // kv * hd),
                    Part(p + f"self_attn.k_proj.{kind}", hd),
                    Part(p + f"self_attn.v_proj.{kind}", hd),
                ),
                kv,
            )
        out[q + "attn.proj.weight"] = one(p + "self_attn.o_proj.weight", h)
        out[q + "mlp.gate_up.weight"] = RowMap(
            (Part(p + "mlp.gate_proj.weight", 1), Part(p + "mlp.up_proj.weight", 1)), f
        )
        out[q + "mlp.down.weight"] = one(p + "mlp.down_proj.weight", h)
        out[q + "attn_norm.weight"] = one(p + "input_layernorm.weight", h)
        out[q + "mlp_norm.weight"] = one(p + "post_attention_layernorm.weight", h)
    out["norm.weight"] = one("model.norm.weight", h)
    if cfg.tie_embeddings:
        out["lm_head.weight"] = one("model.embed_tokens.weight", cfg.vocab_size)
    else:
        out["embed_tokens"] = one("model.embed_tokens.weight", cfg.vocab_size)
        out["lm_head.weight"] = one("lm_head.weight", cfg.vocab_size)
    return out


ARCH = Arch(
    name="llama",
    spec=llama_spec,
    model="axo4d.models.llama:Llama",
    plain="axo4d.models.plain:PlainLlama",
    hf_architectures=("LlamaForCausalLM",),
    from_hf=llama_from_hf,
    to_hf=llama_to_hf,
    layout=decoder_layout,
)
