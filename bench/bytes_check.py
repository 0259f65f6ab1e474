"""Bytes per rank per step: what :class:`axo4d.dist.comm.Comm` counts vs the perf model.

    python -m bench.bytes_check                       # spawns 8 CPU ranks, every 8-rank grid
    python -m bench.bytes_check --grids x=2,y=2,z=2 --set train.activation_checkpointing=true
    python -m launch.local -n 8 --mode env -- bench.bytes_check --summary
    python -m bench.bytes_check --compare-fp8 tensorwise --grids "z=8;x=2,y=2,z=2;data=2,z=4"   # FP8 vs bf16
    python -m bench.bytes_check --moe --summary          # moe-tiny, experts over 2 and 4 ranks

For every grid of the world whose model divides, each rank builds a
:class:`axo4d.training.trainer.Trainer`, resets the communication counters, runs one
training step (``Trainer.step``: forward, backward, data-parallel reduction,
gradient norm, optimizer) and reports ``comm.bytes`` / ``comm.calls``. Rank 0
prints them next to :func:`perfmodel.model.estimate`'s ``bytes_per_rank`` and
``calls_per_rank`` per (group, collective) and in total. Counts must be EQUAL
on every rank; the exit status is 1 otherwise.

Both sides include the bookkeeping scalars (fp64 loss all-reduce over
(data, z), one fp64 gradient-norm all-reduce per distinct split-axes set;
:func:`perfmodel.costs.bookkeeping_colls`). The model shape (vocabulary 260,
padded per G_y for the LM head but not for the embedding; 8 heads; biases on)
lets all 20 grids of 8 ranks build.

``--compare-fp8 RECIPE``: every grid twice, in bf16 (``train.dtype=bf16``) and with FP8 GEMMs in
every linear layer (``train.fp8=RECIPE``, ``train.fp8_layers=all``; vocabulary padded to a
multiple of 16 per y rank so the LM head's GEMM divides; grids where an FP8 GEMM dimension would
not be a multiple of 16 are left out), and prints the z all-gather bytes of both side by side: the
FP8 run's are exactly half (1 byte an element instead of 2), each measured == predicted.

``--moe``: ``moe-tiny`` (8 experts, top-2) instead, on every 8-rank grid it divides on with its
experts over 2 and over 4 ranks of data (``parallel.expert``; with x, y and z where the grid has
them). The facts' all-to-alls (:func:`axo4d.facts.moe_parts.a2a_collectives`: the counts, the
dispatch and the combine, forward, recomputed and backward, over ``ep``) and the experts'
gradients summed over ``edp`` (the copies of an expert) must equal the counted ones too. The
facts assume uniform routing (a rank's experts multiply ``k * b`` rows, the mean); a trained
router sends each rank a different number of rows every step, so here every MoE layer routes
exactly balanced (:func:`balance_routing`: the (token, slot) pairs of a rank's ``b`` tokens go to
the experts in turn, ``k * b / E`` to each, the gates still the router's softmax scores): every
rank then sends and receives exactly ``k * b`` rows, the uniform assumption exactly true. The
router's own collectives and the counts' exchange are unchanged; only which experts a token
meets differs (the routing's numerics are the MoE tests', :mod:`tests.dist.test_moe`). Predicting
from the step's measured tokens per expert instead would make the check depend on the data and
differ per rank (and the combine's rows are the only routing-dependent volume).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from axo4d.facts.grid import AXES, Grid, all_grids
from bench.bytes_moe import MOE_CONFIG, MOE_OVERRIDES, balance_routing, moe_cases

CONFIG = "tiny"
#: Small GPT whose shapes divide on every 8-rank grid; fp32 as on CPU.
OVERRIDES: tuple[str, ...] = (
    "model.n_layer=2",
    "model.n_embd=64",
    "model.n_head=8",
    "model.vocab_size=260",
    "model.seq_len=32",
    "model.vocab_multiple=8",
    "train.global_batch=8",
    "train.dtype=fp32",
)
WORLD = 8
#: ranks per node the prediction assumes (perlmutter's GPUs per node): a grid runs as the start-up
#: runs it on such nodes (:func:`run_on`: x and y exchanged where x's groups cross them)
RANKS_PER_NODE = 4


def run_on(cfg: Any, spec: str) -> Grid:
    """The grid ``spec`` (in ``parallel.order``) runs on, as the start-up builds it on nodes of
    :data:`RANKS_PER_NODE` ranks (:func:`axo4d.facts.run.derive.run_grid`); both sides use it, so
    the counters and the prediction name the same groups."""
    from axo4d.facts.run import run_grid

    return run_grid(cfg.model, Grid.parse(spec, cfg.parallel.order, cfg.parallel.expert), RANKS_PER_NODE)


def group_key(comm_key: str) -> str:
    """``Comm`` counter axes (``'z+data'``) -> perf model group name (``'data,z'``; the expert
    sub-axes of data, ``ep`` and ``edp``, where data would be)."""
    axes = comm_key.split("+")
    order = ("data", "ep", "edp") + AXES[1:]
    return ",".join(sorted(axes, key=order.index))


def _flat(counter: dict) -> dict[str, float]:
    """``{(axes, op): n}`` of ``Comm`` -> ``{'group:op': n}`` (JSON-able)."""
    out: dict[str, float] = {}
    for (axes, op), v in counter.items():
        k = f"{group_key(axes)}:{op}"
        out[k] = out.get(k, 0) + v
    return out


def _config(case: list | dict) -> Any:
    """The config of a case ``[spec, overrides(, config name)]`` or of its result."""
    from axo4d.config import load_config

    if isinstance(case, dict):
        return load_config(case.get("config", CONFIG), case["overrides"], case["spec"])
    return load_config(case[2] if len(case) > 2 else CONFIG, list(case[1]), case[0])


def predicted(cfg: Any, spec: str) -> tuple[dict[str, float], dict[str, int]]:
    """The perf model's bytes and calls per rank per step for ``cfg`` on ``spec``."""
    from axo4d.facts.spec import Dtypes
    from axo4d.training.optim.sharded import shard_optimizer_on
    from axo4d.training.startup import z_split_of
    from perfmodel.machine import load_machine
    from perfmodel.model import estimate

    t = cfg.train
    dtype = "fp32" if t.dtype in ("auto", "fp32") else t.dtype  # CPU: auto means fp32
    grid = dataclasses.replace(run_on(cfg, spec), expert=1)  # the expert group: ``expert`` below
    e = estimate(
        cfg.model,
        grid,
        t.global_batch,
        load_machine("perlmutter"),
        checkpointing=t.activation_checkpointing,
        dtypes=Dtypes.for_compute(dtype),
        dp_bucket_mb=cfg.parallel.dp_bucket_mb,
        grad_accum=t.grad_accum,
        shard_optimizer=shard_optimizer_on(cfg.parallel, grid),
        offload=t.offload,
        cache_weights=cfg.parallel.cache_weights,
        fp8=t.fp8,
        fp8_layers=t.fp8_layers,
        z_split=z_split_of(cfg, grid)[0],
        expert=cfg.parallel.expert,
        imbalance=1.0,  # exactly balanced routing (balance_routing)
    )
    fmt = {f"{g}:{k}": v for (g, k), v in e.bytes_per_rank.items()}
    return fmt, {f"{g}:{k}": v for (g, k), v in e.calls_per_rank.items()}


