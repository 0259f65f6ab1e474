"""Rank-side cases of the sharded optimizer and host offload on a GPU (``tests/gpu/test_offload.py``):
ranks sharing one GPU (gloo) or owning one each (nccl); on the CPU with ``AXO4D_GPU_TESTS_ON_CPU=1``.

:func:`run_modes` trains the tiny GPT on ``spec`` with the unsharded optimizer (the reference), the
sharded one, and with host offload ('optimizer', sharded or not, and 'auto' under a budget that
keeps part of the state on the device), in fp32 and bf16; it returns losses, weight differences
against the reference, optimizer bytes per rank (device, host), whether the host state is pinned,
and the device's peak allocated bytes (JSON only; the test decides).
"""

from __future__ import annotations

import dataclasses

import torch

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.facts.memory import memory
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.memory_plan import run_setup
from axo4d.training.optim.sharded import ShardedAdamW
from axo4d.training.trainer import Trainer
from tests.helpers import full_state_dict

MODES = {
    "unsharded": ["parallel.shard_optimizer=false"],
    "sharded": ["parallel.shard_optimizer=true"],
    "offload": ["parallel.shard_optimizer=false", "train.offload=optimizer"],
    "sharded+offload": ["parallel.shard_optimizer=true", "train.offload=optimizer"],
    "sharded+offload_auto": ["parallel.shard_optimizer=true", "train.offload=auto"],
}


def _overrides(mode: str, dtype: str, steps: int, spec: str, gpu: bool) -> list[str]:
    sets = [
        f"train.steps={steps}",
        "train.eval_interval=0",
        f"train.dtype={dtype}",
        "checkpoint.at_end=false",
        "parallel.tuner=false",
        "train.grad_accum=2",
        "train.global_batch=16",
        *MODES[mode],
    ]
    if mode.endswith("auto"):  # halfway between all optimizer state on the device and none
        cfg = load_config("tiny", sets, spec)
        sp, b, dt, setup = run_setup(cfg, Grid.parse(spec), gpu=gpu)
        full, none = (memory(sp, b, dt, dataclasses.replace(setup, device_fraction=f)).reserved() for f in (1.0, 0.0))
        sets.append(f"train.memory_budget_gb={(full + none) / 2 / 2**30!r}")
    return sets


def _train(cfg, comm: Comm, ds, device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    tr = Trainer(cfg, comm, ds, device)
    losses = [tr.step(i).loss for i in range(cfg.train.steps)]
    tr.settle()  # the sharded optimizer's last weight all-gathers are otherwise still in flight
    out = {
        "losses": losses,
        "state": full_state_dict(tr.model, comm),
        "peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
    }
    if isinstance(tr.opt, ShardedAdamW):
        out["bytes"] = tr.opt.state_bytes()
        host = [s.master for s in tr.opt.segs if s.host]
        out["pinned"] = bool(host) and all(m.is_pinned() for m in host)
        out["host_segments"], out["segments"] = sum(s.host for s in tr.opt.segs), len(tr.opt.segs)
    else:
        n = sum(v.nbytes for st in tr.opt.state.values() for v in st.values() if torch.is_tensor(v))
        out.update(bytes={"device": n, "host": 0}, pinned=False, host_segments=0, segments=0)
    return out


def run_modes(info, spec: str, steps: int, modes: list[str]) -> list[dict]:
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = info.device
    base = load_config("tiny", [])
    if info.rank == 0:
        prepare_tokens(base.data)
    Comm(Grid(data=info.world_size), info.rank).barrier()
    ds = open_dataset(base.data, base.model.seq_len, base.train.seed, base.model.vocab_size)
    out = []
    for dtype in ("fp32", "bf16"):
        runs = {}
        for mode in modes:
            cfg = load_config("tiny", _overrides(mode, dtype, steps, spec, device.type == "cuda"), spec)
            comm = Comm(Grid.parse(spec), info.rank, timeout_s=120)
            runs[mode] = _train(cfg, comm, ds, device)
            comm.close()
        ref = runs["unsharded"]
        for mode, r in runs.items():
            rel = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
            w = max(float((r["state"][n] - t).norm() / t.norm().clamp_min(1e-12)) for n, t in ref["state"].items())
            out.append(
                {
                    "dtype": dtype,
                    "mode": mode,
                    "grid": spec,
                    "losses": r["losses"],
                    "max_rel_loss": rel,
                    "max_rel_weight": w,
                    "bytes": r["bytes"],
                    "pinned": r["pinned"],
                    "peak": r["peak"],
                    "host_segments": r["host_segments"],
                    "segments": r["segments"],
                    "device": str(device),
                    "cuda": device.type == "cuda",
                }
            )
    return out
