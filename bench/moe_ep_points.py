"""Expert-parallel points of the performance model: one grid per MoE model, every expert-group
size G_ep, the predicted step, compute, exposed data-axis time (the all-to-alls included) and
memory (perfmodel/expert_pricing.py). Seconds of CPU, no GPU::

    python -m bench.moe_ep_points                              # both named MoE configs, alps and perlmutter
    python -m bench.moe_ep_points --machine alps --model mixtral-8x7b=data=32,x=2,z=4
"""

from __future__ import annotations

import argparse

from axo4d.config import load_config
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid
from perfmodel import expert_pricing as P
from perfmodel.machine import load_machine
from perfmodel.model import estimate

POINTS = ("qwen3-30b-a3b=data=64,z=4", "mixtral-8x7b=data=32,x=2,z=4")


def rows(machine: str, model: str, grid: str, batch: int) -> list[str]:
    """One line per valid G_ep of ``grid`` (sequence split over z, activation checkpointing)."""
    m, cfg, out = load_machine(machine), load_config(model, [], None).model, []
    g = Grid.parse(grid)
    for ep in P.ep_candidates(model_spec(cfg, g)):
        e = estimate(cfg, g, batch, m, expert=ep, z_split="sequence", checkpointing=True)
        out.append(
            f"{machine:10} {model:14} {P.grid_label(grid, ep):24} step_s={e.step_time_s:7.3f} "
            f"compute_s={e.compute_s:6.3f} exp_data={e.exposed_by_axis['data']:6.3f} "
            f"mem_GiB={e.memory_bytes['total'] / 2**30:6.1f} {'ok' if e.feasible else e.reason}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.moe_ep_points", description=__doc__.split("\n\n")[0])
    ap.add_argument("--machine", action="append", help="perfmodel machine (default: alps and perlmutter)")
    ap.add_argument("--model", action="append", help="NAME=GRID (default: both named MoE configs)")
    ap.add_argument("--batch", type=int, default=512)
    a = ap.parse_args(argv)
    for mach in a.machine or ["alps", "perlmutter"]:
        for point in a.model or POINTS:
            name, _, grid = point.partition("=")
            print("\n".join(rows(mach, name, grid, a.batch)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
