"""Rank side of test_goldfish.py: Goldfish-loss training on several grids against one process.

The one-process reference runs on rank 0 and is broadcast; every grid then trains the same config
(Goldfish loss on) and is compared step by step (losses, validation loss, final weights), with the
fraction of dropped targets each grid reports.
"""

from __future__ import annotations

import dataclasses

import torch

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.trainer import Trainer
from tests.dist.cases_train import _compare
from tests.helpers import full_state_dict


def _train(cfg, comm: Comm, ds) -> dict:
    tr = Trainer(cfg, comm, ds, torch.device("cpu"))
    stats = [tr.step(i) for i in range(cfg.train.steps)]
    tr.settle()
    return {
        "losses": [s.loss for s in stats],
        "dropped": [s.dropped for s in stats],
        "val": tr.evaluate(),
        "state": full_state_dict(tr.model, comm),
    }


def run(info, specs: list[str], overrides: list[str], config: str = "tiny") -> list[dict]:
    base = load_config(config, overrides)
    if info.rank == 0:
        prepare_tokens(base.data)
    world = Comm(Grid(data=info.world_size), info.rank)
    ds = open_dataset(base.data, base.model.seq_len, base.train.seed, base.model.vocab_size)
    ref = _train(base, Comm(Grid(), 0, init_groups=False), ds) if info.rank == 0 else None
    ref = world.broadcast_object(ref)
    out = []
    for spec in specs:
        cfg = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, grid=spec))
        got = _train(cfg, Comm(Grid.parse(spec), info.rank, timeout_s=60), ds)
        res = _compare(ref, got, spec)
        res["dropped"], res["ref_dropped"] = got["dropped"], ref["dropped"]
        out.append(res)
    return out


if __name__ == "__main__":  # python -m launch.local -n 8 -- tests.dist.cases_goldfish
    from axo4d.dist.bootstrap import init_distributed, shutdown

    info = init_distributed(backend="gloo", timeout_s=120)
    specs = {8: ["x=2,y=2,z=2", "data=2,x=2,z=2", "data=2,y=2,z=2"], 4: ["data=2,y=2", "x=2,z=2"]}
    res = run(
        info,
        specs.get(info.world_size, [f"data={info.world_size}"]),
        ["train.steps=6", "train.grad_accum=2", "train.global_batch=16", "train.goldfish_k=2", "parallel.tuner=false"],
    )
    if info.rank == 0:
        for r in res:
            print(
                f"grid {r['grid']:16s} max rel loss diff {r['max_rel_loss']:.2e}  val {r['val_rel']:.2e}  weights "
                f"{r['max_rel_weight']:.2e}  dropped {r['dropped'] == r['ref_dropped'] and 'same' or 'DIFFERENT'} "
                f"(mean {sum(r['dropped']) / len(r['dropped']):.4f})",
                flush=True,
            )
    shutdown()