def feasible_specs(cfg: Any, world: int = WORLD) -> list[str]:
    """Specs of every ``world``-rank grid the model and batch divide on."""
    from axo4d.facts.archs import model_spec
    from axo4d.training.startup import z_split_of

    m, t = cfg.model, cfg.train
    out = []
    for g in all_grids(world):
        spec = model_spec(m, g).with_sequence_split(z_split_of(cfg, g)[0] == "sequence")
        ok = not spec.divisibility_reasons(t.global_batch // t.grad_accum)
        if ok and t.global_batch % t.grad_accum == 0:
            out.append(g.spec())
    return out


def compare(measured: dict[str, float], pred: dict[str, float]) -> list[tuple[str, float, float]]:
    """Rows ``(group:kind, measured, predicted)`` over the union of keys, sorted, plus ``total``."""
    keys = sorted(set(measured) | set(pred))
    rows = [(k, float(measured.get(k, 0)), float(pred.get(k, 0))) for k in keys]
    rows.append(("total", sum(r[1] for r in rows), sum(r[2] for r in rows)))
    return rows


# ---- rank side ---------------------------------------------------------------------
def measure(info: Any, cases: list[list]) -> list[dict]:
    """On every rank: for each ``[spec, overrides]`` case, one ``Trainer.step``'s counts."""
    import torch
    import torch.distributed as dist

    from axo4d.dist.comm import Comm
    from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
    from axo4d.training.trainer import Trainer

    torch.set_num_threads(1)
    out = []
    datasets: dict = {}
    for case in cases:
        spec, overrides = case[0], case[1]
        cfg = _config(case)
        key = (cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
        if key not in datasets:
            if info.rank == 0:
                prepare_tokens(cfg.data)
            dist.barrier()
            datasets[key] = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
        comm = Comm(run_on(cfg, spec), info.rank, timeout_s=120)
        trainer = Trainer(cfg, comm, datasets[key], torch.device("cpu"))
        balance_routing(trainer.model)
        comm.reset_counters()
        trainer.step(0)
        trainer.settle()  # the sharded optimizer's weight gathers of this step (overlapped with the next)
        r = {"spec": spec, "overrides": list(overrides), "bytes": _flat(comm.bytes), "calls": _flat(comm.calls)}
        out.append({**r, "config": case[2]} if len(case) > 2 else r)
        comm.close()
    return out


def check(info: Any, cases: list[list]) -> list[dict]:
    """Rank-side entry for the test harness: measured vs predicted per case and rank."""
    res = measure(info, cases)
    for r in res:
        bp, cp = predicted(_config(r), r["spec"])
        r["pred_bytes"], r["pred_calls"] = bp, cp
        r["equal"] = _equal(r["bytes"], bp) and _equal(r["calls"], cp)
    return res


def _equal(a: dict[str, float], b: dict[str, float]) -> bool:
    return all(a.get(k, 0) == b.get(k, 0) for k in set(a) | set(b))


# ---- report (rank 0) -----------------------------------------------------------------
def _fmt(v: float) -> str:
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.1f}"


def grid_table(r: dict, per_rank: list[dict]) -> tuple[str, bool]:
    """Text table of one grid (rank 0's counts; other ranks checked for equality)."""
    rows = compare(r["bytes"], r["pred_bytes"])
    n_base = len(MOE_OVERRIDES if r.get("config") == MOE_CONFIG else OVERRIDES)
    calls, pcalls = r["calls"], r["pred_calls"]
    lines = [
        f"grid {r['spec']}"
        + (f" {r['config']}" if r.get("config") else "")
        + (f"  [{' '.join(r['overrides'][n_base:])}]" if len(r["overrides"]) > n_base else "")
    ]
    lines.append(f"  {'group:collective':28s} {'calls':>9s} {'measured B':>14s} {'predicted B':>14s}  ok")
    ok_all = True
    for k, m, p in rows:
        c = "" if k == "total" else f"{int(calls.get(k, 0))}/{int(pcalls.get(k, 0))}"
        ok = m == p and (k == "total" or calls.get(k, 0) == pcalls.get(k, 0))
        ok_all &= ok
        lines.append(f"  {k:28s} {c:>9s} {_fmt(m):>14s} {_fmt(p):>14s}  {'==' if ok else 'DIFF'}")
    bad = [i for i, rr in enumerate(per_rank) if rr["bytes"] != r["bytes"] or rr["calls"] != r["calls"]]
    if bad:
        ok_all = False
        lines.append(f"  ranks {bad} counted differently from rank 0")
    return "\n".join(lines), ok_all


def _label(r: dict) -> str:
    """A case's grid, its expert group shown as ``data=4(ep=2),...``."""
    ep = [o.split("=", 1)[1] for o in r["overrides"] if o.startswith("parallel.expert=")]
    head, sep, rest = r["spec"].partition(",")
    return f"{head}(ep={ep[-1]}){sep}{rest}" if ep and ep[-1] != "1" else r["spec"]


def report(all_ranks: list[list[dict]], summary_only: bool) -> bool:
    """Print every grid's table and a summary; True when all counts equal the model's."""
    n_ok, lines = 0, []
    for i, r in enumerate(all_ranks[0]):
        bp, cp = predicted(_config(r), r["spec"])
        r["pred_bytes"], r["pred_calls"] = bp, cp
        text, ok = grid_table(r, [rank[i] for rank in all_ranks])
        n_ok += ok
        if not summary_only:
            print(text + "\n", flush=True)
        tot = compare(r["bytes"], bp)[-1]
        lines.append(f"  {_label(r):24s} {_fmt(tot[1]):>14s} {_fmt(tot[2]):>14s}  {'EQUAL' if ok else 'DIFFERENT'}")
    n = len(all_ranks[0])
    print(f"summary: bytes per rank per step, {len(all_ranks)} ranks, one Trainer.step each")
    print(f"  {'grid':24s} {'measured B':>14s} {'predicted B':>14s}")
    print("\n".join(lines))
    print(
        f"{n_ok}/{n} grids: measured == predicted for every (group, collective), bytes and calls, on every rank",
        flush=True,
    )
    return n_ok == n


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.bytes_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--grids", default="all", help="';'-separated grid specs, or 'all' (default)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override on top of the built-in small GPT (repeatable)",
    )
    ap.add_argument("--ranks", type=int, default=WORLD, help="ranks to spawn when not launched (default 8)")
    ap.add_argument("--summary", action="store_true", help="print only the summary table")
    ap.add_argument(
        "--moe",
        action="store_true",
        help="moe-tiny with its experts over 2 and 4 data ranks (exactly balanced routing) instead of the small GPT",
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds before the spawned ranks are stopped")
    ap.add_argument(
        "--compare-fp8",
        default="",
        choices=["", "tensorwise", "rowwise"],
        help="each grid in bf16 and with FP8 GEMMs of this recipe: the z all-gather bytes side by side",
    )
    return ap


BF16 = ("train.dtype=bf16", "model.vocab_multiple=16")


def fp8_pairs(opts: argparse.Namespace, world: int) -> list[list]:
    """``--compare-fp8``: [spec, bf16 overrides], [spec, FP8 overrides] for each grid the FP8 shapes divide on."""
    from axo4d.config import load_config
    from axo4d.training.startup import check_fp8_shapes

    base = list(OVERRIDES) + list(BF16) + list(opts.set)
    fp8 = base + [f"train.fp8={opts.compare_fp8}", "train.fp8_layers=all"]
    specs = _specs(opts, load_config(CONFIG, fp8), world)
    out = []
    for s in specs:
        try:
            check_fp8_shapes(load_config(CONFIG, fp8, s), Grid.parse(s))
        except ValueError:
            continue
        out += [[s, base], [s, fp8]]
    return out


def fp8_table(results: list[dict]) -> str:
    """z all-gather bytes of each (bf16, FP8) pair of :func:`fp8_pairs`' cases."""
    key = "z:all_gather"
    lines = [
        f"  {'grid':24s} {'bf16 z all-gather B':>20s} {'FP8 z all-gather B':>20s} {'FP8/bf16':>9s}  measured==predicted"
    ]
    for a, b in zip(results[::2], results[1::2]):
        m16, m8 = a["bytes"].get(key, 0), b["bytes"].get(key, 0)
        same = a["bytes"].get(key, 0) == a["pred_bytes"].get(key, 0) and m8 == b["pred_bytes"].get(key, 0)
        ratio = m8 / m16 if m16 else float("nan")
        lines.append(f"  {a['spec']:24s} {_fmt(m16):>20s} {_fmt(m8):>20s} {ratio:9.4f}  {'yes' if same else 'NO'}")
    return "\n".join(lines)


def _specs(opts: argparse.Namespace, cfg: Any, world: int) -> list[str]:
    if opts.grids == "all":
        return feasible_specs(cfg, world)
    return [s.strip() for s in opts.grids.split(";") if s.strip()]


def _cases(opts: argparse.Namespace, world: int) -> list[list]:
    from axo4d.config import load_config

    if opts.compare_fp8:
        return fp8_pairs(opts, world)
    if opts.moe:
        return moe_cases(opts, world)
    overrides = list(OVERRIDES) + list(opts.set)
    return [[s, overrides] for s in _specs(opts, load_config(CONFIG, overrides), world)]


def _rank_main(opts: argparse.Namespace) -> int:
    import torch.distributed as dist

    from axo4d.dist.bootstrap import init_distributed, shutdown

    info = init_distributed(backend="gloo", timeout_s=300)
    res = measure(info, _cases(opts, info.world_size))
    gathered: list = [None] * info.world_size
    dist.all_gather_object(gathered, res)
    ok = report(gathered, opts.summary) if info.rank == 0 else True
    if opts.compare_fp8 and info.rank == 0:
        print(f"\nz all-gather bytes per rank per step, bf16 vs FP8 ({opts.compare_fp8}, every linear layer):")
        print(fp8_table(gathered[0]), flush=True)
    flag = [ok]
    dist.broadcast_object_list(flag, src=0)
    shutdown()
    return 0 if flag[0] else 1


def main(argv: list[str] | None = None) -> int:
    """Run under a launcher (every rank measures), or spawn ``--ranks`` local ranks."""
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = _parser().parse_args(argv)
    from axo4d.dist.discovery import detect_launcher

    if detect_launcher() != "single":
        return _rank_main(opts)
    from launch.local import run_env

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = root + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rc = run_env(opts.ranks, [sys.executable, "-u", "-m", "bench.bytes_check", *argv], timeout=opts.timeout)
    if rc == 124:
        print(f"bench.bytes_check: timed out after {opts.timeout:.0f} s", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
