"""Generate ready-to-submit job scripts for supercomputers.

    python -m launch.job --machine frontier --model gpt-20b --nodes 64            # grid from the perfmodel
    python -m launch.job --machine perlmutter --model gpt-5b --nodes 16 --grid data=2,z=32 --dry-run
    python -m launch.job --machine alps --model gpt-10b --nodes 32 --launcher mpirun --out run.sh
    python -m launch.job --machine perlmutter --model llama3.1-8b --nodes 8 --init-from /path/hf/llama-3.1-8b \
        --set data.source=/path/corpus.jsonl --set train.steps=2000               # a fine-tune

The script runs ``python -m axo4d.train --config MODEL --grid GRID --out RUN_DIR --resume auto``
(with ``--init-from`` and every ``--set`` passed on) with one rank per GPU. ``RUN_DIR`` defaults to
the machine's scratch file system (``$PSCRATCH`` on Perlmutter, ``$MEMBERWORK/<project>`` on
Frontier, ``$SCRATCH`` elsewhere; ``--run-root``/``--run-dir`` or ``RUN_DIR=`` override it): a
checkpoint of an 8B model is ~96 GB. The script runs under ``set -euo pipefail`` from its first
line; a module that does not load, or (on more than one node) a missing NCCL/RCCL network plugin,
stops it with one ``axo4d job: error:`` line and status 2.

Templates live in ``launch/templates/`` (package data) (``slurm/<machine>.sbatch``,
``mpirun.sh``, and the communication environment ``env/<machine>.sh``); machines without
their own files use ``generic``. With ``--grid auto`` (the default) the grid is the best
feasible one of :func:`perfmodel.model.rank_grids`, ranked as ``perfmodel rank`` ranks them (rank
order and z split searched; :mod:`launch.job_plan`), its order and z split written into the job
and its prediction into the script header (:mod:`launch.job_render`). Errors (unknown machine or
model, a grid that does not match the job, no
feasible grid) exit with status 2 and a message, without a traceback.

Walltime (Slurm): the script asks for ``--signal=B:USR1@T`` and ``--requeue``. ``T`` covers the
end of a step, a background save in flight and the final save (:func:`perfmodel.saves.warning_seconds`:
from the perf model's step time and save time, or from the last run's measured ones when
``--run-dir`` holds a run; at least 120 s). The script passes the signal on to the ranks, which
save and exit 75 ("stopped cleanly, resume me"); it then requeues itself (``scontrol requeue``, at
most ``MAX_REQUEUES`` times), and the next run continues with ``--resume auto``. Training that
finished, or failed for a reason a restart would meet again, ends the job without a requeue.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from axo4d.config import ConfigError
from axo4d.facts.grid import GridError
from launch.job_plan import LAUNCHERS, JobError, JobPlan, JobRequest, plan_job
from launch.job_render import TEMPLATE_DIR, exported_names, fill, header, render, template_path, write_script

REPO_ROOT = Path(__file__).resolve().parent.parent


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m launch.job", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--machine", required=True, help="perlmutter, frontier, alps, or a machine YAML path")
    ap.add_argument("--model", required=True, help="named config (gpt-20b, ...) or a config YAML path")
    ap.add_argument("--nodes", type=int, required=True, help="number of nodes")
    ap.add_argument("--grid", default="auto", help="'auto' (perf model) or data=..,x=..,y=..,z=..")
    ap.add_argument("--batch", type=int, default=None, help="global batch in samples (default: the config's)")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="slurm", help="sbatch script or plain mpirun")
    ap.add_argument("--out", default=None, help="script file (default: ./<job name>.<sbatch|sh>)")
    ap.add_argument("--dry-run", action="store_true", help="print the script instead of writing it")
    ap.add_argument("--time", default="00:30:00", help="wall-clock limit, HH:MM:SS")
    ap.add_argument("--account", default=None, help="Slurm account/project (default: a placeholder to edit)")
    ap.add_argument("--job-name", default=None, help="job name (default: axo4d-<model>-<nodes>n)")
    ap.add_argument(
        "--init-from",
        default=None,
        metavar="PATH",
        help="fine-tune: a Hugging Face model folder or an axo4d checkpoint (axo4d.train --init-from)",
    )
    ap.add_argument(
        "--run-root",
        default=None,
        metavar="DIR",
        help="folder for the run folder (default: the machine's scratch, e.g. $PSCRATCH/axo4d)",
    )
    ap.add_argument("--run-dir", default=None, help="the training output folder itself (default: under --run-root)")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override passed to the trainer, e.g. train.steps=50 or data.source=PATH (repeatable)",
    )
    return ap


def request_from_args(args: argparse.Namespace, argv: list[str]) -> JobRequest:
    return JobRequest(
        machine=args.machine,
        model=args.model,
        nodes=args.nodes,
        grid=args.grid,
        batch=args.batch,
        launcher=args.launcher,
        time=args.time,
        account=args.account,
        sets=tuple(args.sets),
        run_dir=args.run_dir,
        job_name=args.job_name,
        command="python -m launch.job " + shlex.join(a for a in argv if a != "--dry-run"),
        init_from=args.init_from,
        run_root=args.run_root,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        plan = plan_job(request_from_args(args, argv))
        text = render(plan)
    except (JobError, ConfigError, GridError) as e:
        print(f"launch.job: error: {e}", file=sys.stderr)
        return 2
    for w in plan.warnings:
        print(f"launch.job: warning: {w}", file=sys.stderr)
    if args.dry_run:
        sys.stdout.write(text)
        return 0
    suffix = ".sbatch" if args.launcher == "slurm" else ".sh"
    path = write_script(text, args.out or f"{plan.job_name}{suffix}")
    submit = "sbatch" if args.launcher == "slurm" else "HOSTFILE=... bash"
    print(f"wrote {path}  (grid {plan.grid.spec()}; submit with: {submit} {path})")
    return 0


__all__ = [
    "LAUNCHERS",
    "REPO_ROOT",
    "TEMPLATE_DIR",
    "JobError",
    "JobPlan",
    "JobRequest",
    "build_parser",
    "exported_names",
    "fill",
    "header",
    "main",
    "plan_job",
    "render",
    "request_from_args",
    "template_path",
    "write_script",
]

if __name__ == "__main__":
    sys.exit(main())
