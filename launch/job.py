"""Generate ready-to-submit job scripts for supercomputers.

    python -m launch.job --machine frontier --model gpt-20b --nodes 64            # grid from the perfmodel
    python -m launch.job --machine perlmutter --model gpt-5b --nodes 16 --grid data=2,z=32 --dry-run
    python -m launch.job --machine alps --model gpt-10b --nodes 32 --launcher mpirun --out run.sh

The script runs ``python -m axo4d.train --config MODEL --grid GRID --out RUN_DIR --resume auto``
with one rank per GPU. Templates live in ``launch/templates/`` (package data) (``slurm/<machine>.sbatch``,
``mpirun.sh``, and the communication environment ``env/<machine>.sh``); machines without
their own files use ``generic``. With ``--grid auto`` (the default) the grid is the best
feasible one of :func:`perfmodel.model.rank_grids`, and its prediction is written into the
script header. Errors (unknown machine or model, a grid that does not match the job, no
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
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axo4d.config import ConfigError, load_config, parse_overrides
from axo4d.facts.devices import vendor_peak
from axo4d.facts.grid import Grid, GridError
from launch.walltime import traps, warning_time

REPO_ROOT = Path(__file__).resolve().parent.parent
#: job templates ship inside the package (package data), so a plain ``pip install`` has them
TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
LAUNCHERS = ("slurm", "mpirun")
GIB = 2**30
_EDIT_ACCOUNT = "# (EDIT --account if it reads ACCOUNT, or regenerate with --account)\n"
_SAFE_PATH = re.compile(r"[A-Za-z0-9._/+=,@%-]+")


class JobError(ValueError):
    """A job that cannot be generated; the message says why and what would work."""


@dataclass(frozen=True)
class JobRequest:
    """What the user asked for (the command-line options of ``launch.job``)."""

    machine: str
    model: str
    nodes: int
    grid: str = "auto"
    batch: int | None = None
    launcher: str = "slurm"
    time: str = "00:30:00"
    account: str | None = None
    sets: tuple[str, ...] = ()
    run_dir: str | None = None
    job_name: str | None = None
    command: str = ""


@dataclass
class JobPlan:
    """A resolved job: machine, model, grid and the perf model's prediction for it."""

    request: JobRequest
    machine: Any
    model_cfg: Any
    config_arg: str
    grid: Grid
    global_batch: int
    checkpointing: bool
    sets: tuple[str, ...]
    estimate: Any = None
    runners_up: list = field(default_factory=list)
    n_grids: int = 0
    n_feasible: int = 0
    warnings: list[str] = field(default_factory=list)
    perf_kw: dict = field(default_factory=dict)
    signal: tuple[int, str] = (0, "")
    """Seconds before the time limit Slurm signals the job, and how they were found (:mod:`launch.walltime`)."""

    @property
    def gpus_per_node(self) -> int:
        return self.machine.gpus_per_node

    @property
    def ntasks(self) -> int:
        return self.request.nodes * self.machine.gpus_per_node

    @property
    def job_name(self) -> str:
        m = self.request.model
        model = Path(m).stem if m.endswith((".yaml", ".yml")) else Path(m).name
        return self.request.job_name or f"axo4d-{model}-{self.request.nodes}n"


# ---- planning -------------------------------------------------------------------------
def _load_machine(name: str) -> Any:
    try:
        from perfmodel.machine import MachineError, load_machine
    except ImportError as e:  # pragma: no cover - perfmodel is part of this repo
        raise JobError(f"the performance model (perfmodel) cannot be imported: {e}") from None
    try:
        return load_machine(name)
    except MachineError as e:
        raise JobError(str(e)) from None


def _config_arg(model: str) -> str:
    """Named configs stay names; YAML paths become absolute so the job finds them."""
    p = Path(model)
    return str(p.resolve()) if (p.suffix in (".yaml", ".yml") or os.sep in model) else model


