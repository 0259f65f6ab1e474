"""Start N ranks on this machine.

    python -m launch.local -n 8 -- axo4d.train --config small --grid x=2,y=2,z=2

The first word after ``--`` is a module (run with ``python -m``) or a ``.py``
script. With ``--mode mpi`` (the default when an ``mpiexec`` is found next to
this Python or on PATH, or given with ``--mpiexec``) ranks start under ``mpiexec``;
with ``--mode env`` they are plain subprocesses given torchrun-style variables. In
either mode, when one rank fails the others are stopped and the exit status is
non-zero: the rank's own status (2 bad input, 1 run failure; docs/faults.md), or
128+N for a rank killed by signal N, named on one line (``launch.local: rank 3 (pid 1234) was
killed by SIGKILL; ...``; a rank killed by a signal is named before the ranks that failed because
it died). Ranks that stop cleanly on a signal (status 75, "resume me") are left to finish. Under
``mpiexec`` the ranks are not the launcher's children: axo4d's command lines register their pids
and exit statuses in a folder the launcher passes (:mod:`axo4d.dist.rankfiles`), and the launcher
names the first rank that ended without one.

Signals: SIGTERM, SIGUSR1, SIGUSR2, SIGHUP and SIGINT sent to the launcher are forwarded to every
rank (``--mode env``: to each rank's process; ``--mode mpi``: to each rank once all have
registered, before that to ``mpiexec``, which forwards them; ``mpiexec`` starts in a session of its
own so that a terminal's Ctrl-C reaches the ranks once, through the launcher, and never reaches
MPICH's Hydra, which answers a second one by killing the ranks). axo4d's ranks finish their step,
save and exit 75 on SIGTERM, SIGUSR1, SIGHUP and a first Ctrl-C, and stop at once on a second
Ctrl-C (130); a third Ctrl-C makes the launcher stop the ranks.

Open MPI's ``mpiexec`` refuses to run as root and to start more ranks than there
are cores; as root (a container, many GPU nodes) the launcher passes
``--allow-run-as-root`` (and sets ``OMPI_ALLOW_RUN_AS_ROOT=1``,
``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``), and ``--oversubscribe`` when ``-n`` exceeds the
cores, saying so on stderr. MPICH needs neither.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from axo4d.dist import rankfiles
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
        #: mpi mode: once every rank registered its pid, signals go to the ranks themselves, not
        #: through ``mpiexec`` (MPICH's Hydra answers a second SIGINT by killing the ranks with
        #: eight lines of its internals and status 255, before the ranks can say a word)
        self.watch: RankWatch | None = None

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
        pids = [p.pid for p in live]
        ranks = self.watch.current_pids() if self.watch is not None else {}
        if self.watch is not None and len(ranks) == self.watch.n:
            # the ranks themselves, those still running; none left: mpiexec is ending (a signal
            # to it now would only print Hydra's internals)
            pids = [pid for pid in ranks.values() if pid_alive(pid)]
        for pid in pids:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        name = signal.Signals(signum).name
        print(f"launch.local: {name} forwarded to {len(pids)} process(es)", file=sys.stderr, flush=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (it may belong to another user: then it runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RankWatch:
    """The ranks under ``mpiexec``, which are not the launcher's children: each registers its pid in
    ``folder`` (:mod:`axo4d.dist.rankfiles`); the watch holds a pidfd per rank and notes the first
    ranks whose process ended without writing an exit status (killed by a signal) -- unless a rank
    had failed by itself before (the launcher then killed the others: they are not the cause)."""

    def __init__(self, n: int, folder: str) -> None:
        self.n, self.folder = n, folder
        self.pids: dict[int, int] = {}
        self._fds: dict[int, int] = {}  # pidfd -> rank
        self.killed: list[tuple[int, int]] = []  # (rank, pid): the first seen killed, together
        self._failed = False  # a rank ended by itself with a failure status before any was killed
        self.status: int | None = None  # that rank's own status (the first seen)

    def current_pids(self) -> dict[int, int]:
        """``rank -> pid`` of every rank registered so far, read afresh (a signal handler's view:
        the registration of :meth:`wait` happens once a second; nothing here changes the watch)."""
        found = {r: rankfiles.read_pid(self.folder, r) for r in range(self.n) if r not in self.pids}
        return {**self.pids, **{r: pid for r, pid in found.items() if pid is not None}}

    def wait(self, timeout_s: float, extra_fd: int | None = None) -> None:
        """Register newly started ranks, then wait up to ``timeout_s`` for a rank (or ``extra_fd``)
        to end."""
        ended = []
        for r in range(self.n):
            if r not in self.pids and (pid := rankfiles.read_pid(self.folder, r)) is not None:
                self.pids[r] = pid
                try:
                    self._fds[os.pidfd_open(pid)] = r
                except ProcessLookupError:
                    ended.append(r)
        poller = select.poll()
        for fd in [*self._fds, *([] if extra_fd is None else [extra_fd])]:
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(timeout_s * 1000):
            if fd in self._fds:
                os.close(fd)
                ended.append(self._fds.pop(fd))
        self._note(ended)

    def _note(self, ended: list[int]) -> None:
        """Ranks seen ending in the same instant."""
        if self.killed or self._failed or not ended:
            return
        status = {r: rankfiles.exit_status(self.folder, r) for r in ended}
        failing = [s for r, s in sorted(status.items()) if s not in (None, "0", "-", str(RESUME_STATUS))]
        self._failed = bool(failing)
        if failing and failing[0].lstrip("-").isdigit():
            self.status = int(failing[0])
        if not self._failed:
            self.killed = [(r, self.pids[r]) for r in ended if status[r] is None]

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def _wait_mpi(p: subprocess.Popen, watch: RankWatch | None) -> int:
    """``p.wait()``, watching the ranks meanwhile (a pidfd on ``p`` too: no polling delay)."""
    if watch is None:
        return p.wait()
    own = os.pidfd_open(p.pid)
    try:
        while p.poll() is None:  # every 50 ms until all ranks registered: one killed soon after
            watch.wait(1.0 if len(watch.pids) == watch.n else 0.05, own)  # registering is still named
        watch.wait(0.0)
    finally:
        os.close(own)
        watch.close()
    return p.returncode


def _killed_line(watch: RankWatch | None, code: int) -> int:
    """Name the first rank killed by a signal, if one was, and return the launcher's status: MPICH's
    ``mpiexec`` exits with the signal's number (9) for a killed rank; 128+N as in ``--mode env``."""
    if watch is None or not watch.killed or code in (0, RESUME_STATUS):
        return code
    sig = code if 0 < code < signal.NSIG else None
    who = ", ".join(f"rank {r} (pid {pid})" for r, pid in watch.killed)
    how = f"killed by {_signame(sig)}" if sig else "ended without an exit status (killed by a signal)"
    how = f"was {how}" if len(watch.killed) == 1 else f"were {how} (seen ending together)"
    print(f"launch.local: {who} {how}; the other ranks stopped", file=sys.stderr, flush=True)
    return 128 + sig if sig else code


