"""Rendering a planned job (:mod:`launch.job_plan`) into a script: the header with the perf
model's prediction, the safety preamble, the run folder on scratch and the training command."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from axo4d.facts.devices import vendor_peak
from launch.job_plan import JobError, JobPlan
from launch.walltime import traps

#: job templates ship inside the package (package data), so a plain ``pip install`` has them
TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
GIB = 2**30
_EDIT_ACCOUNT = "# (EDIT --account if it reads ACCOUNT, or regenerate with --account)\n"
#: each machine's scratch file system (the variable its site sets) and the folder under it; the
#: default home of a run folder (a checkpoint of an 8B model is ~96 GB)
SCRATCH = {"perlmutter": ("PSCRATCH", ""), "frontier": ("MEMBERWORK", "/{project}")}
DEFAULT_SCRATCH = ("SCRATCH", "")

# The first lines after the #SBATCH block: strict bash, and helpers that stop the job with one line.
PREAMBLE = r"""set -euo pipefail   # every failed command, unset variable or broken pipe stops the job
axo4d_fail() { echo "axo4d job: error: $*" >&2; exit 2; }
axo4d_module() {   # module load NAME, or one line saying what failed and exit 2
    command -v module >/dev/null 2>&1 ||
        axo4d_fail "no 'module' command in this shell: cannot load $1 (edit the software section)"
    local rc=0
    set +u
    { module load "$1" && module is-loaded "$1"; } >/dev/null 2>&1 || rc=$?
    set -u
    [ "${rc}" = 0 ] ||
        axo4d_fail "module load $1 failed: find the module's name with 'module spider $1' and edit this script"
}
axo4d_net_plugin() {   # $1 nccl|rccl: on more than one node the libfabric network plugin must be found
    [ "${NNODES}" -gt 1 ] && [ "${AXO4D_NET_PLUGIN_CHECK:-1}" != 0 ] || return 0
    if [ -n "${NCCL_NET_PLUGIN:-}" ] && [ -f "${NCCL_NET_PLUGIN}" ]; then return 0; fi
    local d f dirs
    IFS=: read -r -a dirs <<< "${LD_LIBRARY_PATH:-}"
    for d in "${dirs[@]}"; do
        for f in "${d}"/lib"$1"-net*.so* "${d}"/libnccl-net*.so*; do [ -e "${f}" ] && return 0; done
    done
    axo4d_fail "the $1 network plugin (lib$1-net*.so, aws-ofi-$1) is not on LD_LIBRARY_PATH, so" \
        "${1^^} would use TCP sockets between nodes: load it (software section) or set" \
        "NCCL_NET_PLUGIN=/path/to/lib$1-net.so; AXO4D_NET_PLUGIN_CHECK=0 runs without it"
}"""


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
        f"  activation checkpointing {'on' if e.checkpointing else 'off'}; z splits the {e.z_split}"
        + (f" ({e.z_split_note})" if e.z_split_note else ""),
    ]
    if plan.runners_up:
        out.append(
            "  runners-up        "
            + "; ".join(
                f"{r.grid.spec()}{' seq' if r.z_split == 'sequence' else ''} {_fmt_s(r.step_time_s)}"
                for r in plan.runners_up
            )
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


def run_plan_lines(plan: JobPlan) -> list[str]:
    """One line of the run's derived numbers on the grid (``plan.facts``: what ``axo4d.train``
    derives at start-up and writes to ``plan.yaml``); none when the trainer would refuse the grid."""
    f = plan.facts
    if f is None:
        return []
    fp8 = f"; FP8 GEMMs in {len(f.fp8_layers)} layers" if f.fp8_layers else ""
    return [
        f"run plan  micro-batch {f.micro_batch} x {f.grad_accum} accumulation step(s); z splits the {f.z_split}; "
        f"optimizer {f.optimizer}; largest gradient bucket {f.largest_bucket_bytes / 2**20:.0f} MiB{fp8}"
    ]


def header(plan: JobPlan) -> str:
    """The comment block at the top of the script."""
    req, m, mc = plan.request, plan.machine, plan.model_cfg
    source = (
        f"best of {plan.n_feasible} feasible grids out of {plan.n_grids} (perfmodel.rank_grids, as perfmodel rank)"
        if req.grid == "auto"
        else "given with --grid"
    )
    lines = [
        f"axo4d training job, generated by: {req.command or 'launch.job'}",
        f"machine   {m.name}: {req.nodes} node(s) x {m.gpus_per_node} GPUs = {plan.ntasks} ranks"
        + (f" ({m.description})" if m.description else ""),
        f"model     {req.model}: {mc.n_layer} layers, hidden {mc.n_embd}, {mc.n_head} heads, "
        f"sequence {mc.seq_len}, vocabulary {mc.vocab_size}; global batch {plan.global_batch}",
    ]
    if plan.init_arg:
        lines.append(f"init from {plan.init_arg} (weights; the model section from its config)")
    lines.append(f"grid      {plan.grid.spec()} (order {','.join(plan.grid.order)}; {source})")
    lines += run_plan_lines(plan)
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
    init = [f"--init-from {shlex.quote(plan.init_arg)}"] if plan.init_arg else []
    sets = [f"--set {shlex.quote(s)}" for s in plan.sets]
    return " \\\n        ".join([head] + init + [" ".join(sets[i : i + 3]) for i in range(0, len(sets), 3)])


def _python_env() -> str:
    return "\n".join(
        [
            "# ---- Python (EDIT): an environment with PyTorch for this machine's GPUs and axo4d installed",
            "# (pip install axo4d, or pip install -e /path/to/axo4d from a checkout) ------------------",
            'if [ -n "${AXO4D_VENV:-}" ]; then set +u; source "${AXO4D_VENV}/bin/activate"; set -u; fi  # or here',
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


def _checkpoint_gb(plan: JobPlan) -> float:
    from perfmodel.saves import checkpoint_bytes

    return checkpoint_bytes(plan.model_cfg) / 1e9


def _run_dir(plan: JobPlan) -> str:
    """``RUN_DIR``: ``--run-dir``, else ``--run-root``/NAME-ID, else the machine's scratch/axo4d/NAME-ID
    (a clear stop when the scratch variable is unset); ``RUN_DIR=...`` in the environment wins."""
    req = plan.request
    tag = "${SLURM_JOB_ID:-manual}" if req.launcher == "slurm" else "$(date +%Y%m%d-%H%M%S)"
    size = f"a checkpoint of this model is ~{_checkpoint_gb(plan):.3g} GB"
    if req.run_dir:
        return f'RUN_DIR="${{RUN_DIR:-{req.run_dir}}}"   # metrics.jsonl, config.yaml, checkpoints ({size})'
    if req.run_root:
        return f'RUN_DIR="${{RUN_DIR:-{req.run_root}/{plan.job_name}-{tag}}}"   # ({size})'
    var, sub = SCRATCH.get(plan.machine.name, DEFAULT_SCRATCH)
    project = (req.account or "").lower() or "${SLURM_JOB_ACCOUNT,,}"
    root = f"${{{var}}}" + sub.format(project=project)
    need = [var] + (["SLURM_JOB_ACCOUNT"] if "{project}" in sub and not req.account else [])
    checks = "\n".join(
        f'    [ -n "${{{v}:-}}" ] || axo4d_fail "\\${v} is not set, so the run folder on scratch is unknown: '
        f'set RUN_DIR=/a/folder/with/space ({size}) or regenerate with --run-root DIR"'
        for v in need
    )
    return "\n".join(
        [
            f"# the run folder (metrics.jsonl, config.yaml, checkpoints: {size}) on scratch, not in the",
            "# submit directory; RUN_DIR=... when submitting, or --run-dir/--run-root, put it elsewhere",
            'if [ -z "${RUN_DIR:-}" ]; then',
            checks,
            f'    RUN_DIR="{root}/axo4d/{plan.job_name}-{tag}"',
            "fi",
        ]
    )


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
        "preamble": PREAMBLE,
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
        "run_dir": _run_dir(plan) + '\nmkdir -p "${RUN_DIR}"\n' + trap_lines,
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
