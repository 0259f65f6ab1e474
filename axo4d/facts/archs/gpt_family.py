"""GPT-2 style decoder: LayerNorm, one QKV layer with rows per head, GELU MLP, learned positions,
an untied head (``GPT2LMHeadModel`` checkpoints, whose head may be tied to ``wte``)."""

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
    padded_vocab,
    shape_checks,
)


def gpt_spec(cfg: ModelConfig, grid: Grid) -> ModelSpec:
    """The parts: per block ln1, attn.qkv (rows per head: q, k, v), attention, attn.proj, ln2,
    mlp.up, mlp.down; embeddings wte, wpe; head ln_f, lm_head, the loss."""
    h, f, l = cfg.n_embd, cfg.ffn_hidden or cfg.ffn_mult * cfg.n_embd, cfg.n_layer
    std, res_std = cfg.init_std, cfg.init_std / math.sqrt(2 * max(l, 1))
    vocab = padded_vocab(cfg.vocab_size, cfg.vocab_multiple, grid.x * grid.y)
    checks = tuple(shape_checks(cfg))
    if cfg.head_dim and cfg.head_dim * cfg.n_head != h:
        checks += (f"head_dim={cfg.head_dim} must be n_embd/n_head={h // max(cfg.n_head, 1)} for arch 'gpt'",)
    block = (
        NormSpec("ln1", h, cfg.bias),
        LinearSpec("attn.qkv", h, 3 * h, bias=cfg.bias, init_std=std),
        AttentionSpec("attn", cfg.n_head, cfg.n_head, h // cfg.n_head if cfg.n_head else 0, cfg.seq_len),
        LinearSpec("attn.proj", h, h, transposed=True, bias=cfg.bias, init_std=res_std),
        NormSpec("ln2", h, cfg.bias),
        LinearSpec("mlp.up", h, f, bias=cfg.bias, init_std=std),
        LinearSpec("mlp.down", f, h, transposed=True, bias=cfg.bias, init_std=res_std),
    )
    head = (
        NormSpec("ln_f", h, cfg.bias),
        LinearSpec("lm_head", h, vocab, n_logical=cfg.vocab_size, init_std=std),
        CrossEntropySpec(),
    )
    emb = (EmbeddingSpec("wte", cfg.vocab_size, h, std), EmbeddingSpec("wpe", cfg.seq_len, h, std, slices=False))
    return ModelSpec("gpt", l, h, cfg.seq_len, cfg.vocab_size, vocab, grid, emb, block, head, checks)


def gpt2_from_hf(raw: dict, folder: Path) -> dict:
    """``GPT2LMHeadModel``'s ``config.json`` -> ModelConfig fields."""
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise unsupported(folder, "activation_function", act, "'gelu_new' (tanh GELU)")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if raw.get(key):
            raise unsupported(folder, key, raw[key], "false")
    h = int(raw["n_embd"])
    return {
        "arch": "gpt",
        "n_layer": int(raw["n_layer"]),
        "n_embd": h,
        "n_head": int(raw["n_head"]),
        "ffn_hidden": int(raw.get("n_inner") or 4 * h),
        "vocab_size": int(raw["vocab_size"]),
        "seq_len": int(raw.get("n_positions", 1024)),
        "bias": True,
        "ln_eps": float(raw.get("layer_norm_epsilon", 1e-5)),
        "init_std": float(raw.get("initializer_range", 0.02)),
    }


def gpt2_to_hf(cfg: ModelConfig, template: dict, dtype: str, tied: bool) -> dict:
    """The source folder's ``config.json`` (``template``) with a ``GPT2LMHeadModel``'s fields set."""
    return {
        **template,
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.ffn_hidden or cfg.ffn_mult * cfg.n_embd,
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.seq_len,
        "layer_norm_epsilon": cfg.ln_eps,
        "activation_function": "gelu_new",
        "tie_word_embeddings": tied,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def gpt2_layout(cfg: ModelConfig) -> dict[str, RowMap]:
    """axo4d parameter name -> RowMap of a ``GPT2LMHeadModel`` checkpoint (its ``Conv1D`` weights
    are stored transposed; the per-head QKV rows come from three row ranges of ``c_attn``)."""
    h, nh = cfg.n_embd, cfg.n_head
    hd, f = h // nh, cfg.ffn_hidden or cfg.ffn_mult * h
    out: dict[str, RowMap] = {
        "wte": one("transformer.wte.weight", cfg.vocab_size),
        "wpe": one("transformer.wpe.weight", cfg.seq_len),
    }
    for i in range(cfg.n_layer):
        p, q = f"transformer.h.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            name = p + f"attn.c_attn.{kind}"
            out[q + f"attn.qkv.{kind}"] = RowMap(
                (Part(name, hd, 0), Part(name, hd, h), Part(name, hd, 2 * h)), nh, transposed=kind == "weight"
            )
            out[q + f"attn.proj.{kind}"] = one(p + f"attn.c_proj.{kind}", h, kind == "weight")
            out[q + f"mlp.up.{kind}"] = one(p + f"mlp.c_fc.{kind}", f, kind == "weight")
            out[q + f"mlp.down.{kind}"] = one(p + f"mlp.c_proj.{kind}", h, kind == "weight")
            out[q + f"ln1.{kind}"] = one(p + f"ln_1.{kind}", h)
            out[q + f"ln2.{kind}"] = one(p + f"ln_2.{kind}", h)
        if not cfg.bias:
            for k in [k for k in out if k.startswith(q) and k.endswith(".bias")]:
                del out[k]
    out["ln_f.weight"] = one("transformer.ln_f.weight", h)
    if cfg.bias:
        out["ln_f.bias"] = one("transformer.ln_f.bias", h)
    out["lm_head.weight"] = one("lm_head.weight", cfg.vocab_size)
    return out


ARCH = Arch(
    name="gpt",
    spec=gpt_spec,
    model="axo4d.models.gpt:GPT",
    plain="axo4d.models.plain:PlainGPT",
    hf_architectures=("GPT2LMHeadModel",),
    from_hf=gpt2_from_hf,
    to_hf=gpt2_to_hf,
    layout=gpt2_layout,
    hf_tied_head=("lm_head.weight", "wte"),
)
