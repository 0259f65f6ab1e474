"""A stand-in for Slurm's ``sbatch``, ``srun`` and ``scontrol`` that runs a generated job script on
this machine, for tests of the walltime signal and the requeue (``tests/dist/test_lifecycle.py``).

    python -m tests.fake_slurm install BINDIR         # writes BINDIR/{sbatch,srun,scontrol}
    sbatch JOB.sbatch                                 # runs the job here, requeues included

``sbatch`` runs the script with ``bash`` in the foreground (the script's output appended to
``%x-%j.out`` as ``--output`` and ``--open-mode=append`` ask), as job ``$FAKE_SLURM_JOB_ID``
(default 4242) with ``SLURM_RESTART_COUNT`` 0, 1, ...; when the script called ``scontrol requeue``
and asked for ``--requeue`` it runs it again. ``FAKE_SLURM_WARN_AFTER=T1,T2,...`` stands for the
time limit: in the k-th run the batch shell gets the ``--signal`` (``B:USR1``) ``Tk`` seconds
after the run printed its first ``step`` line (counted from there, not from the start, because
ranks start slowly on a loaded machine; later runs get none), or, written ``stepN``, as soon as
the run has printed ``N`` step lines (the same point of the run on a fast or a slow host). Each
run's exit status and warning time go to ``$FAKE_SLURM_DIR/runs.jsonl``. ``srun`` starts
``--ntasks`` copies of its command on this machine with Slurm's task variables and passes SIGUSR1,
SIGTERM and SIGINT on to them (the forwarding of :mod:`launch.local`); ``scontrol show hostnames``
prints 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

SHIM = '#!/bin/sh\nexec "{python}" -m tests.fake_slurm {name} "$@"\n'


def install(bindir: str) -> None:
    Path(bindir).mkdir(parents=True, exist_ok=True)
    for name in ("sbatch", "srun", "scontrol"):
        p = Path(bindir) / name
        p.write_text(SHIM.format(python=sys.executable, name=name))
        p.chmod(0o755)


def _directives(script: Path) -> dict[str, str]:
    out = {}
    for line in script.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S*))?", line)
        if m:
            out[m.group(1)] = m.group(2) or ""
    return out


def _steps(out: Path, offset: int) -> int:
    """Step lines the run printed after ``offset`` of ``out``."""
    try:
        with open(out, "rb") as f:
            f.seek(offset)
            return len(re.findall(rb"^step +\d+/", f.read(), re.M))
    except OSError:
        return 0


def _due(warn: str, out: Path, offset: int, t_train: float | None) -> bool:
    """Whether the run's warning is due: ``stepN`` after its ``N``-th step line, else ``warn``
    seconds after its first."""
    if warn.startswith("step"):
        return _steps(out, offset) >= int(warn[4:])
    return t_train is not None and time.time() - t_train >= float(warn)


def sbatch(args: list[str]) -> int:
    script = Path(args[-1]).resolve()
    d = _directives(script)
    job, name = os.environ.get("FAKE_SLURM_JOB_ID", "4242"), d.get("job-name", script.stem)
    state = Path(os.environ.get("FAKE_SLURM_DIR", script.parent / "fake_slurm"))
    state.mkdir(parents=True, exist_ok=True)
    out = script.parent / d.get("output", "slurm-%j.out").replace("%x", name).replace("%j", job)
    warns = [x.strip() for x in os.environ.get("FAKE_SLURM_WARN_AFTER", "").split(",") if x.strip()]
    sig = d.get("signal", "")
    restart = 0
    from axo4d.dist.net import free_port

    while True:
        env = dict(
            os.environ,
            SLURM_JOB_ID=job,
            SLURM_JOB_NAME=name,
            SLURM_JOB_NODELIST="localhost",
            SLURM_NNODES=d.get("nodes", "1"),
            SLURM_RESTART_COUNT=str(restart),
            FAKE_SLURM_DIR=str(state),
            MASTER_PORT=str(free_port()),
        )
        offset = out.stat().st_size if out.exists() else 0
        with open(out, "a") as log:
            p = subprocess.Popen(["bash", str(script)], cwd=script.parent, env=env, stdout=log, stderr=log)
        warn = warns[restart] if restart < len(warns) else None
        t_train, warned = None, None
        while p.poll() is None:
            if warn is not None and warned is None:
                if t_train is None and _steps(out, offset):
                    t_train = time.time()
                if _due(warn, out, offset, t_train):
                    sig_name = sig.split("@")[0].split(":")[-1] or "USR1"
                    os.kill(p.pid, getattr(signal, "SIG" + sig_name))  # B: the batch shell only
                    warned = time.time() - (t_train or time.time())
            time.sleep(0.02)
        rc = p.returncode
        requeued = (state / "requeue").exists()
        with open(state / "runs.jsonl", "a") as f:
            f.write(json.dumps({"restart": restart, "rc": rc, "warned_after_s": warned, "requeued": requeued}) + "\n")
        if requeued:
            (state / "requeue").unlink()
        if not (requeued and "requeue" in d):
            return rc
        restart += 1


def srun(args: list[str]) -> int:
    from launch.local import Forwarder, wait_all

    opts, i = {}, 0
    while i < len(args) and args[i].startswith("-"):
        k, _, v = args[i].lstrip("-").partition("=")
        opts[k] = v
        i += 1
    cmd, n = args[i:], int(opts.get("ntasks", "1"))
    with Forwarder() as fwd:
        for r in range(n):
            env = dict(
                os.environ,
                SLURM_PROCID=str(r),
                SLURM_NTASKS=str(n),
                SLURM_LOCALID=str(r),
                SLURM_NTASKS_PER_NODE=str(n),
                SLURM_STEP_NODELIST="localhost",
            )
            fwd.procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        return wait_all(fwd.procs)


def scontrol(args: list[str]) -> int:
    if args[:2] == ["show", "hostnames"]:
        print("127.0.0.1")
        return 0
    if args[:1] == ["requeue"]:
        state = Path(os.environ["FAKE_SLURM_DIR"])
        (state / "requeue").write_text(" ".join(args[1:]))
        return 0
    print(f"fake scontrol: {' '.join(args)} is not faked", file=sys.stderr)
    return 1


if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "install":
        install(rest[0])
        sys.exit(0)
    sys.exit({"sbatch": sbatch, "srun": srun, "scontrol": scontrol}[cmd](rest))