def _checkpointing_override(sets: tuple[str, ...]) -> bool:
    return "activation_checkpointing" in parse_overrides(list(sets)).get("train", {})


def _check_request(req: JobRequest) -> None:
    if req.nodes < 1:
        raise JobError(f"--nodes {req.nodes}: a job needs at least 1 node")
    if req.launcher not in LAUNCHERS:
        raise JobError(f"unknown launcher {req.launcher!r}; valid: {', '.join(LAUNCHERS)}")
    if req.batch is not None and req.batch < 1:
        raise JobError(f"--batch {req.batch}: the global batch must be >= 1 sample")
    if not re.fullmatch(r"(\d+-)?\d{1,3}:\d{2}:\d{2}", req.time):
        raise JobError(f"--time {req.time!r}: expected HH:MM:SS or D-HH:MM:SS, e.g. 01:30:00")
    if req.run_dir is not None and not _SAFE_PATH.fullmatch(req.run_dir):
        raise JobError(f"--run-dir {req.run_dir!r}: use letters, digits and ._/+=,@%- only")
    if req.job_name is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", req.job_name):
        raise JobError(f"--job-name {req.job_name!r}: use letters, digits and ._- only")


def plan_job(req: JobRequest) -> JobPlan:
    """Resolve machine, model and grid; estimate the step with the perf model."""
    _check_request(req)
    machine = _load_machine(req.machine)
    sets = tuple(req.sets) + ((f"train.global_batch={req.batch}",) if req.batch is not None else ())
    try:
        cfg = load_config(req.model, list(sets))
    except ConfigError as e:
        raise JobError(str(e)) from None
    gpus = req.nodes * machine.gpus_per_node
    ckpt = cfg.train.activation_checkpointing if _checkpointing_override(req.sets) else None
    plan = JobPlan(
        req,
        machine,
        cfg.model,
        _config_arg(req.model),
        Grid(data=gpus, order=cfg.parallel.order),
        cfg.train.global_batch,
        bool(ckpt),
        sets,
    )
    plan.perf_kw = {"overlap": cfg.parallel.overlap, "dp_bucket_mb": cfg.parallel.dp_bucket_mb}
    if req.grid == "auto":
        _choose_grid(plan, ckpt)
    else:
        _explicit_grid(plan, ckpt)
    if ckpt is None:
        plan.sets += (f"train.activation_checkpointing={str(plan.checkpointing).lower()}",)
    plan.signal = warning_time(cfg.model, req.nodes, machine, plan.estimate, req.run_dir)
    limit = _seconds(req.time)
    if req.launcher == "slurm" and limit <= 2 * plan.signal[0]:
        plan.warnings.append(
            f"--time {req.time} leaves {max(0, limit - plan.signal[0])} s of training before the warning signal "
            f"({plan.signal[0]} s before the end, to save and requeue); ask for more time"
        )
    return plan


