"""Hugging Face ``config.json`` <-> :class:`ModelConfig`.

:func:`read_hf_config` finds the registry entry (:mod:`axo4d.facts.archs`) of a folder's ``config.json``
by its ``architectures`` and lets it translate the fields, rejecting those axo4d does not implement
with one line naming the field and what is supported; :func:`hf_config_dict` writes one back on
export.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from axo4d.config import ModelConfig
from axo4d.config.errors import CheckpointError
from axo4d.facts.archs import arch_for_hf, get_arch


def is_hf_folder(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file()


# ---- config.json -> ModelConfig ---------------------------------------------------------------
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
    arch = arch_for_hf(archs, folder)
    try:
        fields = arch.from_hf(raw, folder)
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
    """``config.json`` for ``cfg``: the source folder's (``template``) with the shape fields set by
    the architecture's entry."""
    return get_arch(cfg.arch).to_hf(cfg, dict(template or {}), str(dtype).replace("torch.", ""), tied)
