"""A plain (non-editable) install carries everything the command lines read: named configs,
machine files and job templates. Installed into a fresh virtual environment, from outside the
checkout, ``launch.job`` generates a job script and ``axo4d.config`` finds its named configs."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_non_editable_install_generates_a_job(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # the dependencies (torch, yaml, numpy) come from this test's environment, without its
    # editable axo4d: a .pth line adds a path but runs none of that path's own .pth files
    (purelib / "deps.pth").write_text("\n".join([sysconfig.get_paths()["purelib"], *site.getsitepackages()]) + "\n")
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(".venv", ".git", "runs", "*.egg-info", "build", "__pycache__", ".pytest_cache"),
    )
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(src)], capture_output=True, text=True)
    if r.returncode != 0 and "No matching distribution" in r.stderr + r.stdout:
        pytest.skip("no package index to fetch the build backend (setuptools) from")
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.rmtree(src)  # nothing may still point into a checkout
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / "job.sh"
    r = subprocess.run(
        [
            str(py),
            "-m",
            "launch.job",
            "--machine",
            "perlmutter",
            "--model",
            "gpt-5b",
            "--nodes",
            "4",
            "--account",
            "X1",
            "--out",
            str(out),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert "#SBATCH" in text and "python -m axo4d.train --config gpt-5b" in text and "PYTHONPATH=" not in text
    where = subprocess.run(
        [
            str(py),
            "-c",
            "import axo4d, launch; from axo4d.config import load_config; "
            "print(axo4d.__file__, launch.__file__, load_config('tiny').model.n_layer)",
        ],
        cwd=work,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert str(purelib) in where and str(ROOT) not in where and where.split()[-1] == "2"
