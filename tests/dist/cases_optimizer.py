"""Rank-side cases of the sharded optimizer and host offload (run by test_optimizer.py).

``parity``: on each grid, the same config trained with the unsharded optimizer (torch AdamW), the
sharded one, and with host offload ('optimizer' and 'auto' under a budget that fits only part of
the state), against the one-process run; losses, final weights, optimizer bytes per rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.facts.memory import memory
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.memory_plan import run_setup
from axo4d.training.optim.sharded import ShardedAdamW
from axo4d.training.trainer import Trainer
from tests.helpers import full_state_dict

#: name -> config overrides of the runs compared with the unsharded optimizer on the same grid
MODES = {
    "unsharded": ["parallel.shard_optimizer=false"],
    "sharded": ["parallel.shard_optimizer=true"],
    "sharded+overlap_off": ["parallel.shard_optimizer=true", "parallel.overlap=false"],
    "sharded+buckets": ["parallel.shard_optimizer=true", "parallel.dp_bucket_mb=0.005"],
    "offload": ["parallel.shard_optimizer=false", "train.offload=optimizer"],
    "sharded+offload": ["parallel.shard_optimizer=true", "train.offload=optimizer"],
    "sharded+offload_auto": ["parallel.shard_optimizer=true", "train.offload=auto"],
}


def _dataset(info, cfg):
    torch.set_num_threads(1)  # MKL rounds differently with 1 and 2 threads: keep runs comparable
    if info.rank == 0:
        prepare_tokens(cfg.data)
    if dist.is_initialized():
        dist.barrier()
    return open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)


def optimizer_bytes(tr: Trainer) -> dict[str, int]:
    """Optimizer state bytes this rank holds, counted from its tensors; ``moments``: those of the
    Adam moments kept on the device alone (no step counters, no masters)."""
    inner = tr.opt.dev if isinstance(tr.opt, ShardedAdamW) else tr.opt
    states = inner.state.values() if inner is not None else []
    moments = sum(st[k].nbytes for st in states for k in ("exp_avg", "exp_avg_sq") if k in st)
    if isinstance(tr.opt, ShardedAdamW):
        return {**tr.opt.state_bytes(), "moments": moments}
    n = sum(v.nbytes for st in tr.opt.state.values() for v in st.values() if torch.is_tensor(v))
    return {"device": n, "host": 0, "moments": moments}


def train(cfg, comm: Comm, ds) -> dict:
    tr = Trainer(cfg, comm, ds, torch.device("cpu"))
    losses = [tr.step(i).loss for i in range(cfg.train.steps)]
    tr.settle()
    out = {
        "losses": losses,
        "state": full_state_dict(tr.model, comm),
        "bytes": optimizer_bytes(tr),
        "sharded": isinstance(tr.opt, ShardedAdamW),
    }
    if isinstance(tr.opt, ShardedAdamW):
        out["gathers"] = tr.opt.gather_stats
        out["host_segments"] = sum(s.host for s in tr.opt.segs)
        out["segments"] = len(tr.opt.segs)
    return out


def _compare(ref: dict, got: dict) -> dict:
    rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    w = max(float((got["state"][n] - t).norm() / t.norm().clamp_min(1e-12)) for n, t in ref["state"].items())
    same = got["losses"] == ref["losses"] and all(torch.equal(got["state"][n], t) for n, t in ref["state"].items())
    return {"max_rel_loss": rel, "max_rel_weight": w, "bitwise": same}


def parity(info, specs: list[str], overrides: list[str], modes: list[str], config: str = "tiny") -> list[dict]:
    base = load_config(config, overrides)
    ds = _dataset(info, base)
    world = Comm(Grid(data=info.world_size), info.rank)
    one = None
    if info.rank == 0:
        one = train(base, Comm(Grid(), 0, init_groups=False), ds)
        one = {"losses": one["losses"], "state": one["state"]}
    one = world.broadcast_object(one)
    out = []
    for spec in specs:
        runs = {}
        for mode in modes:
            cfg = load_config(config, overrides + MODES[mode] + _budget(mode, overrides, spec, config), spec)
            comm = Comm(Grid.parse(spec), info.rank, timeout_s=60)
            runs[mode] = train(cfg, comm, ds)
            comm.close()
        ref = runs["unsharded"]
        for mode, r in runs.items():
            res = {
                "grid": spec,
                "mode": mode,
                "bytes": r["bytes"],
                "sharded": r["sharded"],
                "host_segments": r.get("host_segments", 0),
                "gathers": r.get("gathers", {}),
                "segments": r.get("segments", 0),
                "vs_unsharded": _compare(ref, r),
                "vs_one_process": _compare(one, r),
            }
            out.append(res)
    return out


def _budget(mode: str, overrides: list[str], spec: str, config: str = "tiny") -> list[str]:
    """'auto': a device budget halfway between the predictions with all optimizer state on the
    device and with none, so that about half of it is offloaded."""
    if not mode.endswith("auto"):
        return []
    cfg = load_config(config, overrides + MODES[mode], spec)
    sp, b, dt, setup = run_setup(cfg, Grid.parse(spec), gpu=False)
    full = memory(sp, b, dt, dataclasses.replace(setup, device_fraction=1.0)).reserved()
    none = memory(sp, b, dt, dataclasses.replace(setup, device_fraction=0.0)).reserved()
    return [f"train.memory_budget_gb={(full + none) / 2 / 2**30!r}"]


def _trainer(spec: str, overrides: list[str], rank: int, ds) -> Trainer:
    cfg = load_config("tiny", overrides, spec)
    return Trainer(cfg, Comm(Grid.parse(spec), rank, timeout_s=60), ds, torch.device("cpu"))


def resume(info, tmp: str, spec: str, steps: int, k: int, chain: list[list[str]]) -> dict:
    """Train ``chain[0]``'s mode to ``steps`` saving at ``k`` (the reference); then each next mode
    loads the previous one's step-``k`` checkpoint, saves its own at ``k`` right away and trains
    on. Every mode must load the same tensors and continue with the reference's losses."""
    from pathlib import Path

    from axo4d.training.checkpointing.checkpointer import Checkpointer
    from tests.dist.cases_checkpoint import _diff, full_state

    base = ["parallel.tuner=false", f"train.steps={steps}", "train.eval_interval=0"]
    ds = _dataset(info, load_config("tiny", base))
    tr = _trainer(spec, base + chain[0], info.rank, ds)
    ck = Checkpointer(Path(tmp) / "m0", tr.cfg, tr.comm, tr.model, tr.opt)
    ref = [tr.step(i).loss for i in range(k)]
    path = ck.save(k)
    state_k = full_state(tr)
    ref += [tr.step(i).loss for i in range(k, steps)]
    out = {"ref": ref, "modes": []}
    for j, mode in enumerate(chain[1:], 1):
        tr = _trainer(spec, base + mode, info.rank, ds)
        ck = Checkpointer(Path(tmp) / f"m{j}", tr.cfg, tr.comm, tr.model, tr.opt)
        start = ck.load(path, tr.comm.grid.spec())
        loaded = _diff(state_k, full_state(tr))
        path = ck.save(start)
        losses = [tr.step(i).loss for i in range(start, steps)]
        out["modes"].append(
            {
                "mode": mode,
                "start": start,
                "load_diff": loaded,
                "losses": losses,
                "sharded": isinstance(tr.opt, ShardedAdamW),
            }
        )
    return out
