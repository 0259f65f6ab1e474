"""Rank-side checks of weight caching (run by test_weight_cache.py).

On each grid and variant, the same config trains with ``parallel.cache_weights`` off (the
reference), 'all' and '1' (the last block and the head), with overlap on and off. Caching only
serves a backward or recompute request from the block gathered in forward -- a gather is an exact
copy -- so losses and final weight shards must equal the uncached run BIT FOR BIT; the z
all-gather bytes and calls per step must equal the performance model's prediction; the cache must be used
(hits) and never stale. The one-process run of the same config is the outside reference.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.trainer import Trainer

STEPS = 2
SETTINGS = [("all", True), ("all", False), ("1", True)]


def _config(overrides: list[str], spec: str, cache: str, overlap: bool):
    cfg = load_config("tiny", [f"train.steps={STEPS}", "parallel.tuner=false", *overrides])
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, grid=spec, cache_weights=cache, overlap=overlap)
    )


def _train(cfg, comm: Comm, ds) -> dict:
    tr = Trainer(cfg, comm, ds, torch.device("cpu"))
    comm.reset_counters()
    losses = [tr.step(i).loss for i in range(cfg.train.steps)]
    tr.settle()
    key = ("z", "all_gather")
    return {
        "losses": losses,
        "state": {n: p.detach().clone() for n, p in tr.model.named_parameters()},
        "gather_bytes": comm.bytes.get(key, 0) / STEPS,
        "gather_calls": comm.calls.get(key, 0) / STEPS,
        "cache": dict(tr.model.schedule.cache.stats),
    }


def _predicted(cfg, spec: str) -> tuple[float, int]:
    from bench.bytes_check import predicted

    b, c = predicted(cfg, spec)
    return b.get("z:all_gather", 0), c.get("z:all_gather", 0)


def run(info, specs: list[str], variants: dict[str, list[str]]) -> dict:
    torch.set_num_threads(1)
    base = load_config("tiny")
    if info.rank == 0:
        prepare_tokens(base.data)
    dist.barrier()
    ds = open_dataset(base.data, base.model.seq_len, base.train.seed, base.model.vocab_size)
    out: dict = {}
    for name, overrides in variants.items():
        one = None
        if info.rank == 0:  # the one-process reference
            one = _train(_config(overrides, "data=1", "off", False), Comm(Grid(), 0, init_groups=False), ds)["losses"]
        box = [one]
        dist.broadcast_object_list(box, src=0)
        for spec in specs:
            ref = _train(_config(overrides, spec, "off", True), Comm(Grid.parse(spec), info.rank, timeout_s=60), ds)
            rows = {}
            for cache, overlap in SETTINGS:
                cfg = _config(overrides, spec, cache, overlap)
                got = _train(cfg, Comm(Grid.parse(spec), info.rank, timeout_s=60), ds)
                pb, pc = _predicted(cfg, spec)
                rows[f"{cache}/{'overlap' if overlap else 'eager'}"] = {
                    "loss_equal": got["losses"] == ref["losses"],
                    "max_weight_diff": max(float((got["state"][n] - t).abs().max()) for n, t in ref["state"].items()),
                    "bytes": [got["gather_bytes"], pb],
                    "calls": [got["gather_calls"], pc],
                    "ref_bytes": ref["gather_bytes"],
                    "cache": got["cache"],
                    "vs_one_process": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], box[0])),
                }
            out.setdefault(name, {})[spec] = rows
    return out
