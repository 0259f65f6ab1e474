"""One candidate of :mod:`bench.capacity`, inside each spawned rank (``python -m bench.capacity
--worker SPEC``): plain PyTorch or the axo4d trainer trains a few steps under the candidate's
memory limits, and the rank writes what it measured (step time, peak memory, optimizer state, or
why it was refused or ran out of memory) for the driver.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

MIB, GIB = 2**20, 2**30
MODES = {
    "plain": {"ranks": 1, "grid": "data=1", "sets": []},
    "axo4d": {"ranks": 1, "grid": "data=1", "sets": []},
    "unsharded-2": {"ranks": 2, "grid": "data=2", "sets": ["parallel.shard_optimizer=false"]},
    "sharded": {"ranks": 2, "grid": "data=2", "sets": ["parallel.shard_optimizer=true"]},
    "offload": {"ranks": 1, "grid": "data=1", "sets": ["train.offload=auto"]},
}


def _steps(step, n: int) -> list[float]:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    return times


def _plain(cfg, ds, device, n: int) -> tuple[list[float], dict]:
    """Plain PyTorch: PlainGPT, blocks recomputed, AdamW over every parameter."""
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from axo4d.models.plain import PlainGPT
    from axo4d.training.trainer import compute_dtype

    with torch.device(device):  # built where it trains (no host copy of a large model)
        model = PlainGPT(cfg.model)
    kw = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.1, **kw)
    dtype = compute_dtype(cfg.train, device)

    from axo4d.training.datasets.batches import StepPlan

    plan = StepPlan(ds, cfg.train.global_batch, 1)

    def step(i: int) -> None:
        b = ds.batch("train", plan.samples(i)[1], device)
        x, y = b.x, b.y
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            h = F.embedding(x, model.wte) + model.wpe[: x.shape[1]]
            for block in model.blocks:
                h = checkpoint(block, h, use_reentrant=False)
            logits = model.lm_head(model.ln_f(h))
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = _steps(step, n)
    state = sum(v.nbytes for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    return times, {"params": sum(p.numel() for p in model.parameters()), "device_state": state, "host_state": 0}


def _axo4d(cfg, ds, info, n: int) -> tuple[list[float], dict]:
    from axo4d.dist.comm import Comm
    from axo4d.facts.grid import Grid
    from axo4d.training.optim.sharded import ShardedAdamW
    from axo4d.training.trainer import Trainer

    comm = Comm(Grid.parse(cfg.parallel.grid), info.rank, timeout_s=cfg.parallel.timeout_s)
    tr = Trainer(cfg, comm, ds, info.device, local_ranks=info.local_world_size)
    times = _steps(tr.step, n)
    if isinstance(tr.opt, ShardedAdamW):
        sb = tr.opt.state_bytes()
    else:
        sb = {"device": sum(v.nbytes for st in tr.opt.state.values() for v in st.values() if v.dim()), "host": 0}
    m = tr.memory.memory
    return times, {
        "params": tr.model.num_params(),
        "device_state": sb["device"],
        "host_state": sb["host"],
        "pred_device": m.device["total"],
        "pred_host": m.host["total"] - m.host["runtime"],
        "device_fraction": m.device_fraction,
    }


def _warm_up(spec: dict, ds, info) -> None:
    """One step of a one-layer model of the same mode, then everything freed: the runtime's own
    memory (kernels' caches, threads, communication buffers; a GPU's context) is not the model's."""
    import ctypes
    import gc

    import torch

    from axo4d.config import load_config

    sets = [s for s in spec["sets"] if not s.startswith(("model.n_layer=", "train.memory_budget_gb"))]
    cfg = load_config("tiny", sets + ["model.n_layer=1", "train.steps=1"], MODES[spec["mode"]]["grid"])
    (_plain if spec["mode"] == "plain" else lambda c, d, i, n: _axo4d(c, d, i, n))(
        cfg, ds, info.device if spec["mode"] == "plain" else info, 1
    )
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    if info.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(info.device)


def worker(spec: dict) -> int:
    """One rank of one candidate: train, then write what it measured to ``spec['out']``."""
    import resource

    import torch

    from axo4d.config import load_config
    from axo4d.config.errors import CommError, MemoryBudgetError, TrainError
    from axo4d.dist.bootstrap import init_distributed
    from axo4d.training.datasets.dataset import open_dataset
    from axo4d.training.memory_plan import peak_rss_bytes, rss_bytes

    info = init_distributed("auto", timeout_s=120)
    cfg = load_config("tiny", spec["sets"], MODES[spec["mode"]]["grid"])
    ds = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    _warm_up(spec, ds, info)
    base = rss_bytes()
    if spec["hard_limit"]:
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + spec["hard_limit"], resource.RLIM_INFINITY))
    res: dict = {"rank": info.rank, "status": "ok"}
    try:
        if spec["mode"] == "plain":
            times, res_ = _plain(cfg, ds, info.device, cfg.train.steps)
        else:
            times, res_ = _axo4d(cfg, ds, info, cfg.train.steps)
        res.update(res_, step_s=statistics.median(times[1:] or times))
    except MemoryBudgetError as e:
        res.update(status="refused", why=str(e))
    except (MemoryError, RuntimeError, CommError, TrainError) as e:  # torch.cuda.OutOfMemoryError too
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        res.update(status="oom" if "memory" in msg.lower() or isinstance(e, MemoryError) else "failed", why=msg[:300])
    res["peak_rss"] = peak_rss_bytes()
    res["tensors"] = res["peak_rss"] - base
    if info.device.type == "cuda":
        res["device_peak"] = torch.cuda.max_memory_allocated(info.device)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    Path(spec["out"]).with_suffix(f".{info.rank}.json").write_text(json.dumps(res))
    sys.stdout.flush()
    os._exit(0)  # peers of a rank that ran out of memory may be stuck in a collective
