"""Hugging Face ``config.json`` <-> :class:`ModelConfig`.

:func:`read_hf_config` translates a folder's ``config.json`` (``LlamaForCausalLM`` -> ``arch:
llama``, ``GPT2LMHeadModel`` -> ``arch: gpt``) and rejects fields axo4d does not implement with
one line naming the field and what is supported; :func:`hf_config_dict` writes one back on export.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from axo4d.config import ModelConfig
from axo4d.errors import CheckpointError

ARCHS = {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt"}


def is_hf_folder(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file()


# ---- config.json -> ModelConfig ---------------------------------------------------------------
def _bad(folder: Path, field: str, value: Any, valid: str) -> CheckpointError:
    return CheckpointError(f"{str(folder / 'config.json')!r}: unsupported {field}={value!r}; axo4d supports {valid}")


def _rope(raw: dict, folder: Path) -> dict:
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(rp.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = rp.get("rope_type", rp.get("type", "default")) if rp else "default"
    if kind in (None, "default"):
        return {"rope_theta": theta, "rope_scaling": ""}
    if kind != "llama3":
        raise _bad(folder, "rope_scaling type", kind, "none/'default' or 'llama3'")
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


def _llama(raw: dict, folder: Path) -> dict:
    if raw.get("hidden_act", "silu") != "silu":
        raise _bad(folder, "hidden_act", raw["hidden_act"], "'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise _bad(folder, key, raw[key], "false (Llama has no biases)")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise _bad(folder, "pretraining_tp", raw["pretraining_tp"], "1")
    h, nh = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    hd = int(raw.get("head_dim") or h // nh)
    return {
        "arch": "llama",
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
        **_rope(raw, folder),
    }


def _gpt2(raw: dict, folder: Path) -> dict:
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise _bad(folder, "activation_function", act, "'gelu_new' (tanh GELU)")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if raw.get(key):
            raise _bad(folder, key, raw[key], "false")
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


def read_hf_config(folder: str | Path) -> tuple[ModelConfig, dict]:
    """``(ModelConfig, raw config.json)`` of a Hugging Face model folder; a clear
    :class:`CheckpointError` for a missing file or an unsupported architecture or field."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {str(folder)!r} does not exist")
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{str(folder)!r} has no config.json: not a Hugging Face model folder "
            f"(expected config.json, *.safetensors and tokenizer.json)"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} is not readable JSON: {e}") from None
    archs = raw.get("architectures") or []
    arch = next((ARCHS[a] for a in archs if a in ARCHS), None)
    if arch is None:
        raise _bad(folder, "architectures", archs, ", ".join(ARCHS))
    try:
        fields = _llama(raw, folder) if arch == "llama" else _gpt2(raw, folder)
    except KeyError as e:
        raise CheckpointError(f"{str(path)!r} lacks the field {e.args[0]!r} that {archs[0]} needs") from None
    return ModelConfig(**fields), raw


def apply_hf_config(run_cfg, folder: str | Path, model_overrides: dict | None = None):
    """``run_cfg`` with its model section from ``folder``'s ``config.json``, then the user's
    ``--set model.*`` overrides (e.g. a shorter ``seq_len``), and the folder's tokenizer as
    ``data.tokenizer`` unless one was given."""
    from axo4d.config import _build

    model, _ = read_hf_config(folder)
    if model_overrides:
        model = _build(ModelConfig, {**dataclasses.asdict(model), **model_overrides}, "model.")
    data = run_cfg.data
    tok = Path(folder) / "tokenizer.json"
    if data.tokenizer == "byte" and tok.is_file():
        data = dataclasses.replace(data, tokenizer=str(tok))
    return dataclasses.replace(run_cfg, model=model, data=data)


# ---- export ---------------------------------------------------------------------------------------
def hf_config_dict(cfg: ModelConfig, template: dict | None, dtype: torch.dtype, tied: bool) -> dict:
    """``config.json`` for ``cfg``: the source folder's (``template``) with the shape fields set."""
    out = dict(template or {})
    dt = str(dtype).replace("torch.", "")
    if cfg.arch == "llama":
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
        out.pop("rope_scaling", None)
        out.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_size=cfg.n_embd,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            num_key_value_heads=cfg.n_kv_head or cfg.n_head,
            head_dim=hd,
            intermediate_size=cfg.ffn_hidden or cfg.ffn_mult * cfg.n_embd,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=out.get("max_position_embeddings", cfg.seq_len),
            rms_norm_eps=cfg.ln_eps,
            tie_word_embeddings=cfg.tie_embeddings,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            rope_theta=cfg.rope_theta,
            rope_parameters=rope,
            dtype=dt,
            torch_dtype=dt,
        )
    else:
        out.update(
            architectures=["GPT2LMHeadModel"],
            model_type="gpt2",
            n_embd=cfg.n_embd,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            n_inner=cfg.ffn_hidden or cfg.ffn_mult * cfg.n_embd,
            vocab_size=cfg.vocab_size,
            n_positions=cfg.seq_len,
            layer_norm_epsilon=cfg.ln_eps,
            activation_function="gelu_new",
            tie_word_embeddings=tied,
            dtype=dt,
            torch_dtype=dt,
        )
    return out
