"""Failing loudly: a dead or hung rank stops the others; a non-finite loss stops, or skips up to
its caps; a diverged model is never saved.

The 8-rank cases start the ranks themselves (torchrun-style environment, like
``launch.local --mode env``) so that they know each rank's pid; then they SIGKILL
(dead rank) or SIGSTOP (hung rank) one rank once training runs, and require
every other rank to exit non-zero within 60 s with a message naming a rank, the
axis (group) and the collective -- the hang with default settings (``parallel.timeout_s``
30 s once training runs). A rank 0 that hangs at start-up makes every other rank print one
line and stop, under a torchrun-style start and under ``mpiexec``. The time to exit is printed.
Faults at named points (a checkpoint write, a resume, a data-parallel reduction):
``tests/dist/test_fault_points.py``.
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

import pytest

from axo4d.dist.net import free_port as _free_port
from tests.dist.harness import ROOT

N, LIMIT_S = 8, 60
OPS = r"(all_reduce|all_gather|reduce_scatter|broadcast_object|barrier)"


def _start(n: int, args: list[str], logs: Path, extra_env: dict | None = None) -> list[subprocess.Popen]:
    port, procs = _free_port(), []
    for r in range(n):
        env = dict(
            os.environ,
            RANK=str(r),
            WORLD_SIZE=str(n),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT),
            **(extra_env or {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-u", "-m", "axo4d.train", *args],
                cwd=ROOT,
                env=env,
                stdout=open(logs / f"out{r}.txt", "w"),
                stderr=open(logs / f"err{r}.txt", "w"),
                start_new_session=True,
            )
        )
    return procs


def _wait_training(procs: list[subprocess.Popen], metrics: Path, limit: float = 400) -> None:
    t0 = time.time()
    while time.time() - t0 < limit:
        if metrics.is_file() and metrics.read_text().strip():
            return
        dead = [r for r, p in enumerate(procs) if p.poll() is not None]
        if dead:
            pytest.fail(f"ranks {dead} exited before training started")
        time.sleep(0.5)
    pytest.fail(f"no metrics record within {limit}s")


def _wait_exit(procs: list[subprocess.Popen], victim: int, limit: float) -> dict[int, float]:
    t0, done = time.time(), {}
    while time.time() - t0 < limit and len(done) < len(procs) - 1:
        for r, p in enumerate(procs):
            if r != victim and r not in done and p.poll() is not None:
                done[r] = time.time() - t0
        time.sleep(0.1)
    return done


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _fault_case(tmp_path: Path, sig: signal.Signals, victim: int, sets: tuple[str, ...] = ()) -> None:
    out = tmp_path / "run"
    args = [
        "--config",
        "tiny",
        "--grid",
        "x=2,y=2,z=2",
        "--out",
        str(out),  # default timeouts (unless ``sets`` changes them)
        "--set",
        "train.steps=100000",
        "--set",
        "train.eval_interval=0",
        "--set",
        "checkpoint.at_end=false",
        *[a for kv in sets for a in ("--set", kv)],
    ]
    procs = _start(N, args, tmp_path)
    try:
        _wait_training(procs, out / "metrics.jsonl")
        os.kill(procs[victim].pid, sig)
        done = _wait_exit(procs, victim, LIMIT_S + 30)
    finally:
        _kill_all(procs)
    print(
        f"\n{sig.name} rank {victim}: others exited after "
        + ", ".join(f"r{r} {t:.1f}s" for r, t in sorted(done.items()))
    )
    missing = [r for r in range(N) if r != victim and r not in done]
    assert not missing, f"ranks {missing} still running {LIMIT_S + 30}s after {sig.name} of rank {victim}"
    assert max(done.values()) <= LIMIT_S, f"slowest rank exited after {max(done.values()):.1f}s"
    for r in done:
        err = (tmp_path / f"err{r}.txt").read_text()
        assert procs[r].returncode != 0, f"rank {r} exited 0"
        assert "Traceback" not in err, err[-2000:]
        m = re.search(rf"\[rank \d+\] (rank \d+: )?{OPS} over (axis [a-z+]+|world)", err)
        assert m, f"rank {r}: stderr does not name rank, operation and axis:\n{err[-1500:]}"
    r = min(done)
    print(f"e.g. rank {r}: " + (tmp_path / f"err{r}.txt").read_text().strip().splitlines()[-1][:300])


@pytest.mark.dist
@pytest.mark.parametrize("victim", [3, 0])
def test_killed_rank_stops_the_others(tmp_path: Path, victim: int) -> None:
    _fault_case(tmp_path, signal.SIGKILL, victim)


@pytest.mark.dist
def test_hung_rank_times_out(tmp_path: Path) -> None:
    """The others stop within parallel.timeout_s and some slack (10 s here; the default, 30 s, is
    the same code path with a longer wait)."""
    _fault_case(tmp_path, signal.SIGSTOP, 5, ("parallel.timeout_s=10",))


def _check_startup_lines(errs: dict[int, str]) -> None:
    for r, err in errs.items():
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("AXO4D_FAULT")]
        assert len(lines) == 1, f"rank {r}: expected one line, got:\n{err[-3000:]}"
        assert "error:" in lines[0] and f"[rank {r}] start-up" in lines[0] and "rank 0" in lines[0], lines[0]
        assert "frame #" not in err and "Traceback" not in err, err[-2000:]


@pytest.mark.dist
def test_rank0_hung_at_startup(tmp_path: Path) -> None:
    """Rank 0 stops before the process group exists: every other rank prints one line and exits."""
    args = [
        "--config",
        "tiny",
        "--grid",
        "data=3",
        "--set",
        "train.global_batch=6",
        "--out",
        str(tmp_path / "run"),
        "--set",
        "parallel.init_timeout_s=5",
    ]
    procs = _start(3, args, tmp_path, {"AXO4D_FAULT": "stop:start:0"})
    try:
        done = _wait_exit(procs, 0, 120)
    finally:
        _kill_all(procs)
    print("\nrank 0 hung at start-up: others exited after " + ", ".join(f"r{r} {t:.1f}s" for r, t in done.items()))
    assert sorted(done) == [1, 2], f"ranks still running: {sorted({1, 2} - set(done))}"
    assert all(procs[r].returncode != 0 for r in done)
    _check_startup_lines({r: (tmp_path / f"err{r}.txt").read_text() for r in done})


@pytest.mark.dist
def test_rank0_hung_at_startup_mpiexec(tmp_path: Path) -> None:
    """The same under mpiexec, where MPI_Init itself waits for rank 0 (holding the GIL)."""
    from launch.local import find_mpiexec, mpi_command, mpi_flavour

    mpiexec = find_mpiexec()
    if not mpiexec:
        pytest.skip("no mpiexec")
    cmd = [
        sys.executable,
        "-m",
        "axo4d.train",
        "--config",
        "tiny",
        "--grid",
        "data=3",
        "--set",
        "train.global_batch=6",
        "--out",
        str(tmp_path / "run"),
        "--set",
        "parallel.init_timeout_s=20",
        "--set",
        "data.cache_dir=" + str(tmp_path / "cache"),
    ]
    argv, env, _ = mpi_command(3, cmd, mpiexec, mpi_flavour(mpiexec))
    t0 = time.time()
    p = subprocess.run(
        argv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **env, "PYTHONPATH": str(ROOT), "AXO4D_FAULT": "stop:start:0"},
    )
    print(f"\nmpiexec: exit {p.returncode} after {time.time() - t0:.1f}s")
    assert p.returncode != 0
    ours = [ln for ln in p.stderr.splitlines() if "axo4d" in ln and "error:" in ln]
    assert sorted(re.findall(r"\[rank (\d)\] start-up", "\n".join(ours))) == ["1", "2"], p.stderr[-3000:]
    assert "frame #" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


def _single(args: list[str], env: dict) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    return subprocess.run(
        [sys.executable, "-m", "tests.nan_train", "--config", "tiny", *args],
        cwd=ROOT,
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_nonfinite_loss_stop_and_skip(tmp_path: Path) -> None:
    common = ["--set", "train.steps=4", "--set", "train.eval_interval=0"]
    stop = _single(
        common + ["--out", str(tmp_path / "stop"), "--set", "checkpoint.interval=1"], {"AXO4D_FAULT_NAN_AT_STEP": "2"}
    )
    assert stop.returncode == 1 and "Traceback" not in stop.stderr, stop.stderr
    assert "non-finite loss nan" in stop.stderr and "at step 2" in stop.stderr
    assert f"last checkpoint: {tmp_path / 'stop' / 'checkpoints' / 'step_000002'}" in stop.stderr, stop.stderr
    assert not (tmp_path / "stop" / "loss.png").exists()
    skip = _single(
        common + ["--out", str(tmp_path / "skip"), "--set", "train.nonfinite=skip"], {"AXO4D_FAULT_NAN_AT_STEP": "1"}
    )
    assert skip.returncode == 0, skip.stderr
    recs = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "loss" in r]
    assert [r["skipped"] for r in recs] == [False, True, False, False]
    assert all(r["loss"] == r["loss"] for i, r in enumerate(recs) if i != 1)  # finite after the skip
    assert "SKIPPED" in skip.stdout


def test_nonfinite_skip_caps_and_no_diverged_save(tmp_path: Path) -> None:
    """train.nonfinite=skip stops past train.nonfinite_max_consecutive / _total; a model whose
    validation loss is not finite is not saved (exit 1, no final checkpoint, no loss.png)."""
    base = [
        "--set",
        "train.steps=8",
        "--set",
        "train.eval_interval=0",
        "--set",
        "train.nonfinite=skip",
        "--set",
        "parallel.tuner=false",
    ]
    cases = [
        (
            "row",
            ["--set", "train.nonfinite_max_consecutive=3"],
            "2-7",
            ["at step 4: 3 steps skipped in a row", "train.nonfinite_max_consecutive=3"],
        ),
        (
            "total",
            ["--set", "train.nonfinite_max_consecutive=0", "--set", "train.nonfinite_max_total=2"],
            "1-2",
            ["at step 2: 2 steps skipped in this run", "train.nonfinite_max_total=2"],
        ),
        (
            "diverged",
            [
                "--set",
                "train.lr=1e30",
                "--set",
                "train.warmup_steps=0",
                "--set",
                "train.steps=3",
                "--set",
                "train.nonfinite_max_consecutive=0",
                "--set",
                "train.nonfinite_max_total=0",
            ],
            "",
            ["validation loss nan at step 2: the model diverged; not saving it"],
        ),
    ]
    for name, extra, nan_steps, expect in cases:
        p = _single(base + extra + ["--out", str(tmp_path / name)], {"AXO4D_FAULT_NAN_AT_STEP": nan_steps})
        assert p.returncode == 1 and "Traceback" not in p.stderr, (name, p.stderr[-2000:])
        errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
        assert len(errors) == 1, (name, p.stderr[-2000:])
        for s in expect:
            assert s in errors[0], (name, s, errors[0])
        assert not (tmp_path / name / "checkpoints").exists() and not (tmp_path / name / "loss.png").exists()
