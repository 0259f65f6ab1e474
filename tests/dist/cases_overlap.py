"""Rank-side checks of overlap and the BLAS tuner (run by test_overlap.py).

``run``: on each grid, train the same config with ``parallel.overlap`` on and off (tuner off,
small data-parallel buckets so there are several) and compare each rank's losses, final weight
shards, byte/call counters and the gradients an ``on_gradients_ready`` consumer saw.
``tuner``: train with the tuner on and off; decisions, cache file and reuse.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.models import apply_compile
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.trainer import Trainer

STEPS = 4


def _dataset(info, cfg):
    torch.set_num_threads(1)  # MKL rounds differently with 1 and 2 threads: keep runs comparable
    if info.rank == 0:
        prepare_tokens(cfg.data)
    dist.barrier()
    return open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)


def _config(spec: str, overrides: list[str], overlap: bool, tuner: bool = False, cache: str = ""):
    # the consumer reads every parameter's .grad: the unsharded optimizer (sharded, a bucket's sum is
    # in its owned slices; overlap on/off with it: tests/dist/test_optimizer.py)
    cfg = load_config(
        "tiny", [f"train.steps={STEPS}", "parallel.dp_bucket_mb=0.02", "parallel.shard_optimizer=false", *overrides]
    )
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, grid=spec, overlap=overlap, tuner=tuner, tuner_cache=cache)
    )


def _train(cfg, ds, rank: int) -> dict:
    comm = Comm(Grid.parse(cfg.parallel.grid), rank, timeout_s=60)
    tr = Trainer(cfg, comm, ds, torch.device("cpu"))
    seen: list[list[float]] = []  # what a gradient consumer sees, per step and parameter
    tr.model.on_gradients_ready(lambda: seen.append([float(p.grad.double().norm()) for p in tr.params]))
    early: list[float] = []  # a bias gradient as plain autograd hooks see it (control)
    bias = tr.model.blocks[0].attn.proj.bias
    bias.register_post_accumulate_grad_hook(lambda p: early.append(float(p.grad.double().norm())))
    k = next(i for i, p in enumerate(tr.params) if p is bias)
    comm.reset_counters()
    losses, early_last = [], []
    for i in range(cfg.train.steps):
        losses.append(tr.step(i).loss)
        early_last.append(early[-1])
    ov = tr.model.schedule
    return {
        "losses": losses,
        "state": {n: p.detach().clone() for n, p in tr.model.named_parameters()},
        "bytes": dict(comm.bytes),
        "calls": dict(comm.calls),
        "seen": seen,
        "early": early_last,
        "late": [s[k] for s in seen],
        "stats": dict(ov.stats) if ov.overlapped else {},
    }


def _compare(on: dict, off: dict) -> dict:
    w = max(float((on["state"][n] - t).abs().max()) for n, t in off["state"].items())
    return {
        "loss_equal": on["losses"] == off["losses"],
        "max_weight_diff": w,
        "bytes_equal": on["bytes"] == off["bytes"],
        "calls_equal": on["calls"] == off["calls"],
        "seen_equal": on["seen"] == off["seen"],
        "seen_steps": len(on["seen"]),
        "early_differs": all(a != b for a, b in zip(on["early"], on["late"])),
        "stats": on["stats"],
        "losses": on["losses"],
    }


def run(info, specs: list[str], variants: dict[str, list[str]], only: dict[str, list[str]] | None = None) -> dict:
    """``{variant: {grid: comparison}}`` of overlap on vs off on this rank (``only``: a variant's
    grids where not all of ``specs``)."""
    ds = _dataset(info, load_config("tiny"))
    out: dict[str, dict] = {}
    for name, overrides in variants.items():
        for spec in (only or {}).get(name, specs):
            on = _train(_config(spec, overrides, True), ds, info.rank)
            off = _train(_config(spec, overrides, False), ds, info.rank)
            out.setdefault(name, {})[spec] = _compare(on, off)
    return out


def tuner(info, spec: str, cache: str) -> dict:
    """Tuner on vs off, decisions per rank, cache written then reused without timing."""
    ds = _dataset(info, load_config("tiny"))
    results = {}
    runs = {}
    for label, on in (("off", False), ("on", True), ("again", True)):
        cfg = _config(spec, [], True, tuner=on, cache=cache)
        comm = Comm(Grid.parse(spec), info.rank, timeout_s=60)
        tr = Trainer(cfg, comm, ds, torch.device("cpu"))
        losses = [tr.step(i).loss for i in range(2)]
        runs[label] = {"losses": losses, "state": {n: p.detach().clone() for n, p in tr.model.named_parameters()}}
        if tr.tuner is not None:
            results[label] = {
                "timed": tr.tuner.timed,
                "loaded": tr.tuner.loaded,
                "decisions": {k: v["variant"] for k, v in sorted(tr.tuner.table.items())},
                "uses": len(tr.tuner.uses),
            }
        dist.barrier()
    ref = runs["off"]
    for label in ("on", "again"):
        r = runs[label]
        results[label]["max_rel_loss"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
        results[label]["max_rel_weight"] = max(
            float((r["state"][n] - t).abs().max() / t.abs().max().clamp_min(1e-12)) for n, t in ref["state"].items()
        )
    return results


def compiled(info, spec: str, backend: str) -> dict:
    """Blocks under torch.compile (Linear3D and LayerNorm collectives stay eager) vs eager, with
    overlap and activation checkpointing: losses of a few optimizer steps."""
    ds = _dataset(info, load_config("tiny"))
    out = {}
    for label in ("eager", "compiled"):
        cfg = _config(spec, ["train.activation_checkpointing=true"], True)
        tr = Trainer(cfg, Comm(Grid.parse(spec), info.rank, timeout_s=120), ds, torch.device("cpu"))
        if label == "compiled":
            apply_compile(tr.model, backend=backend)
        out[label] = [tr.step(i).loss for i in range(3)]
        out[label + "_stats"] = dict(tr.model.schedule.stats)
    out["max_rel_loss"] = max(abs(a - b) / abs(b) for a, b in zip(out["compiled"], out["eager"]))
    return out


#: the model of :func:`defaults`: forward chunks on x=2 and y=2 (2048 rows of 256 features per rank)
DEFAULTS_MODEL = ["model.n_embd=256", "model.seq_len=128", "train.global_batch=16"]


def defaults(info, specs: list[str]) -> dict:
    """Default settings ('auto' buckets, the sharded optimizer when G_data > 1) with overlap on vs
    off on each grid: losses, final weights (settled), bytes and calls, and what overlapped --
    dW GEMMs deferred behind a later dX all-reduce, weight all-gathers waited for at first use."""
    model = DEFAULTS_MODEL
    ds = _dataset(info, load_config("tiny", model))
    out = {}
    for spec in specs:
        runs = {}
        for overlap in (True, False):
            sets = [f"train.steps={STEPS}", f"parallel.overlap={str(overlap).lower()}", "parallel.tuner=false", *model]
            cfg = load_config("tiny", sets, spec)
            comm = Comm(Grid.parse(spec), info.rank, timeout_s=60)
            tr = Trainer(cfg, comm, ds, torch.device("cpu"))
            comm.reset_counters()
            losses = [tr.step(i).loss for i in range(STEPS)]
            tr.settle()
            runs[overlap] = {
                "losses": losses,
                "state": {n: p.detach().clone() for n, p in tr.model.named_parameters()},
                "bytes": dict(comm.bytes),
                "calls": dict(comm.calls),
                "stats": dict(tr.model.schedule.stats),
                "gathers": getattr(tr.opt, "gather_stats", {}),
            }
            comm.close()
        on, off = runs[True], runs[False]
        out[spec] = {
            "loss_equal": on["losses"] == off["losses"],
            "max_weight_diff": max(float((on["state"][n] - t).abs().max()) for n, t in off["state"].items()),
            "bytes_equal": on["bytes"] == off["bytes"],
            "calls_equal": on["calls"] == off["calls"],
            "deferred_dw": on["stats"].get("deferred_dw", 0),
            "chunks": on["stats"].get("chunks", 0),
            "gathers_at_use": on["gathers"].get("at_use", 0),
            "gathers_at_use_off": off["gathers"].get("at_use", 0),
        }
    return out
