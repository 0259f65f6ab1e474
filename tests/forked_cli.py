"""Many command lines from one process that imported them once, each run in a forked child.

``python -m axo4d.train`` spends about three CPU-seconds importing torch and the package before it
reads its first argument, so a catalogue of inputs that are rejected in milliseconds spent nearly
all its time importing. This runner imports the commands' modules once, then forks a child per
job that runs the module exactly as ``python -m`` would (``runpy`` as ``__main__``, ``sys.argv``
set, its own working folder, stdout and stderr to files) and takes the child's exit status. Only
the import is shared: every job parses, checks and fails (or runs) in its own process, and a job
whose environment differs from the runner's (``PYTHONPATH``, variables read at import) must be
run as a real subprocess instead.

From a test: :func:`run_many`. ``python -m tests.forked_cli JOBS.json RESULTS.json``: ``JOBS`` is
a list of ``{"module", "argv", "cwd", "stdout", "stderr", "timeout"}``; ``RESULTS`` gets
``{"rc", "s"}`` per job (``rc`` is ``"timeout"`` for a child killed at its limit). At most
:data:`AT_ONCE` children run at a time.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback

AT_ONCE = 2  # CI's cores


def _child(job: dict) -> None:
    """Run one job in this (forked) process and end it with the job's exit status."""
    code = 1
    try:
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.chdir(job["cwd"])
        sys.argv = [job["module"], *job["argv"]]
        sys.modules.pop(job["module"], None)  # run afresh as __main__ (its imports stay shared)
        runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_jobs(jobs: list[dict]) -> list[dict]:
    """Every job's exit status and wall time (see the module docstring)."""
    for mod in sorted({j["module"] for j in jobs}):
        importlib.import_module(mod)
    results: list[dict | None] = [None] * len(jobs)
    running: dict[int, tuple[int, float]] = {}  # pid -> (job index, start)
    todo = list(range(len(jobs)))
    while todo or running:
        while todo and len(running) < AT_ONCE:
            i = todo.pop(0)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(jobs[i])
            running[pid] = (i, time.time())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.time()
            for p, (i, t0) in list(running.items()):
                if now - t0 > jobs[i]["timeout"]:
                    os.kill(p, signal.SIGKILL)
                    os.waitpid(p, 0)
                    results[i] = {"rc": "timeout", "s": now - t0}
                    del running[p]
            time.sleep(0.01)
            continue
        i, t0 = running.pop(pid)
        rc = os.waitstatus_to_exitcode(status)
        results[i] = {"rc": rc, "s": time.time() - t0}
    return [r for r in results if r is not None]


def run_many(commands: list[list[str]], folder, timeout: float = 300.0) -> list[dict]:
    """From a test: each ``[module, *argv]`` of ``commands`` run by this runner (one subprocess
    for them all, in the test's environment with the repository on ``PYTHONPATH``, working folder
    the repository); ``{"rc", "s", "stdout", "stderr"}`` per command. ``folder``: for the logs."""
    import subprocess
    from pathlib import Path

    root, folder = Path(__file__).resolve().parents[1], Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [
        {
            "module": cmd[0],
            "argv": cmd[1:],
            "cwd": str(root),
            "timeout": timeout,
            **{k: str(folder / f"job{i}.{k}") for k in ("stdout", "stderr")},
        }
        for i, cmd in enumerate(commands)
    ]
    (folder / "jobs.json").write_text(json.dumps(jobs))
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runner = [sys.executable, "-m", "tests.forked_cli", str(folder / "jobs.json"), str(folder / "results.json")]
    subprocess.run(runner, cwd=root, env=env, check=True, timeout=timeout * len(jobs) + 60)
    res = json.loads((folder / "results.json").read_text())
    return [
        {**r, **{k: Path(j[k]).read_text(errors="replace") for k in ("stdout", "stderr")}} for j, r in zip(jobs, res)
    ]


def main(argv: list[str]) -> int:
    jobs = json.loads(open(argv[0]).read())
    with open(argv[1], "w") as f:
        json.dump(run_jobs(jobs), f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
