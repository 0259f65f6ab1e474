"""Failing loudly: a dead or hung rank stops the others; a non-finite loss stops or skips.

The 8-rank cases start the ranks themselves (torchrun-style environment, like
``launch.local --mode env``) so that they know each rank's pid; then they SIGKILL
(dead rank) or SIGSTOP (hung rank) one rank once training runs, and require
every other rank to exit non-zero within 60 s with a message naming a rank, the
axis (group) and the collective. The time to exit is printed.
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

from axo4d.dist.bootstrap import _free_port
from tests.dist.harness import ROOT

N, TIMEOUT_S, LIMIT_S = 8, 20, 60
OPS = r"(all_reduce|all_gather|reduce_scatter|broadcast_object|barrier)"


def _start(n: int, args: list[str], logs: Path) -> list[subprocess.Popen]:
    port, procs = _free_port(), []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, "-u", "-m", "axo4d.train", *args], cwd=ROOT, env=env,
                                      stdout=open(logs / f"out{r}.txt", "w"),
                                      stderr=open(logs / f"err{r}.txt", "w"), start_new_session=True))
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


def _fault_case(tmp_path: Path, sig: signal.Signals, victim: int) -> None:
    out = tmp_path / "run"
    args = ["--config", "tiny", "--grid", "x=2,y=2,z=2", "--out", str(out), "--set", f"parallel.timeout_s={TIMEOUT_S}",
            "--set", "train.steps=100000", "--set", "train.eval_interval=0", "--set", "checkpoint.at_end=false"]
    procs = _start(N, args, tmp_path)
    try:
        _wait_training(procs, out / "metrics.jsonl")
        os.kill(procs[victim].pid, sig)
        done = _wait_exit(procs, victim, LIMIT_S + 30)
    finally:
        _kill_all(procs)
    print(f"\n{sig.name} rank {victim}: others exited after " +
          ", ".join(f"r{r} {t:.1f}s" for r, t in sorted(done.items())))
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
    _fault_case(tmp_path, signal.SIGSTOP, 5)


def _single(args: list[str], env: dict) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "axo4d.train", "--config", "tiny", *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=300)


def test_nonfinite_loss_stop_and_skip(tmp_path: Path) -> None:
    common = ["--set", "train.steps=4", "--set", "train.eval_interval=0"]
    stop = _single(common + ["--out", str(tmp_path / "stop"), "--set", "checkpoint.interval=1"],
                   {"AXO4D_FAULT_NAN_AT_STEP": "2"})
    assert stop.returncode == 1 and "Traceback" not in stop.stderr, stop.stderr
    assert "non-finite loss nan" in stop.stderr and "at step 2" in stop.stderr
    assert f"last checkpoint: {tmp_path / 'stop' / 'checkpoints' / 'step_000002'}" in stop.stderr, stop.stderr
    assert not (tmp_path / "stop" / "loss.png").exists()
    skip = _single(common + ["--out", str(tmp_path / "skip"), "--set", "train.nonfinite=skip"],
                   {"AXO4D_FAULT_NAN_AT_STEP": "1"})
    assert skip.returncode == 0, skip.stderr
    recs = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "loss" in r]
    assert [r["skipped"] for r in recs] == [False, True, False, False]
    assert all(r["loss"] == r["loss"] for i, r in enumerate(recs) if i != 1)   # finite after the skip
    assert "SKIPPED" in skip.stdout
