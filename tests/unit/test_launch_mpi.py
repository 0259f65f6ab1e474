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
