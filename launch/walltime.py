"""The end of a job script: how early Slurm signals it before its time limit, and the traps that
pass the signal on to the ranks (:mod:`launch.job`; ``launch/templates/end/*.sh``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.3f} s"


def last_run_times(run_dir: str | None) -> tuple[float | None, float | None]:
    """(median step seconds, longest save seconds) of the run already in ``run_dir`` (its
    ``metrics.jsonl`` and its checkpoints' ``COMPLETE`` records), None where unknown."""
    if not run_dir or "$" in run_dir or not Path(run_dir).is_dir():
        return None, None
    steps, saves = [], []
    try:
        for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if "step_time_s" in rec:
                steps.append(float(rec["step_time_s"]))
    except (OSError, ValueError):
        pass
    for c in (Path(run_dir) / "checkpoints").glob("step_*/COMPLETE"):
        try:
            saves.append(float(json.loads(c.read_text())["save"]["seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
    step = sorted(steps)[len(steps) // 2] if steps else None
    return step, (max(saves) if saves else None)


def warning_time(model_cfg: Any, nodes: int, machine: Any, estimate: Any, run_dir: str | None) -> tuple[int, str]:
    """Seconds before the time limit the job is signalled (:func:`perfmodel.saves.warning_seconds`
    of the perf model's ``estimate`` and save time, or of the last run in ``run_dir``), and how."""
    from perfmodel.saves import save_seconds, warning_seconds

    step = estimate.step_time_s if estimate is not None and estimate.feasible else 0.0
    save = save_seconds(model_cfg, nodes, machine)
    src = f"perf model: step {_fmt_s(step)}, save {_fmt_s(save)} (perfmodel.saves)"
    m_step, m_save = last_run_times(run_dir)
    if m_save is not None or m_step is not None:
        step, save = m_step if m_step is not None else step, m_save if m_save is not None else save
        src = f"the last run in {run_dir}: step {_fmt_s(step)}, save {_fmt_s(save)}"
    return warning_seconds(step, save), f"{src}; 1.5 x (step + 2 saves + 30 s), at least 120 s"


def traps(pid_var: str, signals: tuple[str, ...]) -> str:
    """Bash traps, set before the launch, that pass each signal on to the launcher process
    ``$pid_var`` and mark the ``wait`` as interrupted (``launch/templates/end/*.sh``)."""
    return "\n".join(
        f"trap 'INTERRUPTED=1; echo \"axo4d job: SIG{s} (passed on to the ranks)\"; "
        f'kill -{s} "${{{pid_var}:-}}" 2>/dev/null || true\' {s}'
        for s in signals
    )


__all__ = ["last_run_times", "warning_time", "traps"]
