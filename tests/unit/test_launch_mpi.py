"""``launch.local`` and the MPI it finds: Open MPI refuses root (and more ranks than cores) unless
told; the launcher notices (``mpiexec --version``), passes the opt-ins and says so. MPICH needs
nothing. The decisions are checked with fake ``mpiexec`` scripts that record how they were called.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.local import mpi_command, mpi_flavour

ROOT = Path(__file__).resolve().parents[2]
OPENMPI_4 = "mpiexec (OpenRTE) 4.1.5\n\nReport bugs to http://www.open-mpi.org/community/help/"
OPENMPI_5 = "mpiexec (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/"
MPICH = "HYDRA build details:\n    Version:                                 4.2.0"


def _fake_mpiexec(folder: Path, version_text: str) -> Path:
    """An mpiexec that prints ``version_text`` for --version, else records argv and OMPI_* variables."""
    exe = folder / "mpiexec"
    exe.write_text(f"""#!{sys.executable}
import json, os, sys
if sys.argv[1:] == ["--version"]:
    print({version_text!r})
    sys.exit(0)
with open({str(folder / "calls.jsonl")!r}, "a") as f:
    env = {{k: v for k, v in os.environ.items() if k.startswith("OMPI_")}}
    f.write(json.dumps({{"argv": sys.argv[1:], "env": env}}) + "\\n")
""")
    exe.chmod(0o755)
    return exe


@pytest.mark.parametrize(
    "text,flavour",
    [(OPENMPI_4, "openmpi"), (OPENMPI_5, "openmpi"), (MPICH, "mpich"), ("something else 1.0", "unknown")],
)
def test_flavour_from_version(tmp_path: Path, text: str, flavour: str) -> None:
    assert mpi_flavour(str(_fake_mpiexec(tmp_path, text))) == flavour
    assert mpi_flavour(str(tmp_path / "missing")) == "unknown"


def test_decisions() -> None:
    cmd = ["python", "-m", "axo4d.train"]
    argv, env, notes = mpi_command(8, cmd, "mpiexec", "openmpi", euid=0, cores=2)
    assert argv == ["mpiexec", "-n", "8", "--allow-run-as-root", "--oversubscribe", *cmd]
    assert env == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} and len(notes) == 2
    assert mpi_command(2, cmd, "mpiexec", "openmpi", euid=1000, cores=2) == (["mpiexec", "-n", "2", *cmd], {}, [])
    assert mpi_command(8, cmd, "mpiexec", "mpich", euid=0, cores=2) == (["mpiexec", "-n", "8", *cmd], {}, [])


@pytest.mark.skipif(os.geteuid() != 0, reason="the root case needs root")
def test_open_mpi_as_root_end_to_end(tmp_path: Path) -> None:
    """python -m launch.local as root with an Open MPI mpiexec: the opt-ins are passed and printed."""
    exe = _fake_mpiexec(tmp_path, OPENMPI_5)
    n = (os.cpu_count() or 1) + 1
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.local",
            "-n",
            str(n),
            "--mpiexec",
            str(exe),
            "--",
            "axo4d.train",
            "--config",
            "tiny",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    call = json.loads((tmp_path / "calls.jsonl").read_text().splitlines()[0])
    assert call["argv"][:5] == ["-n", str(n), "--allow-run-as-root", "--oversubscribe", sys.executable]
    assert call["env"] == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    assert "launch.local: running as root under Open MPI: passing --allow-run-as-root" in p.stderr
    assert "passing --oversubscribe" in p.stderr
    (tmp_path / "m").mkdir()
    mpich = _fake_mpiexec(tmp_path / "m", MPICH)
    p = subprocess.run(
        [sys.executable, "-m", "launch.local", "-n", "2", "--mpiexec", str(mpich), "--", "x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and "launch.local:" not in p.stderr, p.stderr
    assert json.loads((tmp_path / "m" / "calls.jsonl").read_text())["argv"][:2] == ["-n", "2"]


def _rank(folder: Path, rank: int, code: str) -> subprocess.Popen:
    """A process registered as rank ``rank`` (axo4d.dist.rankfiles) that waits on stdin, then runs ``code``."""
    src = f"import os, sys\nfrom axo4d.dist import rankfiles\nrankfiles.register()\nsys.stdin.read()\n{code}\n"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PMI_RANK=str(rank), AXO4D_RANK_FILES=str(folder))
    return subprocess.Popen([sys.executable, "-c", src], env=env, stdin=subprocess.PIPE)


def _watched(tmp_path: Path, codes: list[str], order: list[int]):
    """Start one process per entry of ``codes``, end them one by one in ``order`` (closing stdin,
    or SIGKILL for ``"kill"``), and return the :class:`launch.local.RankWatch` that watched them."""
    from launch.local import RankWatch

    tmp_path.mkdir(exist_ok=True)
    procs = [_rank(tmp_path, r, "" if c == "kill" else c) for r, c in enumerate(codes)]
    watch = RankWatch(len(procs), str(tmp_path))
    while len(watch.pids) < len(procs):
        watch.wait(0.05)
    for r in order:
        if codes[r] == "kill":
            procs[r].kill()
        else:
            procs[r].stdin.close()
        procs[r].wait()
        watch.wait(5.0)  # wakes as the process ends
    watch.close()
    assert watch.pids == {r: p.pid for r, p in enumerate(procs)}
    return watch


def test_rank_watch_names_the_killed_rank(tmp_path: Path) -> None:
    """The rank killed first is named (not one killed after it); ranks that end by themselves --
    sys.exit, a normal end, os._exit after axo4d's record -- are not."""
    codes = ["sys.exit(0)", "kill", "pass", "rankfiles.record_exit(1); os._exit(1)", "kill"]
    watch = _watched(tmp_path, codes, [0, 2, 1, 4, 3])
    assert [r for r, _ in watch.killed] == [1] and watch.status is None


def test_rank_watch_no_false_report(tmp_path: Path) -> None:
    """A rank that failed by itself (status 1) before the others were killed names nobody: the
    launcher killed them because of it; a clean end names nobody either."""
    assert _watched(tmp_path / "a", ["rankfiles.record_exit(1); os._exit(1)", "kill"], [0, 1]).killed == []
    assert _watched(tmp_path / "b", ["pass", "sys.exit(75)"], [1, 0]).killed == []


def test_rank_watch_keeps_the_failing_ranks_status(tmp_path: Path) -> None:
    """A rank that failed by itself with status 2 (bad input) before the others were killed: its 2 is
    the status the launcher returns (MPICH's ``mpiexec`` can return the 9 of the kills instead)."""
    codes = ["kill", "rankfiles.record_exit(2); os._exit(2)", "kill"]
    watch = _watched(tmp_path, codes, [1, 0, 2])
    assert watch.status == 2 and watch.killed == []
