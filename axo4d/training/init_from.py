"""``--init-from PATH``: start a run (or generation) from a Hugging Face folder or from another
run's axo4d checkpoint, on any grid.

* a Hugging Face folder (``config.json``): the model section comes from ``config.json``, then the
  model keys of the user's YAML file, then ``--set model.*`` (each later one wins), the tokenizer
  from the folder, the weights from its safetensors
  files, each rank reading only its own slices (:mod:`axo4d.training.hf.weights`); ``config.json`` and
  the tokenizer files are kept in ``OUT/hf/`` so ``export-hf`` writes a folder like the source;
* an axo4d checkpoint (a ``step_N`` folder or a run folder): its model config and weights;
  the optimizer starts fresh at step 0 (unlike ``--resume``). Every file is checked against its
  CRC-32 first, the ranks sharing the files (as a resume does); a mismatch stops every rank
  naming the file, before anything is read.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from torch import nn

from axo4d.config import RunConfig, parse_overrides
from axo4d.config.errors import CheckpointError, DataError
from axo4d.dist.comm import Comm
from axo4d.training.hf import hf_config
from axo4d.training.hf import weights as hf


def init_kind(path: str | Path) -> str:
    """'hf' or 'checkpoint' (a clear error for anything else)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(
            f"--init-from {str(path)!r} does not exist (give a Hugging Face model folder or an axo4d checkpoint)"
        )
    if hf_config.is_hf_folder(p):
        return "hf"
    if p.is_dir() and (any(p.glob("*.safetensors")) or (p / "tokenizer.json").is_file()):
        hf_config.read_hf_config(p)  # a Hugging Face folder without config.json: says so
    return "checkpoint"


def _model_layers(sets: list[str], config: str | None) -> tuple[dict, dict]:
    """The model keys of the user's YAML files (none for a named config) and of ``--set``."""
    from axo4d.config import user_model_keys

    return (user_model_keys(config) if config else {}), parse_overrides(sets).get("model", {})


def config_with_init(cfg: RunConfig, path: str | Path, sets: list[str], config: str | None = None) -> RunConfig:
    """``cfg`` with the model (and, for Hugging Face, the tokenizer) of ``path``: the source's
    ``config.json`` (or saved config), then the model keys of the YAML file ``config`` (its own,
    not a bundled base's), then ``--set model.*``: each later one wins."""
    yaml_keys, set_keys = _model_layers(sets, config)
    model_sets = {**yaml_keys, **set_keys}
    if init_kind(path) == "hf":
        return hf_config.apply_hf_config(cfg, path, model_sets)
    from axo4d.config import _build
    from axo4d.training.checkpointing.checkpointer import find_checkpoint, read_info

    saved = read_info(find_checkpoint(path))["config"]
    model = _build(type(saved.model), {**dataclasses.asdict(saved.model), **model_sets}, "model.")
    data = cfg.data if cfg.data.tokenizer != "byte" else dataclasses.replace(cfg.data, tokenizer=saved.data.tokenizer)
    return dataclasses.replace(cfg, model=model, data=data)


def model_sources(cfg: RunConfig, path: str | Path, sets: list[str], config: str | None = None) -> str:
    """The start-up line naming where each model field of ``cfg`` came from under ``--init-from``:
    ``model: n_layer=2 (config.json), seq_len=64 (--set), dropout=0.1 (yaml)``."""
    from axo4d.config.loader import _field_name

    yaml_keys, set_keys = _model_layers(sets, config)
    base = "config.json" if init_kind(path) == "hf" else "checkpoint"
    where = {**{_field_name(k): "yaml" for k in yaml_keys}, **{_field_name(k): "--set" for k in set_keys}}
    fields = dataclasses.asdict(cfg.model)
    return "model: " + ", ".join(f"{k}={v} ({where.get(k, base)})" for k, v in fields.items())


def check_tokenizer(cfg: RunConfig) -> None:
    """The tokenizer's ids must fit the model's vocabulary."""
    from axo4d.training.datasets.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer)
    if tok.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"tokenizer {cfg.data.tokenizer!r} has {tok.vocab_size} tokens but the model's vocabulary "
            f"is {cfg.model.vocab_size}: use the model's own tokenizer (or model.vocab_size >= "
            f"{tok.vocab_size})"
        )


def check_init_source(cfg: RunConfig, path: str | Path) -> None:
    """Every tensor the model needs is in ``path`` with the right shape (checked on a model built
    on the meta device: no memory), so a bad source fails before ``--out`` is touched."""
    import torch

    from axo4d.facts.grid import Grid
    from axo4d.models import build_model
    from axo4d.nn.context import as_context

    with torch.device("meta"):
        model = build_model(cfg.model, as_context(Comm(Grid(), 0, init_groups=False)), seed=None)
    if init_kind(path) == "hf":
        files = hf.SafetensorsFolder(path)
        hf.check_hf_weights(files, hf.weight_layout(cfg.model, files), model)
        return
    from axo4d.training.checkpointing.checkpointer import check_tensors, find_checkpoint

    check_tensors(find_checkpoint(path), model)


def load_init_weights(model: nn.Module, path: str | Path, comm: Comm) -> None:
    """Fill this rank's pieces of ``model`` from ``path`` (collective for a checkpoint, whose files are
    verified first)."""
    if init_kind(path) == "hf":
        hf.load_hf_weights(model, path, comm.grid, comm.rank)
        return
    from axo4d.training.checkpointing.checkpointer import check_tensors, find_checkpoint, read_manifest
    from axo4d.training.checkpointing.resume import verify_checkpoint
    from axo4d.training.checkpointing.shards import read_shards

    ckpt = find_checkpoint(path)
    verify_checkpoint(ckpt, comm.on_every_rank(lambda: read_manifest(ckpt)), comm)  # every file's crc32 first
    check_tensors(ckpt, model)
    read_shards(ckpt, model, None, comm, load_rng=False)


def record_source(out: Path, path: str | Path) -> None:
    """Keep a Hugging Face source's ``config.json`` and tokenizer files in ``out/hf``."""
    if init_kind(path) != "hf":
        return
    dest = out / "hf"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *hf.TOKENIZER_FILES):
        if (Path(path) / name).is_file():
            shutil.copyfile(Path(path) / name, dest / name)
