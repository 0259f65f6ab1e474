"""Rank-side loss parity: training on a grid vs the same config on one process (run by test_parity.py).

The one-process reference runs on rank 0 (no process group) and is broadcast;
then every grid trains the same config and seed and compares each step's
loss, the validation loss and the gathered final weights.
"""

from __future__ import annotations

import dataclasses

import torch

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.facts.run import run_grid
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.trainer import Trainer
from tests.helpers import full_state_dict


def _train(cfg, comm: Comm, ds) -> dict:
    tr = Trainer(cfg, comm, ds, torch.device("cpu"))
    losses = [tr.step(i).loss for i in range(cfg.train.steps)]
    tr.settle()
    return {"losses": losses, "val": tr.evaluate(), "state": full_state_dict(tr.model, comm)}


def _compare(ref: dict, got: dict, spec: str) -> dict:
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])]
    first_bad = next((i for i, r in enumerate(rel) if not r <= 1e-4), None)
    # per tensor: ||w - w_ref|| / ||w_ref|| (asserted) and the largest elementwise difference
    # relative to max|w_ref| (reported; AdamW turns rounding in near-zero gradients into lr-sized steps)
    w = {n: float((got["state"][n] - t).norm() / t.norm().clamp_min(1e-12)) for n, t in ref["state"].items()}
    wmax = max(
        float((got["state"][n] - t).abs().max() / t.abs().max().clamp_min(1e-12)) for n, t in ref["state"].items()
    )
    worst = max(w, key=w.get)
    where = int((got["state"][worst] - ref["state"][worst]).abs().argmax())
    return {
        "grid": spec,
        "max_rel_loss": max(rel),
        "first_bad_step": first_bad,
        "val_rel": abs(got["val"] - ref["val"]) / abs(ref["val"]),
        "max_rel_weight": w[worst],
        "max_elem_weight": wmax,
        "worst_weight": f"{worst}[{where}]",
        "steps": len(rel),
        "ref_first_last": [ref["losses"][0], ref["losses"][-1]],
    }


def run(
    info, specs: list[str], overrides: list[str], config: str = "tiny", ranks_per_node: int | None = None
) -> list[dict]:
    """``ranks_per_node``: each grid as the start-up builds it on nodes of that many ranks
    (:func:`axo4d.facts.run.derive.run_grid`: x and y exchanged where x's groups cross nodes);
    ``ran_on`` in each result says the grid and order that ran."""
    base = load_config(config, overrides)
    if info.rank == 0:
        prepare_tokens(base.data)
    one = Comm(Grid(), 0, init_groups=False)
    ds = open_dataset(base.data, base.model.seq_len, base.train.seed, base.model.vocab_size)
    world = Comm(Grid(data=info.world_size), info.rank)
    ref = _train(base, one, ds) if info.rank == 0 else None
    ref = world.broadcast_object(ref)
    out = []
    for spec in specs:
        cfg = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, grid=spec))
        grid = Grid.parse(spec)
        if ranks_per_node is not None:
            grid = run_grid(cfg.model, grid, ranks_per_node)
        comm = Comm(grid, info.rank, timeout_s=60)
        out.append({**_compare(ref, _train(cfg, comm, ds), spec), "ran_on": f"{grid.spec()} {','.join(grid.order)}"})
    return out


def run_cases(info, cases: list[list]) -> list[list[dict]]:
    """Several ``run`` cases (``[specs, overrides, config]``) in one spawned group of ranks."""
    return [run(info, *case) for case in cases]
