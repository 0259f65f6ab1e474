"""Rank-side oracle checks of Hugging Face models on a grid (run by test_hf.py).

Each rank builds the axo4d model on each grid (overlapped schedule), reads its own slices of the
Hugging Face folder, and compares logits, loss, every gradient and greedy generation with the
references ``transformers`` computed in the test process. Optionally it saves a checkpoint
(sharded over the grid) for the test to export.
"""

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
from tests import hf_models as H


def run(info, base: str, specs: list[str], save: dict, more: dict | None = None) -> dict:
    """Every model of ``H.GRID_NAMES`` on every grid of ``specs``, and each model of ``more`` on the
    grids it names."""
    torch.set_num_threads(1)
    out = {}
    plan = {**{name: specs for name in H.GRID_NAMES}, **(more or {})}
    for name, grids in plan.items():
        folder = Path(base) / name
        ref = torch.load(Path(base) / f"{name}.ref.pt")
        cfg, _ = read_hf_config(folder)
        for spec in grids:
            comm = Comm(Grid.parse(spec), info.rank, timeout_s=120)
            model = build_model(cfg, LayerContext(comm, make_schedule(comm, True)), seed=None)
            load_hf_weights(model, folder, comm.grid, comm.rank)
            errs = H.axo4d_errors(model, comm, folder, ref, ref["idx"], ref["prompts"], ref["new_tokens"])
            out[f"{name} {spec}"] = errs
            if save.get(name) == spec:
                from axo4d.config import load_config
                from axo4d.training.checkpointing.checkpointer import Checkpointer
                from axo4d.training.init_from import config_with_init

                run_cfg = config_with_init(load_config("tiny"), folder, [])
                for p in model.parameters():
                    p.grad = None
                load_hf_weights(model, folder, comm.grid, comm.rank)  # the weights, not the trained ones
                Checkpointer(Path(base) / f"run_{name}", run_cfg, comm, model, None).save(0)
                if info.rank == 0:
                    from axo4d.training.init_from import record_source

                    record_source(Path(base) / f"run_{name}", folder)
            comm.close()
    return out


def reshard_llama(info, base: str) -> dict:
    """Tied llama-tiny: train on x=2,y=2,z=2, save, load on data=2,y=2,z=2: every model and AdamW
    tensor identical; the next step's loss on both grids within 1e-5."""
    import dataclasses

    from axo4d.config import load_config
    from axo4d.training.checkpointing.checkpointer import Checkpointer
    from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
    from axo4d.training.trainer import Trainer
    from tests.dist.cases_checkpoint import _diff, full_state

    torch.set_num_threads(1)
    cfg = load_config("llama-tiny", ["train.steps=4", "parallel.tuner=false", "model.tie_embeddings=true"])
    if info.rank == 0:
        prepare_tokens(cfg.data)
    torch.distributed.barrier()
    ds = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    out, states, losses = {}, {}, {}
    for spec in ("x=2,y=2,z=2", "data=2,y=2,z=2"):
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, grid=spec))
        tr = Trainer(c, Comm(Grid.parse(spec), info.rank, timeout_s=120), ds, torch.device("cpu"))
        ck = Checkpointer(Path(base) / "llama_run", c, tr.comm, tr.model, tr.opt)
        if spec == "x=2,y=2,z=2":
            for i in range(2):
                tr.step(i)
            path = ck.save(2)
        else:
            ck.load(path, "x=2,y=2,z=2")
        states[spec] = full_state(tr)
        losses[spec] = tr.step(2).loss
    a, b = states.values()
    out["tensors_differ"] = _diff(a, b)
    out["tensors"] = len(a)
    la, lb = losses.values()
    out["loss_rel"] = abs(la - lb) / abs(la)
    return out
