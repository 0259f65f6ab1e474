"""Evaluate a checkpoint or a Hugging Face folder, on any grid: lm-evaluation-harness tasks and/or
the validation loss on a data source.

    python -m axo4d.eval PATH [--grid SPEC] [--tasks T1,T2 [--include-path DIR] [--limit N]
                         [--num-fewshot K] [--log-samples]] [--val-source SRC] [--val-samples N]
                         [--batch-size N] [--out results.json] [--set key=value ...]

``PATH`` is an axo4d checkpoint (a ``step_N`` folder or a run folder: its newest complete
checkpoint) or a Hugging Face folder, as ``--init-from`` takes it. Launch it like training
(``python -m launch.local -n 8 -- axo4d.eval ...``, ``mpiexec``, ``srun``); the model is sharded
over the grid and every rank computes its rows of each batch.

* ``--tasks``: the harness's tasks (any it knows, given its data; your own YAML tasks with
  ``--include-path``), scored through :class:`axo4d.training.lm_harness.GridLM` (``pip install
  'axo4d[eval]'``); rank 0 prints the harness's table and writes its results JSON to ``--out``.
* without ``--tasks``, or with ``--val-source``: the validation loss per target token of the model
  on ``--val-source`` (a source as ``data.source`` takes it, all of it), or on the held-out
  documents of ``data.source`` (``--set data.source=...``), ``--val-samples`` samples of
  ``seq_len + 1`` tokens (0: all), the same samples and mean as training's validation.

Bad input (a missing folder, an unknown task, a model that does not fit the grid) is one line and
exit status 2; exit statuses: :mod:`axo4d.exits`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from axo4d.config import check_values, load_config
from axo4d.config.errors import ConfigError
from axo4d.exits import ArgParser, run_and_exit
from axo4d.facts.run import derive
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.datasets.tokenizer import load_tokenizer
from axo4d.training.init_from import config_with_init, load_init_weights
from axo4d.training.startup import build_model_on, make_tuner, start, with_grid
from axo4d.training.val_loss import validation_loss


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgParser(
        prog="python -m axo4d.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("path", metavar="PATH", help="axo4d checkpoint (or run folder) or Hugging Face folder")
    ap.add_argument("--grid", default=None, help="grid spec, e.g. x=2,y=2 (default: data=<ranks>)")
    ap.add_argument("--tasks", default="", help="lm-evaluation-harness tasks, comma-separated")
    ap.add_argument("--include-path", default=None, help="folder of your own task YAML files")
    ap.add_argument("--limit", type=int, default=None, help="at most this many examples a task")
    ap.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    ap.add_argument("--log-samples", action="store_true", help="keep every example's requests and scores in --out")
    ap.add_argument("--val-source", default=None, help="validation loss on this whole source")
    ap.add_argument("--val-samples", type=int, default=0, help="validation samples (0: all)")
    ap.add_argument("--batch-size", type=int, default=16, help="requests (or samples) a forward, over the grid")
    ap.add_argument("--out", default=None, help="results JSON (written by rank 0)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--launcher", default="auto")
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[str]:
    """The task names, every argument checked before a process group exists."""
    for name in ("batch_size", "val_samples", "limit", "num_fewshot"):
        v = getattr(args, name)
        if v is not None and v < (1 if name == "batch_size" else 0):
            raise ConfigError(f"--{name.replace('_', '-')} {v} must be >= {1 if name == 'batch_size' else 0}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.out and Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out!r} is a folder: give the results file's path, e.g. {args.out}/results.json")
    if tasks or args.include_path:
        try:
            from axo4d.training.lm_harness import check_tasks
        except ImportError as e:
            raise ConfigError(f"--tasks needs lm-evaluation-harness ({e}): pip install 'axo4d[eval]'") from None
        check_tasks(tasks, args.include_path)
    return tasks


def eval_config(args: argparse.Namespace):
    """The run config of ``args.path`` (its model and tokenizer), z splitting the batch."""
    cfg = config_with_init(load_config("tiny", args.set), args.path, args.set)
    if args.val_source:
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, source=args.val_source, val_source=args.val_source)
        )
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, z_split="batch"))
    check_values(cfg)
    return cfg


def run(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tasks = check_args(args)
    cfg = eval_config(args)
    world = start(cfg, args.launcher, lambda c, info: with_grid(c, args.grid or f"data={info.world_size}"))
    comm, device, cfg = world.comm, world.device, world.cfg
    facts = derive(cfg, comm.grid, batch=False)  # the model on this grid, checked as training checks it
    model = build_model_on(cfg, comm, device, seed=None, tuner=make_tuner(cfg, comm), facts=facts)
    load_init_weights(model, args.path, comm)
    dtype = torch.bfloat16 if device.type == "cuda" and cfg.train.dtype != "fp32" else None
    report: dict = {}
    if tasks:
        from axo4d.training.lm_harness import GridLM, run_tasks

        lm = GridLM(model, load_tokenizer(cfg.data.tokenizer), args.batch_size, dtype)
        report = run_tasks(lm, tasks, args.include_path, args.limit, args.num_fewshot, args.log_samples)
        if world.rank == 0:
            from lm_eval.utils import make_table

            print(make_table(report), flush=True)
    if not tasks or args.val_source:
        comm.on_rank0(lambda: prepare_tokens(cfg.data))
        data = comm.on_every_rank(
            lambda: open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
        )
        loss, n = validation_loss(model, data, args.val_samples, args.batch_size, dtype)
        report["val_loss"], report["val_targets"] = loss, n
        if world.rank == 0:
            where = cfg.data.val_source or f"held-out documents of {cfg.data.source}"
            print(
                f"axo4d.eval: validation loss {loss:.6f} over {n:,} targets of {where}, grid {comm.grid.spec()}",
                flush=True,
            )
    if world.rank == 0 and args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
        print(f"axo4d.eval: results {args.out}", flush=True)
    comm.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """CLI entry: one clear error line and a documented exit status (axo4d.exits), never a hang."""
    return run_and_exit(run, argv, "axo4d.eval")


if __name__ == "__main__":
    sys.exit(main())
