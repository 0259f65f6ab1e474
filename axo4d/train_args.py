"""The command line of ``python -m axo4d.train`` (:mod:`axo4d.train`): its arguments, the checks of
the config before any process group exists, and the ``--grid auto`` resolver's entry point."""

from __future__ import annotations

import argparse

from axo4d.config import RunConfig, check_values
from axo4d.config.errors import ConfigError
from axo4d.exits import ArgParser
from axo4d.facts.grid import Grid
from axo4d.facts.run import RunFacts, derive
from axo4d.training.metrics_log import check_tensorboard

GRID_AUTO_GROUP = "axo4d.grid_auto"


def grid_auto_plugin():
    """The ``--grid auto`` resolver (``plan_run``, ``measured_line``), handed in by the package that
    provides it: the performance model registers the module ``perfmodel.grid_auto`` under the entry
    point group ``axo4d.grid_auto`` of its packaging metadata. So ``axo4d`` never imports ``perfmodel``
    (which reads ``axo4d.facts``) and the two packages import in one direction only."""
    from importlib.metadata import entry_points

    found = list(entry_points(group=GRID_AUTO_GROUP))
    if not found:
        raise ConfigError(
            "--grid auto needs the performance model installed beside axo4d (pip install -e . registers "
            f"it as the entry point group {GRID_AUTO_GROUP}); or give the grid, e.g. --grid data=2,x=2"
        )
    return found[0].load()


def parse_args(argv: list[str] | None, description: str | None) -> argparse.Namespace:
    ap = ArgParser(
        prog="python -m axo4d.train", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="tiny", help="named config (axo4d/configs) or YAML path")
    ap.add_argument("--grid", default=None, help="grid spec, e.g. data=2,x=2,y=1,z=2 (overrides parallel.grid)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. train.steps=100 (repeatable)",
    )
    ap.add_argument("--out", default="runs/latest", help="output folder")
    ap.add_argument(
        "--resume",
        default=None,
        metavar="PATH|auto",
        help="resume from a checkpoint folder, or the newest complete checkpoint of a run folder; "
        "'auto': the newest in --out if any, else start fresh",
    )
    ap.add_argument(
        "--init-from",
        default=None,
        metavar="PATH",
        help="start from a Hugging Face model folder (config.json, *.safetensors, tokenizer.json) or "
        "an axo4d checkpoint: its model and weights, a fresh optimizer",
    )
    ap.add_argument("--launcher", default="auto", help="auto, env, mpi, slurm or single")
    return ap.parse_args(argv)


def check_run_config(cfg: RunConfig, grid: Grid) -> RunFacts:
    """Values the dataclass types cannot rule out, and the model and batch against the grid:
    checked before any process group exists or anything is written. Returns the run's derived
    numbers (:func:`axo4d.facts.run.derive`: the run plan's torch-free part, derived once)."""
    check_values(cfg)
    if cfg.train.tensorboard:
        check_tensorboard()
    if cfg.eval.tasks:  # lm-evaluation-harness tasks during training
        try:
            from axo4d.training.lm_harness import check_eval_config
        except ImportError as e:
            raise ConfigError(f"eval.tasks needs lm-evaluation-harness ({e}): pip install 'axo4d[eval]'") from None
        check_eval_config(cfg)
    return derive(cfg, grid)


def needs_plan(cfg: RunConfig) -> bool:
    """Whether the performance model decides something at start-up (``--grid auto``,
    ``parallel.cache_weights=auto``, ``parallel.machine``)."""
    p = cfg.parallel
    return p.grid.strip().lower() == "auto" or p.cache_weights.strip().lower() == "auto" or bool(p.machine)


__all__ = ["GRID_AUTO_GROUP", "grid_auto_plugin", "parse_args", "check_run_config", "needs_plan"]
