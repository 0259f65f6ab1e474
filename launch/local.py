"""Start N ranks on this machine.

    python -m launch.local -n 8 -- axo4d.train --config small --grid x=2,y=2,z=2

The first word after ``--`` is a module (run with ``python -m``) or a ``.py``
script. With ``--mode mpi`` (the default when an ``mpiexec`` is found next to
this Python or on PATH, or given with ``--mpiexec``) ranks start under ``mpiexec``;
with ``--mode env`` they are plain subprocesses given torchrun-style variables. In
either mode, when one rank fails the others are stopped and the exit status is
non-zero: the rank's own status (2 bad input, 1 run failure; docs/faults.md), or
128+N for a rank killed by signal N (a rank killed by a signal is named before the ranks that
failed because it died). Ranks that stop cleanly on a signal (status 75, "resume me") are left
to finish.

Signals: SIGTERM, SIGUSR1, SIGUSR2, SIGHUP and SIGINT sent to the launcher are forwarded to every
rank (``--mode env``: to each rank's process; ``--mode mpi``: to ``mpiexec``, which forwards them,
started in a session of its own so that a terminal's Ctrl-C reaches the ranks once, through the
launcher). axo4d's ranks finish their step, save and exit 75 on SIGTERM, SIGUSR1 and a first
Ctrl-C, and stop at once on a second Ctrl-C; a third Ctrl-C makes the launcher stop the ranks.

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


#: signals the launcher forwards to the ranks (module docstring)
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGINT)
#: exit status of a rank that stopped cleanly on a signal (axo4d.exits.EXIT_RESUME)
RESUME_STATUS = 75


class Forwarder:
    """While installed, the signals of :data:`FORWARDED` go to ``procs`` (their pids) instead of
    ending the launcher; the third SIGINT stops them (:func:`stop`)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.ints = 0
        self._old: dict = {}

    def __enter__(self) -> Forwarder:
        for s in FORWARDED:
            self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, signum: int, frame) -> None:
        live = [p for p in self.procs if p.poll() is None]
        if signum == signal.SIGINT:
            self.ints += 1
            if self.ints >= 3:
                print("launch.local: third Ctrl-C: stopping the ranks", file=sys.stderr, flush=True)
                stop(live, grace_s=5.0)
                return
        for p in live:
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass
        name = signal.Signals(signum).name
        print(f"launch.local: {name} forwarded to {len(live)} process(es)", file=sys.stderr, flush=True)


def run_mpi(n: int, cmd: list[str], mpiexec: str, fwd: Forwarder | None = None) -> int:
    """Start ``n`` ranks under ``mpiexec``; its exit status (a signal ``-s`` as ``128 + s``)."""
    argv, env, notes = mpi_command(n, cmd, mpiexec, mpi_flavour(mpiexec))
    for note in notes:
        print(f"launch.local: {note}", file=sys.stderr, flush=True)
    p = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)
    if fwd is not None:
        fwd.procs.append(p)
    try:
        code = p.wait()
    except BaseException:
        stop([p])
        raise
    if fwd is not None and fwd.ints >= 2 and code not in (0, RESUME_STATUS):
        return 130  # a second Ctrl-C: mpiexec aborted the ranks at once, as asked
    return 128 - code if code < 0 else code


def run_env(n: int, cmd: list[str], timeout: float | None = None, fwd: Forwarder | None = None) -> int:
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
        if fwd is not None:
            fwd.procs.append(procs[-1])
    return wait_all(procs, timeout)


def _status(code: int) -> int:
    return code if code > 0 else 128 - code


def wait_all(procs: list[subprocess.Popen], timeout: float | None = None) -> int:
    """Wait for every rank; when one fails (or ``timeout`` passes: 124) stop the others.

    Returns the first non-zero exit status (a signal ``-s`` as ``128 + s``; of the ranks seen
    ending together, one killed by a signal first), else 0. Ranks ending with 75 (stopped
    cleanly, resume me) are not a failure the others are stopped for."""
    start, rc = time.time(), 0
    live = list(procs)
    try:
        while live:
            ended = [(p, p.poll()) for p in list(live)]
            ended = [(p, c) for p, c in ended if c is not None]
            for p, _ in ended:
                live.remove(p)
            failed = sorted((c for _, c in ended if c != 0), key=lambda c: (c > 0, 0))
            if failed and rc == 0:
                rc = _status(failed[0])
                if rc != RESUME_STATUS:
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
    if mode == "mpi" and not mpiexec:
        print("launch.local: --mode mpi but no mpiexec found; `pip install mpich` or use --mode env", file=sys.stderr)
        return 2
    with Forwarder() as fwd:
        if mode == "mpi":
            return run_mpi(args.nprocs, cmd, mpiexec, fwd)
        return run_env(args.nprocs, cmd, fwd=fwd)


if __name__ == "__main__":
    sys.exit(main())
