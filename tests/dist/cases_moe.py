"""Rank-side checks of the mixture-of-experts models on grids (run by test_moe.py): each rank
builds the model (overlapped schedule), reads its own slices of the Hugging Face folder and
compares logits, the load-balancing loss, the training loss, every gradient and greedy
generation with the references ``transformers`` computed in the test process."""

from __future__ import annotations

from pathlib import Path

import torch

from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.models import build_model
from axo4d.nn.context import LayerContext
from axo4d.nn.overlap_schedule import make_schedule
from axo4d.training.hf.hf_config import read_hf_config
from axo4d.training.hf.weights import load_hf_weights
from tests import moe_models as M


def run(info, base: str, plan: dict) -> dict:
    """Each model of ``plan`` on each grid it names."""
    torch.set_num_threads(1)
    out = {}
    for name, grids in plan.items():
        folder = Path(base) / name
        ref = torch.load(Path(base) / f"{name}.ref.pt")
        cfg, _ = read_hf_config(folder)
        for spec in grids:  # 'data=4 ep=2': G_ep = 2
            grid, _, ep = spec.partition(" ep=")
            comm = Comm(Grid.parse(grid, expert=int(ep or 1)), info.rank, timeout_s=120)
            model = build_model(cfg, LayerContext(comm, make_schedule(comm, True)), seed=None)
            load_hf_weights(model, folder, comm.grid, comm.rank)
            out[f"{name} {spec}"] = M.moe_errors(
                model, comm, folder, ref, ref["idx"], ref["prompts"], ref["new_tokens"]
            )
            comm.close()
    return out
