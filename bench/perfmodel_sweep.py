"""Step-time measurements for :mod:`bench.validate_perfmodel`, run on every rank.

    python -m launch.vcluster -- bench.perfmodel_sweep --out DIR --grids 'data=8;x=8;x=2,z=4|z,x,y,data' [--rounds 3]

One launch trains every grid in turn with :class:`axo4d.training.trainer.Trainer` (the
trainer behind ``python -m axo4d.train``; a step's time is its
``StepStats.step_time_s``), interleaved: each round visits every grid for
``--steps`` steps, the grid order rotating from round to round, so a burst of
load from elsewhere on a shared host spreads over all grids instead of
spoiling one. Rank 0 appends each step to ``DIR/<grid>/metrics.jsonl``
(``step``, ``step_time_s``, ``loss``, ``round``, ``warmup``: true for the first
``--warmup`` steps of every visit). A grid may carry a rank order after ``|``
(``x=2,z=4|z,x,y,data``; default ``parallel.order``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def grid_dir(out: Path, spec: str) -> Path:
    """Run folder of ``spec``: ``data=2,x=4`` -> ``out/data2_x4``; ``x=2,z=4|z,x,y,data`` ->
    ``out/x2_z4-zxydata``."""
    grid, _, order = spec.partition("|")
    return out / (grid.replace(",", "_").replace("=", "") + (f"-{order.replace(',', '')}" if order else ""))


def split_spec(spec: str) -> tuple[str, list[str]]:
    """``'grid|order'`` -> the grid and the ``--set`` giving its order (none without one)."""
    grid, _, order = spec.partition("|")
    return grid, [f"parallel.order={order}"] if order else []


def visit_order(specs: list[str], rnd: int) -> list[str]:
    """Grids in the order of round ``rnd`` (rotated by the round number)."""
    k = rnd % len(specs) if specs else 0
    return specs[k:] + specs[:k]


def _trainers(specs: list[str], sets: list[str], rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from axo4d.config import load_config
    from axo4d.dist.comm import Comm
    from axo4d.facts.grid import Grid
    from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
    from axo4d.training.trainer import Trainer

    out = {}
    for spec in specs:
        grid, order = split_spec(spec)
        cfg = load_config("tiny", list(sets) + order, grid)
        if not out:
            if rank == 0:
                prepare_tokens(cfg.data)
            dist.barrier()
            ds = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
        out[spec] = Trainer(
            cfg, Comm(Grid.parse(grid, cfg.parallel.order), rank, timeout_s=300), ds, torch.device("cpu")
        )
    return out


def sweep(specs: list[str], sets: list[str], out: Path, rounds: int, steps: int, warmup: int) -> None:
    """Interleaved training of every grid (every rank calls this)."""
    import torch
    import torch.distributed as dist

    from axo4d.dist.bootstrap import init_distributed, shutdown

    torch.set_num_threads(1)
    info = init_distributed(backend="gloo", timeout_s=300)
    sets = list(sets) + [f"train.steps={rounds * steps}"]
    trainers = _trainers(specs, sets, info.rank)
    if info.rank == 0:
        for spec in specs:
            grid_dir(out, spec).mkdir(parents=True, exist_ok=True)
            (grid_dir(out, spec) / "metrics.jsonl").write_text("")
    done = {s: 0 for s in specs}
    for rnd in range(rounds):
        for spec in visit_order(specs, rnd):
            dist.barrier()
            recs = []
            for k in range(steps):
                st = trainers[spec].step(done[spec])
                recs.append(
                    {
                        "step": done[spec],
                        "step_time_s": st.step_time_s,
                        "loss": st.loss,
                        "round": rnd,
                        "warmup": k < warmup,
                        "grid": spec,
                    }
                )
                done[spec] += 1
            if info.rank == 0:
                with open(grid_dir(out, spec) / "metrics.jsonl", "a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in recs)
                print(f"round {rnd} {spec:24s} " + " ".join(f"{r['step_time_s']:.3f}" for r in recs), flush=True)
    shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.perfmodel_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--grids", required=True, help="';'-separated grid specs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="steps per grid and round")
    ap.add_argument("--warmup", type=int, default=1, help="steps of each visit marked warm-up")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    opts = ap.parse_args(argv)
    specs = [s for s in opts.grids.split(";") if s]
    sweep(specs, opts.set, Path(opts.out), opts.rounds, opts.steps, opts.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main())
