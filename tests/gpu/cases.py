"""Rank-side cases of the multi-rank GPU tests (``tests/gpu/test_multirank.py``), run through
``tests.dist.harness`` on ranks that share one GPU (gloo) or own one each (nccl); on the CPU with
``AXO4D_GPU_TESTS_ON_CPU=1``.

:func:`run_all` trains the tiny GPT, on every grid of ``specs`` and on one process of the same
device (the reference, rank 0), in fp32 and bf16; trains the first grids again with the eager
schedule (overlap off); and saves a checkpoint on ``specs[0]`` and resumes it on ``specs[1]``.
It returns losses and weight differences only (JSON); the test decides.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.training.checkpointing.checkpointer import Checkpointer
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.trainer import Trainer
from tests.helpers import full_state_dict


def _config(spec: str, dtype: str, steps: int, overlap: bool = True):
    base = load_config(
        "tiny",
        [
            f"train.steps={steps}",
            "train.eval_interval=0",
            f"train.dtype={dtype}",
            f"parallel.overlap={str(overlap).lower()}",
            "checkpoint.at_end=false",
        ],
    )
    return dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, grid=spec))


def _train(
    cfg,
    comm: Comm,
    ds,
    device: torch.device,
    start: int = 0,
    stop: int | None = None,
    ckpt: tuple[Path, int] | None = None,
    load: tuple[Path, str] | None = None,
) -> dict:
    """Losses of steps [start, stop) and the final full weights (on the CPU); ``ckpt``: save at that
    step into that folder; ``load``: resume from that checkpoint (saved on that grid) first."""
    tr = Trainer(cfg, comm, ds, device)
    ck = Checkpointer(Path(ckpt[0] if ckpt else load[0].parent), cfg, comm, tr.model, tr.opt) if ckpt or load else None
    if load is not None:
        start = ck.load(load[0], load[1])
    losses, path = [], None
    for i in range(start, cfg.train.steps if stop is None else stop):
        losses.append(tr.step(i).loss)
        if ckpt is not None and i + 1 == ckpt[1]:
            path = ck.save(i + 1)
    tr.settle()  # the sharded optimizer's last weight all-gathers are otherwise still in flight
    return {
        "losses": losses,
        "state": full_state_dict(tr.model, comm),
        "path": str(path) if path else None,
        "start": start,
    }


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b)) if a and len(a) == len(b) else float("inf")


def _rel_weights(a: dict, b: dict) -> float:
    return max(float((a[n] - t).norm() / t.norm().clamp_min(1e-12)) for n, t in b.items())


def _identical(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["state"][n], t) for n, t in b["state"].items())


def run_all(info, specs: list[str], steps: int, tmp: str) -> dict:
    """Parity (fp32, bf16), overlap on/off and a checkpoint resharded from ``specs[0]`` to ``specs[1]``."""
    torch.use_deterministic_algorithms(True, warn_only=True)  # identical reruns on a GPU too
    device = info.device
    world = Comm(Grid(data=info.world_size), info.rank)
    base = _config("data=1", "fp32", steps)
    if info.rank == 0:
        prepare_tokens(base.data)
    world.barrier()
    ds = open_dataset(base.data, base.model.seq_len, base.train.seed, base.model.vocab_size)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out: dict = {"device": f"{device} ({name})", "backend": info.backend, "parity": [], "overlap": []}
    runs: dict[tuple[str, str], dict] = {}
    for dtype in ("fp32", "bf16"):
        one = Comm(Grid(), 0, init_groups=False)
        ref = _train(_config("data=1", dtype, steps), one, ds, device) if info.rank == 0 else None
        ref = world.broadcast_object(ref)
        for spec in specs:
            got = runs[(dtype, spec)] = _train(
                _config(spec, dtype, steps), Comm(Grid.parse(spec), info.rank), ds, device
            )
            out["parity"].append(
                {
                    "dtype": dtype,
                    "grid": spec,
                    "losses": got["losses"],
                    "ref": ref["losses"],
                    "max_rel_loss": _rel(got["losses"], ref["losses"]),
                    "max_rel_weight": _rel_weights(got["state"], ref["state"]),
                }
            )
    for spec in specs:
        off = _train(_config(spec, "fp32", steps, overlap=False), Comm(Grid.parse(spec), info.rank), ds, device)
        on = runs[("fp32", spec)]
        out["overlap"].append(
            {
                "grid": spec,
                "identical": _identical(on, off),
                "max_rel_loss": _rel(off["losses"], on["losses"]),
                "max_rel_weight": _rel_weights(off["state"], on["state"]),
            }
        )
    out["reshard"] = _reshard(info, ds, device, specs[0], specs[1], steps, Path(tmp))
    return out


def _reshard(info, ds, device: torch.device, grid_a: str, grid_b: str, steps: int, root: Path) -> dict:
    """fp32: an uninterrupted run on A that saves at ``steps // 2``; that checkpoint resumed on B."""
    k = steps // 2
    a = _train(_config(grid_a, "fp32", steps), Comm(Grid.parse(grid_a), info.rank), ds, device, ckpt=(root / "A", k))
    b = _train(
        _config(grid_b, "fp32", steps), Comm(Grid.parse(grid_b), info.rank), ds, device, load=(Path(a["path"]), grid_a)
    )
    return {
        "from": grid_a,
        "to": grid_b,
        "start": b["start"],
        "k": k,
        "ref": a["losses"][k:],
        "losses": b["losses"],
        "max_rel_loss": _rel(b["losses"], a["losses"][k:]),
        "max_rel_weight": _rel_weights(b["state"], a["state"]),
    }


def backend_env() -> dict[str, str]:
    """Environment for the spawned ranks: ``AXO4D_BACKEND`` from ``AXO4D_GPU_TEST_BACKEND`` (default
    gloo: ranks share GPU 0, NCCL refuses two ranks on one GPU); deterministic cuBLAS."""
    return {
        "AXO4D_BACKEND": os.environ.get("AXO4D_GPU_TEST_BACKEND", "gloo"),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
    }
