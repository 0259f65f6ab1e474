"""The prediction side of :mod:`bench.validate_perfmodel`: the validated model and its run
settings, the performance model's predictions of every configuration on a machine file, the
scores against measurements (Spearman, the alpha-beta baseline, bootstrap intervals), and the
hashes of what a prediction reads (what was frozen).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.validation_stats import bootstrap_rho, misordered, ranks, spearman

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "tiny"
#: The validated model: 2 layers, hidden 128, 8 heads, 64 tokens, batch 16 (fp32 on CPU).
MODEL_SETS: tuple[str, ...] = (
    "model.n_layer=2",
    "model.n_embd=128",
    "model.n_head=8",
    "model.vocab_size=256",
    "model.seq_len=64",
    "model.vocab_multiple=8",
    "train.global_batch=16",
    "train.dtype=fp32",
)
#: Keep runs short and side-effect free (no tuner timing, no checkpoint, one eval batch, no GEMM probe).
RUN_SETS: tuple[str, ...] = (
    "train.eval_interval=0",
    "train.eval_batches=1",
    "train.peak_tflops=1.0",
    "parallel.tuner=false",
    "checkpoint.at_end=false",
)
PROFILE_ARGS: tuple[str, ...] = (
    "--sizes-mb",
    "0.001,0.25,4",
    "--iters",
    "6",
    "--warmup",
    "1",
    "--repeats",
    "3",
    "--gemm-n",
    "256",
    "--name",
    "vcluster-cpu",
)
GPUS_PER_NODE = 4
WORLD = 8


# ---- prediction ------------------------------------------------------------------------
def model_config(extra: list[str] | None = None) -> Any:
    from axo4d.config import load_config

    return load_config(CONFIG, list(MODEL_SETS) + list(extra or []))


def model_yaml(path: Path, extra: list[str] | None = None) -> Path:
    """The validated model as a config YAML (``perfmodel profile --model``)."""
    import yaml

    from axo4d.config import config_to_dict

    cfg = model_config(extra)
    path.write_text(
        yaml.safe_dump({"model": config_to_dict(cfg.model), "train": {"global_batch": cfg.train.global_batch}})
    )
    return path


def predict(
    machine_path: str,
    extra: list[str] | None = None,
    world: int = WORLD,
    gpn: int = GPUS_PER_NODE,
    configs: list[str] | None = None,
) -> dict[str, Any]:
    """Estimates keyed by configuration (``grid`` or ``grid|order``): every grid of ``world`` ranks
    (infeasible ones included), and ``configs`` when given."""
    from axo4d.facts.grid import Grid
    from axo4d.facts.spec import Dtypes
    from perfmodel.machine import load_machine
    from perfmodel.model import estimate, rank_grids

    cfg = model_config(extra)
    m = load_machine(machine_path)
    kw = dict(dtypes=Dtypes.for_compute("fp32"), dp_bucket_mb=cfg.parallel.dp_bucket_mb, gpus_per_node=gpn)
    out = {
        e.grid.spec(): e
        for e in rank_grids(
            cfg.model,
            world,
            gpn,
            cfg.train.global_batch,
            m,
            checkpointing=False,
            **{k: v for k, v in kw.items() if k != "gpus_per_node"},
        )
    }
    for c in configs or []:
        if c not in out:
            grid, _, order = c.partition("|")
            out[c] = estimate(cfg.model, Grid.parse(grid, order or None), cfg.train.global_batch, m, **kw)
    return out


def configurations(
    specs: list[str], orders: str, extra: list[str] | None, machine_path: str | None = None
) -> list[str]:
    """Grids (``orders='default'``), or each grid and its traffic order where it differs."""
    if orders == "default":
        return list(specs)
    from axo4d.facts.grid import Grid
    from axo4d.facts.spec import Dtypes
    from perfmodel.machine import load_machine
    from perfmodel.model import estimate
    from perfmodel.search import traffic_order

    cfg = model_config(extra)
    m = load_machine(machine_path or "perlmutter")  # bytes decide the order, not the links
    out = []
    for s in specs:
        g = Grid.parse(s)
        e = estimate(cfg.model, g, cfg.train.global_batch, m, dtypes=Dtypes.for_compute("fp32"))
        o = traffic_order(g, e.comm_s)
        out.append(s)
        if [a for a in o if g.size(a) > 1] != [a for a in g.order if g.size(a) > 1]:
            out.append(f"{s}|{','.join(o)}")
    return out


def score(
    measured: dict[str, float], pred: dict[str, Any], steps: dict[str, list[float]] | None = None
) -> dict[str, Any]:
    """Rows sorted by measured time, Spearman and the top-2 check, for the model and for the
    alpha-beta baseline (``comm_total_s``); the spread of log(predicted/measured); with ``steps``
    (each configuration's step times) the bootstrap intervals of rho, rho_baseline and their
    difference (:func:`bench.validation_stats.bootstrap_rho`)."""
    specs = [s for s in measured if s in pred]
    p = [pred[s].step_time_s for s in specs]
    base = [pred[s].comm_total_s for s in specs]
    m = [measured[s] for s in specs]
    pr, mr, br = ranks(p), ranks(m), ranks(base)
    rows = sorted(
        (
            {
                "grid": s,
                "predicted_s": p[i],
                "measured_s": m[i],
                "pred_rank": pr[i],
                "meas_rank": mr[i],
                "baseline_s": base[i],
                "base_rank": br[i],
                "compute_s": pred[s].compute_s,
                "exposed_comm_s": pred[s].exposed_comm_s,
            }
            for i, s in enumerate(specs)
        ),
        key=lambda r: r["measured_s"],
    )
    best = rows[0]["grid"] if rows else ""
    top2 = sorted(specs, key=lambda s: pred[s].step_time_s)[:2]
    btop2 = sorted(specs, key=lambda s: pred[s].comm_total_s)[:2]
    logs = [math.log(a / b) for a, b in zip(p, m) if a > 0 and b > 0]
    mean = sum(logs) / len(logs) if logs else float("nan")
    sd = (sum((x - mean) ** 2 for x in logs) / max(1, len(logs) - 1)) ** 0.5 if logs else float("nan")
    ok = steps is not None and len(specs) >= 3 and all(steps.get(s) for s in specs)
    ci = bootstrap_rho(p, base, [steps[s] for s in specs]) if ok else {}
    return {
        "rows": rows,
        "bootstrap": ci,
        "spearman": spearman(p, m) if len(specs) > 1 else float("nan"),
        "measured_best": best,
        "predicted_top2": top2,
        "best_in_top2": best in top2,
        "baseline_spearman": spearman(base, m) if len(specs) > 1 else float("nan"),
        "baseline_top2": btop2,
        "baseline_best_in_top2": best in btop2,
        "log_ratio_mean": mean,
        "log_ratio_sd": sd,
        "misordered": misordered(p, m),
    }


def prediction_sources(extra: list[str] | None = None, world: int = WORLD, gpn: int = GPUS_PER_NODE) -> list[Path]:
    """Every source file of this checkout a prediction reads: the modules a fresh interpreter has
    imported after :func:`predict` (perfmodel, the axo4d model facts, config, grid, ... and these
    benchmark modules), found by running one."""

    code = (
        "import json, sys\n"
        "import bench.validate_perfmodel as v\n"
        f"v.predict('perlmutter', {list(extra or [])!r}, {world}, {min(gpn, 4)})\n"
        "print(json.dumps(sorted({m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None)})))\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    files = [Path(f).resolve() for f in json.loads(out.stdout.strip().splitlines()[-1])]
    return sorted(f for f in files if ROOT in f.parents and ".venv" not in f.parts and f.suffix == ".py")


def frozen_record(
    machine: str | None = None, extra: list[str] | None = None, world: int = WORLD, gpn: int = GPUS_PER_NODE
) -> dict[str, str]:
    """sha256 (first 16 hex) of every source file a prediction reads (:func:`prediction_sources`:
    perfmodel and the axo4d modules it imports) and of the machine file: what was frozen."""
    files = prediction_sources(extra, world, gpn) + ([Path(machine)] if machine else [])
    return {
        str(f.relative_to(ROOT) if f.is_absolute() and ROOT in f.parents else f): hashlib.sha256(
            f.read_bytes()
        ).hexdigest()[:16]
        for f in files
        if f.exists()
    }