def _seconds(hms: str) -> int:
    """``[D-]HH:MM:SS`` in seconds."""
    days, _, rest = hms.rpartition("-")
    h, m, sec = (int(x) for x in rest.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + sec


def _choose_grid(plan: JobPlan, ckpt: bool | None) -> None:
    from perfmodel.model import rank_grids

    req, m = plan.request, plan.machine
    ranked = rank_grids(
        plan.model_cfg,
        plan.ntasks,
        m.gpus_per_node,
        plan.global_batch,
        m,
        checkpointing=ckpt,
        order=plan.grid.order,
        **plan.perf_kw,
    )
    feasible = [e for e in ranked if e.feasible]
    plan.n_grids, plan.n_feasible = len(ranked), len(feasible)
    if not feasible:
        lines = "\n".join(f"  {e.grid.spec()}: {e.reason}" for e in ranked[:4])
        raise JobError(
            f"no feasible grid for {req.model} on {req.nodes} {m.name} node(s) "
            f"({plan.ntasks} GPUs, global batch {plan.global_batch}); the closest of "
            f"{len(ranked)} candidates:\n{lines}\n"
            f"try more nodes, another global batch (--batch), or a smaller model"
        )
    plan.estimate, plan.runners_up = feasible[0], feasible[1:4]
    plan.grid, plan.checkpointing = feasible[0].grid, feasible[0].checkpointing


def _explicit_grid(plan: JobPlan, ckpt: bool | None) -> None:
    from perfmodel.model import estimate_auto

    req = plan.request
    try:
        grid = Grid.parse(req.grid, plan.grid.order)
    except GridError as e:
        raise JobError(f"--grid {req.grid!r}: {e}") from None
    if grid.world_size != plan.ntasks:
        raise JobError(
            f"--grid {grid.spec()} has {grid.world_size} ranks but {req.nodes} {plan.machine.name} "
            f"node(s) x {plan.gpus_per_node} GPUs per node = {plan.ntasks} ranks; choose sizes "
            f"whose product is {plan.ntasks}, or --grid auto"
        )
    est = estimate_auto(
        plan.model_cfg, grid, plan.global_batch, plan.machine, ckpt, gpus_per_node=plan.gpus_per_node, **plan.perf_kw
    )
    plan.grid, plan.estimate, plan.checkpointing = grid, est, est.checkpointing
    plan.n_grids, plan.n_feasible = 1, int(est.feasible)
    if not est.feasible:
        plan.warnings.append(f"the perf model predicts grid {grid.spec()} will not work: {est.reason}")


# ---- rendering -------------------------------------------------------------------------
def fill(template: str, values: dict[str, str]) -> str:
    """Replace every ``{{name}}`` in ``template``; a name without a value is an error."""

    def sub(m: re.Match) -> str:
        if m.group(1) not in values:
            raise JobError(f"template placeholder {{{{{m.group(1)}}}}} has no value")
        return values[m.group(1)]

    return re.sub(r"\{\{(\w+)\}\}", sub, template)


def template_path(kind: str, machine: str) -> Path:
    """``launch/templates/<kind>/<machine>.*`` or its ``generic`` fallback."""
    suffix = {"slurm": ".sbatch", "env": ".sh"}[kind]
    p = TEMPLATE_DIR / kind / f"{machine}{suffix}"
    return p if p.is_file() else TEMPLATE_DIR / kind / f"generic{suffix}"


def exported_names(env_text: str) -> list[str]:
    """Names the environment block exports (``export A=1 B=2`` lines, commented ones excluded)."""
    names: list[str] = []
    for line in env_text.splitlines():
        code = line.split("#", 1)[0]
        for m in re.finditer(r"\bexport\s+((?:[A-Za-z_]\w*=\S*\s*)+)", code):
            names += [a.split("=", 1)[0] for a in m.group(1).split() if "=" in a]
    return list(dict.fromkeys(names))


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.3f} s"


def prediction_lines(plan: JobPlan) -> list[str]:
    """Comment lines describing the perf model's estimate of ``plan``."""
    e = plan.estimate
    if e is None:
        return ["perf model: not available for this grid"]
    mem = e.memory_bytes
    parts = ", ".join(
        f"{k} {mem[k] / GIB:.1f}" for k in ("params", "grads", "optimizer", "activations", "buffers") if k in mem
    )
    comm = ", ".join(f"{a} {_fmt_s(t)}" for a, t in e.comm_s.items() if t >= 5e-5) or "none"
    src = plan.request.machine
    src = src if src.endswith((".yaml", ".yml")) or os.sep in src else f"perfmodel/machines/{src}.yaml"
    out = [
        f"perf model prediction ({src}; an estimate, not a measurement):",
        f"  step time        {_fmt_s(e.step_time_s)} = compute {_fmt_s(e.compute_s)} + exposed comm "
        f"{_fmt_s(e.exposed_comm_s)} (all comm {_fmt_s(e.comm_total_s)}: {comm})",
        f"  memory per GPU   {mem['total'] / GIB:.1f} GiB of {e.memory_limit_bytes / GIB:.1f} GiB usable ({parts} GiB)",
        f"  throughput       {e.tflops_per_gpu:.1f} TFLOP/s per GPU ({e.flops_per_step / 1e15:.2f} PFLOP per step)",
        *efficiency_lines(plan),
        f"  activation checkpointing {'on' if e.checkpointing else 'off'}",
    ]
    if plan.runners_up:
        out.append(
            "  runners-up        " + "; ".join(f"{r.grid.spec()} {_fmt_s(r.step_time_s)}" for r in plan.runners_up)
        )
    return out