def run_mpi(n: int, cmd: list[str], mpiexec: str, fwd: Forwarder | None = None) -> int:
    """Start ``n`` ranks under ``mpiexec``; its exit status (a signal ``-s`` as ``128 + s``; a rank
    killed by signal N as ``128 + N``, named on one line)."""
    argv, env, notes = mpi_command(n, cmd, mpiexec, mpi_flavour(mpiexec))
    for note in notes:
        print(f"launch.local: {note}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="axo4d-ranks-") as folder:
        env[rankfiles.ENV] = folder
        p = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)
        if fwd is not None:
            fwd.procs.append(p)
        watch = RankWatch(n, folder) if hasattr(os, "pidfd_open") else None
        if fwd is not None:
            fwd.watch = watch
        try:
            code = _wait_mpi(p, watch)
        except BaseException:
            stop([p])
            raise
        if fwd is not None and fwd.ints >= 2 and code not in (0, RESUME_STATUS):
            return 130  # a second Ctrl-C: mpiexec aborted the ranks at once, as asked
        if code < 0:
            return 128 - code
        if watch is not None and watch.status is not None and code not in (0, RESUME_STATUS):
            return watch.status  # the failing rank's own (MPICH may report the others' SIGKILL: 9)
        return _killed_line(watch, code)


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


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


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
            failed = sorted(((p, c) for p, c in ended if c != 0), key=lambda pc: (pc[1] > 0, 0))
            if failed and rc == 0:
                p, c = failed[0]
                rc = _status(c)
                if c < 0:
                    who = f"rank {procs.index(p)} (pid {p.pid}) was killed by {_signame(-c)}"
                    print(f"launch.local: {who}; stopping the other ranks", file=sys.stderr, flush=True)
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
