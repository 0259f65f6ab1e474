"""Rank-side cases of the data pipeline on a grid (run by test_data.py through tests.dist.harness).

``accumulation``: grad_accum 1, 2 and 4, on one process (rank 0) and on a grid: every step's loss
per setting, with the step's logged sample indices. ``epoch``: one epoch (``train.epochs=1``) of a
1,000-document JSONL on a grid with accumulation; the targets every rank read. ``document_mask``:
training on that JSONL with the document mask, on one process and on a grid splitting heads.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.training.datasets.batches import steps_for_epochs
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.trainer import Trainer


def _run(cfg, comm: Comm, ds) -> dict:
    tr = Trainer(cfg, comm, ds, torch.device("cpu"))
    stats = [tr.step(i) for i in range(cfg.train.steps)]
    return {"losses": [s.loss for s in stats], "samples": [s.samples for s in stats], "val": tr.evaluate()}


def accumulation(info, spec: str, overrides: list[str]) -> dict:
    base = load_config("tiny", overrides + ["train.dtype=fp32", "parallel.tuner=false", "data.log_samples=true"])
    world = Comm(Grid(data=info.world_size), info.rank)
    if info.rank == 0:
        prepare_tokens(base.data)
    world.barrier()
    ds = open_dataset(base.data, base.model.seq_len, base.train.seed, base.model.vocab_size)
    out: dict = {"one": {}, "grid": {}}
    for accum in (1, 2, 4):
        cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, grad_accum=accum))
        if info.rank == 0:
            out["one"][accum] = _run(cfg, Comm(Grid(), 0, init_groups=False), ds)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, grid=spec))
        out["grid"][accum] = _run(cfg, Comm(Grid.parse(spec), info.rank, timeout_s=120), ds)
    return out


def _jsonl_config(folder: str, extra: list[str]):
    f = Path(folder)
    return load_config(
        "tiny",
        extra
        + [
            f"data.source={f / 'docs.jsonl'}",
            f"data.val_source={f / 'val.jsonl'}",
            f"data.tokenizer={f / 'tokenizer.json'}",
            f"data.cache_dir={f / 'cache'}",
            "data.max_tokens=0",
            "model.vocab_size=24576",
            "parallel.tuner=false",
        ],
    )


def epoch(info, spec: str, folder: str, accum: int) -> dict:
    """Train one epoch of ``folder``'s ``docs.jsonl`` (validation: ``val.jsonl``) on ``spec``; every
    target each rank read (its ``y`` where the mask keeps it)."""
    cfg = _jsonl_config(folder, ["train.epochs=1", f"train.grad_accum={accum}", f"parallel.grid={spec}"])
    world = Comm(Grid(data=info.world_size), info.rank)
    if info.rank == 0:
        prepare_tokens(cfg.data)
    world.barrier()
    ds = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    steps = steps_for_epochs(1, ds.epoch_size, cfg.train.global_batch)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
    comm = Comm(Grid.parse(spec), info.rank, timeout_s=120)
    tr = Trainer(cfg, comm, ds, torch.device("cpu"))
    seen: list[np.ndarray] = []
    read = tr.plan.read

    def recording(idx, micro, device=None):
        b = read(idx, micro, device)
        seen.append((b.y if b.mask is None else b.y[b.mask]).flatten().numpy())
        return b

    tr.plan.read = recording
    last = [tr.step(i) for i in range(steps)][-1]
    return {
        "targets": np.concatenate(seen).tolist(),
        "coords": comm.grid.coords(info.rank),
        "steps": steps,
        "epoch": [last.epoch, last.epoch_fraction, last.samples_seen, ds.epoch_size],
    }


def document_mask(info, spec: str, folder: str, steps: int) -> dict:
    """``data.document_mask`` on short documents (many per sample): one process and ``spec``."""
    cfg = _jsonl_config(folder, [f"train.steps={steps}", "data.document_mask=true", "train.dtype=fp32"])
    ds = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)  # prepared by epoch()
    out = {"one": _run(cfg, Comm(Grid(), 0, init_groups=False), ds) if info.rank == 0 else None}
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, grid=spec))
    out["grid"] = _run(cfg, Comm(Grid.parse(spec), info.rank, timeout_s=120), ds)
    return out


def run(info, folder: str, spec: str, steps: int, mask_spec: str) -> dict:
    """Every case in one group of ranks."""
    return {
        "accumulation": accumulation(info, spec, [f"train.steps={steps}", "train.global_batch=16"]),
        "epoch": epoch(info, spec, folder, 2),
        "mask": document_mask(info, mask_spec, folder, 10),
    }