def machine_device(machine: str) -> str:
    """The accelerator a machine file names (``device:``; '' when it gives its own ``gemm_tflops``)."""
    import yaml

    from perfmodel.machine import MachineError, resolve_machine_path

    try:
        data = yaml.safe_load(resolve_machine_path(machine).read_text())
    except (OSError, MachineError, yaml.YAMLError):
        return ""
    return str(data.get("device", "")) if isinstance(data, dict) else ""


def efficiency_lines(plan: JobPlan) -> list[str]:
    """MFU (model FLOPs) and HFU (with recomputation) against the vendor's dense bf16 peak, and the
    share of the measured GEMM ceiling beside it (:mod:`axo4d.facts.devices`; docs/design.md section 5)."""
    e, ceiling = plan.estimate, plan.machine.gemm_tflops
    peak, label = vendor_peak(machine_device(plan.request.machine))
    model = e.model_flops_per_step / e.step_time_s / e.gpus / 1e12 if e.step_time_s > 0 else 0.0
    share = f"{100 * e.peak_fraction:.1f}% of the measured bf16 GEMM ceiling {ceiling:g} TFLOP/s"
    if not peak:
        return [f"  efficiency       MFU/HFU n/a (no vendor peak for this machine's device); {share}"]
    return [
        f"  efficiency       MFU {100 * model / peak:.1f}% / HFU {100 * e.tflops_per_gpu / peak:.1f}% of the "
        f"vendor dense bf16 peak {peak:g} TFLOP/s ({label}); {share}"
    ]


def header(plan: JobPlan) -> str:
    """The comment block at the top of the script."""
    req, m, mc = plan.request, plan.machine, plan.model_cfg
    source = (
        f"best of {plan.n_feasible} feasible grids out of {plan.n_grids} (perfmodel.rank_grids)"
        if req.grid == "auto"
        else "given with --grid"
    )
    lines = [
        f"axo4d training job, generated by: {req.command or 'launch.job'}",
        f"machine   {m.name}: {req.nodes} node(s) x {m.gpus_per_node} GPUs = {plan.ntasks} ranks"
        + (f" ({m.description})" if m.description else ""),
        f"model     {req.model}: {mc.n_layer} layers, hidden {mc.n_embd}, {mc.n_head} heads, "
        f"sequence {mc.seq_len}, vocabulary {mc.vocab_size}; global batch {plan.global_batch}",
        f"grid      {plan.grid.spec()} (order {','.join(plan.grid.order)}; {source})",
    ]
    lines += prediction_lines(plan)
    lines += [f"WARNING: {w}" for w in plan.warnings]
    return "\n".join(("# " + x).rstrip() for x in lines)


def train_command(plan: JobPlan) -> str:
    """``python -m axo4d.train ...`` with line continuations for the ``--set`` options."""
    head = (
        f"python -m axo4d.train --config {shlex.quote(plan.config_arg)} "
        f"--grid {plan.grid.spec()} --out \"${{RUN_DIR}}\" --resume auto "
        f"--launcher {'slurm' if plan.request.launcher == 'slurm' else 'mpi'}"
    )
    sets = [f"--set {shlex.quote(s)}" for s in plan.sets]
    return " \\\n        ".join([head] + [" ".join(sets[i : i + 3]) for i in range(0, len(sets), 3)])


