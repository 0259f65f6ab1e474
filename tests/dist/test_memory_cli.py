"""The memory model through the command line: the start-up prediction beside the measured peak,
offload 'auto' under a budget, and runs that cannot fit stopping before anything is allocated or
written (one line, exit status 2, no output folder).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.harness import ROOT

TINY = ["--config", "tiny", "--set", "train.steps=2", "--set", "train.eval_interval=0", "--set", "parallel.tuner=false"]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _train(*args: str, ranks: int = 1) -> subprocess.CompletedProcess:
    head = (
        [sys.executable, "-m", "launch.local", "-n", str(ranks), "--mode", "env", "--"]
        if ranks > 1
        else [sys.executable, "-m"]
    )
    return subprocess.run(
        [*head, "axo4d.train", *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )


def _half_budget_gib(grid: str) -> float:
    """A device budget between the predictions with all optimizer state on the device and none."""
    from axo4d.config import load_config
    from axo4d.facts.grid import Grid
    from axo4d.facts.memory import memory
    from axo4d.training.memory_plan import run_setup

    cfg = load_config("tiny", ["train.offload=auto"], grid)
    spec, b, dt, setup = run_setup(cfg, Grid.parse(grid), gpu=False)
    lo, hi = (memory(spec, b, dt, dataclasses.replace(setup, device_fraction=f)).reserved() for f in (0.0, 1.0))
    return (lo + hi) / 2 / 2**30


@pytest.mark.dist
def test_prediction_and_measurement_printed_and_auto_offload_runs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = _train(
        *TINY,
        "--grid",
        "data=2",
        "--set",
        "train.offload=auto",
        "--set",
        f"train.memory_budget_gb={_half_budget_gib('data=2')!r}",
        "--out",
        str(out),
        ranks=2,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    pred = re.search(
        r"memory per rank \(predicted, axo4d.facts.memory\): device .* of .* \(train.memory_budget_gb\) "
        r"\[.*optimizer .*\]; host .*optimizer state (\d+)% on the device",
        p.stdout,
    )
    assert pred and 0 < int(pred.group(1)) < 100, p.stdout
    meas = re.search(
        r"memory per rank \(measured\): peak RSS .* \(predicted device \+ host .*, ratio ([\d.]+)\)", p.stdout
    )
    assert meas and 0.8 < float(meas.group(1)) < 1.5, p.stdout
    assert (out / "checkpoints" / "step_000002" / "COMPLETE").is_file()


@pytest.mark.dist
def test_runs_that_do_not_fit_stop_before_allocating(tmp_path: Path) -> None:
    cases = {
        "device": (
            ["--set", "train.memory_budget_gb=0.001"],
            r"the model does not fit the device: .* per rank predicted \(grid data=1,x=1,y=1,z=1, .* "
            r"parameters\) > 1.02 MiB budget \(train.memory_budget_gb\), over by .*; largest term: ",
        ),
        "host": (
            ["--set", "train.offload=optimizer", "--set", "train.host_memory_gb=0.0001"],
            r"offloaded optimizer state needs .* of host memory per rank > 0.102 MiB "
            r"\(train.host_memory_gb\), over by .*; fits with train.offload=auto",
        ),
    }
    for name, (sets, pattern) in cases.items():
        out = tmp_path / name
        p = _train(*TINY, *sets, "--out", str(out))
        lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn(" not in ln]
        assert p.returncode == 2, (name, p.returncode, p.stderr[-2000:])
        assert len(lines) == 1 and re.search(pattern, lines[0]), (name, lines)
        assert not out.exists(), f"{name}: the output folder was created although nothing could run"


@pytest.mark.dist
def test_capacity_benchmark_smoke() -> None:
    """bench.capacity on a tiny shape: the given candidates train under the cap, the table and the
    sharded / unsharded ratio of optimizer bytes per rank (data=2) are printed."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.capacity",
            "--modes",
            "axo4d,sharded",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--cap-mib",
            "64",
            "--host-mib",
            "64",
            "--timeout",
            "240",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert re.search(r"^axo4d\s+1\s+2\s+[\d.]+M", p.stdout, re.M) and re.search(
        r"^sharded\s+2\s+2\s", p.stdout, re.M
    ), p.stdout
    ratio = re.search(r"optimizer state per rank .* unsharded, .* sharded: ratio ([\d.]+)", p.stdout)
    assert ratio and 0.45 < float(ratio.group(1)) < 0.55, p.stdout
