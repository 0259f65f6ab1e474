"""Start N ranks on this machine.

    python -m launch.local -n 8 -- axo4d.train --config small --grid x=2,y=2,z=2

The first word after ``--`` is a module (run with ``python -m``) or a ``.py``
script. With ``--mode mpi`` (the default when an ``mpiexec`` is found next to
this Python or on PATH, or given with ``--mpiexec``) ranks start under ``mpiexec``;
with ``--mode env`` they are plain subprocesses given torchrun-style variables. In
either mode, when one rank fails the others are stopped and the exit status is
non-zero: the rank's own status (2 bad input, 1 run failure; docs/faults.md), or
128+N for a rank killed by signal N.

Open MPI's ``mpiexec`` refuses to run as root and to start more ranks than there
are cores; as root (a container, many GPU nodes) the launcher passes
``--allow-run-as-root`` (and sets ``OMPI_ALLOW_RUN_AS_ROOT=1``,
``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``), and ``--oversubscribe`` when ``-n`` exceeds the
cores, saying so on stderr. MPICH needs neither.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

from axo4d.dist.net import free_port as _free_port  # torch-free: the launcher never imports torch


def find_mpiexec() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


def _target(argv: list[str]) -> list[str]:
    if not argv:
        raise SystemExit("launch.local: nothing to run; usage: python -m launch.local -n N -- MODULE [ARGS]")
    if argv[0] == "-m":
        argv = argv[1:]
    if argv[0].endswith(".py"):
        return [sys.executable, "-u", *argv]
    return [sys.executable, "-u", "-m", *argv]


def mpi_flavour(mpiexec: str) -> str:
    """'openmpi', 'mpich' or 'unknown', from ``mpiexec --version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
        text = (out.stdout + out.stderr).lower()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if "open mpi" in text or "openrte" in text or "open-mpi" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text:
        return "mpich"
    return "unknown"


def mpi_command(
    n: int, cmd: list[str], mpiexec: str, flavour: str, euid: int | None = None, cores: int | None = None
) -> tuple[list[str], dict[str, str], list[str]]:
    """(argv, extra environment, notes) that start ``n`` ranks of ``cmd`` under ``mpiexec``."""
    euid = os.geteuid() if euid is None else euid
    cores = (os.cpu_count() or 1) if cores is None else cores
    argv, env, notes = [mpiexec, "-n", str(n)], {}, []
    if flavour == "openmpi":
        if euid == 0:
            argv.append("--allow-run-as-root")
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            notes.append("running as root under Open MPI: passing --allow-run-as-root")
        if n > cores:
            argv.append("--oversubscribe")
            notes.append(f"{n} ranks on {cores} cores under Open MPI: passing --oversubscribe")
    return argv + cmd, env, notes


def run_mpi(n: int, cmd: list[str], mpiexec: str) -> int:
    """Start ``n`` ranks under ``mpiexec``; its exit status (a signal ``-s`` as ``128 + s``)."""
    argv, env, notes = mpi_command(n, cmd, mpiexec, mpi_flavour(mpiexec))
    for note in notes:
        print(f"launch.local: {note}", file=sys.stderr, flush=True)
    code = subprocess.call(argv, env={**os.environ, **env})
    return 128 - code if code < 0 else code


def run_env(n: int, cmd: list[str], timeout: float | None = None) -> int:
    """Spawn ``n`` subprocesses with RANK/WORLD_SIZE/...; stop all when one fails."""
    port = _free_port()
    procs = []
    for r in range(n):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    return wait_all(procs, timeout)


def wait_all(procs: list[subprocess.Popen], timeout: float | None = None) -> int:
    """Wait for every rank; when one fails (or ``timeout`` passes: 124) stop the others.

    Returns the first non-zero exit status (a signal ``-s`` as ``128 + s``), else 0."""
    start, rc = time.time(), 0
    live = list(procs)
    try:
        while live:
            for p in list(live):
                code = p.poll()
                if code is None:
                    continue
                live.remove(p)
                if code != 0 and rc == 0:
                    rc = code if code > 0 else 128 - code
                    stop(live)
            if timeout is not None and time.time() - start > timeout:
                stop(live)
                return 124
            time.sleep(0.05)
    except KeyboardInterrupt:
        stop(live)
        return 130
    except BaseException:
        stop(live)
        raise
    return rc


def stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM each rank's process group, SIGKILL those still alive after ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(
        prog="python -m launch.local", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    ap.add_argument("--mode", choices=("auto", "mpi", "env"), default="auto")
    ap.add_argument("--mpiexec", default=None, help="the mpiexec to use (default: next to this Python, else on PATH)")
    args = ap.parse_args(argv)
    if args.nprocs < 1:
        ap.error(f"-n {args.nprocs}: need at least 1 rank")
    cmd = _target(rest)
    mpiexec = args.mpiexec or find_mpiexec()
    mode = args.mode if args.mode != "auto" else ("mpi" if mpiexec else "env")
    if mode == "mpi":
        if not mpiexec:
            print(
                "launch.local: --mode mpi but no mpiexec found; `pip install mpich` or use --mode env", file=sys.stderr
            )
            return 2
        return run_mpi(args.nprocs, cmd, mpiexec)
    return run_env(args.nprocs, cmd)


if __name__ == "__main__":
    sys.exit(main())