def _python_env() -> str:
    if (REPO_ROOT / "pyproject.toml").is_file():  # generated from a checkout: put it on the path
        path = (
            f'export PYTHONPATH={shlex.quote(str(REPO_ROOT))}"${{PYTHONPATH:+:${{PYTHONPATH}}}}"   # the axo4d checkout'
        )
    else:  # generated by an installed axo4d
        path = "# axo4d is installed in that environment (pip install axo4d): no PYTHONPATH needed"
    return "\n".join(
        [
            "# ---- Python (EDIT): an environment with PyTorch for this machine's GPUs -----------------",
            'if [ -n "${AXO4D_VENV:-}" ]; then source "${AXO4D_VENV}/bin/activate"; fi   # or activate it here',
            path,
            "export PYTHONUNBUFFERED=1                   # log lines appear as they are printed",
        ]
    )


def _job_vars(plan: JobPlan) -> str:
    lines = [
        f"NNODES={plan.request.nodes}                   # nodes of this job",
        f"GPUS_PER_NODE={plan.gpus_per_node}            # one rank per GPU",
        f"NTASKS={plan.ntasks}                  # ranks = grid size {plan.grid.spec()}",
    ]
    if plan.request.launcher == "slurm":
        lines.append(
            'export MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST}" '
            '| head -n 1)}"   # rank 0 host (torch.distributed rendezvous)'
        )
    lines.append('export MASTER_PORT="${MASTER_PORT:-29500}"')
    return "\n".join(lines)


def _run_dir(plan: JobPlan) -> str:
    req = plan.request
    if req.run_dir:
        default = req.run_dir
    elif req.launcher == "slurm":
        default = f"runs/{plan.job_name}-${{SLURM_JOB_ID:-manual}}"
    else:
        default = f"runs/{plan.job_name}-$(date +%Y%m%d-%H%M%S)"
    return f'RUN_DIR="${{RUN_DIR:-{default}}}"   # metrics.jsonl, config.yaml\nmkdir -p "${{RUN_DIR}}"'


def render(plan: JobPlan) -> str:
    """The complete job script for ``plan``."""
    req = plan.request
    env = template_path("env", plan.machine.name).read_text().rstrip("\n")
    tpl = (
        template_path("slurm", plan.machine.name) if req.launcher == "slurm" else TEMPLATE_DIR / "mpirun.sh"
    ).read_text()
    signal_s, signal_why = plan.signal
    kind = "slurm" if req.launcher == "slurm" else "mpirun"
    end = fill((TEMPLATE_DIR / "end" / f"{kind}.sh").read_text(), {"signal_s": str(signal_s), "signal_why": signal_why})
    trap_lines = traps("SRUN_PID" if kind == "slurm" else "MPIRUN_PID", ("USR1", "TERM", "INT"))
    values = {
        "header": header(plan) + f"\n# warning   USR1 {signal_s} s before the time limit ({signal_why})",
        "signal_s": str(signal_s),
        "job_end": end.rstrip("\n"),
        "job_name": plan.job_name,
        "account": req.account or "ACCOUNT",
        "nodes": str(req.nodes),
        "gpus_per_node": str(plan.gpus_per_node),
        "ntasks": str(plan.ntasks),
        "time": req.time,
        "python_env": _python_env(),
        "job_vars": _job_vars(plan),
        "env": env,
        "env_names": " ".join(exported_names(env)),
        "run_dir": _run_dir(plan) + "\n" + trap_lines,
        "train_cmd": train_command(plan),
    }
    text = fill(tpl, values)
    return text.replace(_EDIT_ACCOUNT, "") if req.account else text


def write_script(text: str, path: str | os.PathLike) -> Path:
    """Write ``text`` to ``path`` (parents created), executable."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    p.chmod(0o755)
    return p


# ---- command line -----------------------------------------------------------------------
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
    ap.add_argument("--run-dir", default=None, help="training output directory (default: runs/<job>-<id>)")
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override passed to the trainer, e.g. train.steps=50 (repeatable)",
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


if __name__ == "__main__":
    sys.exit(main())
