"""Jobs that outlive their walltime (issue 22), on 4 CPU ranks (grid data=2,z=2: the optimizer
sharded over data, the weights over z), against one uninterrupted run of the same job:

* **requeue**: the generated Perlmutter script for one node (4 ranks) runs under a fake ``sbatch``/``srun``
  (:mod:`tests.fake_slurm`), which sends the ``--signal`` (USR1 to the batch shell) 0.3 s after
  training starts, twice; the script passes it to the ranks, they save and exit 75, the script
  requeues itself, and the third run finishes. Its losses equal the uninterrupted run's bit for bit.
* **a run stopped four ways and resumed**: (A) SIGTERM to ``launch.local``; (B) SIGUSR1 to one rank
  mid-training; (C) SIGUSR1 arriving while a background save writes; (D) a rank SIGKILLed while a
  background save writes; (E) ``--resume auto`` to the end. A-C end every rank with 75 within one
  step plus the save time, the save in flight completed first (C); D leaves the previous
  checkpoint intact and E resumes from it; E's losses equal the uninterrupted run's bit for bit.
  Periodic saves run in the background (``checkpoint.async: auto``), the saves on a signal and at
  the end synchronously: the runs resume from both kinds, and the losses show that neither kind
  changes training.
* **hangs** (4 ranks, ``parallel.timeout_s=3``): a rank SIGSTOPped in a z all-gather, and a rank
  that skips the step boundary's world all-reduce (``AXO4D_FAULT=skip:...``); every live rank
  writes ``OUT/traces/rank_K.json`` and the printed diagnosis names the rank, the group and the
  sequence number it stopped at.
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

from tests.dist.harness import ROOT
from tests.dist.test_failures import _kill_all, _start

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1500)]
N, GRID, STEPS = 4, "data=2,z=2", 12
SETS = ["train.steps=12", "train.eval_interval=0", "checkpoint.interval=3", "parallel.tuner=false"]


def _sets(cache: Path) -> list[str]:
    return [*SETS, f"data.cache_dir={cache}"]


def _args(out: Path, cache: Path, resume: bool, grid: str = GRID, sets: list[str] | None = None) -> list[str]:
    extra = [a for s in (sets if sets is not None else _sets(cache)) for a in ("--set", s)]
    return ["--config", "tiny", "--grid", grid, "--out", str(out), *extra, *(["--resume", "auto"] if resume else [])]


def _losses(out: Path) -> list[tuple[int, float]]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r]


def _wait_for_step(out: Path, procs: list, n_records: int, limit: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < limit:
        if (out / "metrics.jsonl").is_file() and len(_losses(out)) >= n_records:
            return
        if any(p.poll() is not None for p in procs):
            pytest.fail("a rank ended before training reached the point of the test")
        time.sleep(0.2)
    pytest.fail(f"training did not reach {n_records} records within {limit} s")


def _wait(procs: list, limit: float = 600) -> list[int]:
    try:
        for p in procs:
            p.wait(timeout=limit)
    finally:
        _kill_all(procs)
    return [p.returncode for p in procs]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT))


def _generated_script(tmp: Path, run_dir: Path) -> Path:
    from launch import job as J

    req = J.JobRequest("perlmutter", "tiny", 1, grid=GRID, sets=tuple(_sets(tmp / "cache")), run_dir=str(run_dir))
    script = J.write_script(J.render(J.plan_job(req)), tmp / "job.sbatch")
    subprocess.run([sys.executable, "-m", "tests.fake_slurm", "install", str(tmp / "bin")], check=True, cwd=ROOT)
    return script


def _sbatch(tmp: Path, script: Path, warn_after: str) -> tuple[int, list[dict], str]:
    env = dict(
        _env(),
        PATH=f"{tmp / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        FAKE_SLURM_WARN_AFTER=warn_after,
        FAKE_SLURM_DIR=str(tmp / "slurm"),
        AXO4D_NET_PLUGIN_CHECK="0",  # a Perlmutter job on this machine has no network plugin to find
    )
    p = subprocess.run(["sbatch", str(script)], cwd=tmp, env=env, capture_output=True, text=True, timeout=1200)
    runs = [json.loads(x) for x in (tmp / "slurm" / "runs.jsonl").read_text().splitlines()]
    out = next(tmp.glob("*.out")).read_text()
    return p.returncode, runs, out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, float]]:
    """The uninterrupted run: the generated script under the fake Slurm, no warning signal."""
    tmp = tmp_path_factory.mktemp("reference")
    rc, runs, out = _sbatch(tmp, _generated_script(tmp, tmp / "run"), "")
    assert rc == 0 and [r["rc"] for r in runs] == [0], out[-3000:]
    losses = _losses(tmp / "run")
    assert [s for s, _ in losses] == list(range(STEPS))
    return losses


def test_generated_perlmutter_script_requeues_itself_twice(reference, tmp_path: Path) -> None:
    run = tmp_path / "run"
    t0 = time.time()
    # right after each of the first two runs' first step line, whatever the host's speed: a warning
    # 0.3 s after it let the resumed run finish its last 6 steps first on a fast host (45 ms a step)
    rc, runs, out = _sbatch(tmp_path, _generated_script(tmp_path, run), "step1,step1")
    print(f"\nrequeue: {len(runs)} runs in {time.time() - t0:.0f} s: " + json.dumps(runs))
    assert rc == 0, out[-3000:]
    assert [(r["rc"], r["requeued"]) for r in runs] == [(75, True), (75, True), (0, False)], out[-3000:]
    assert out.count("axo4d job: training stopped cleanly (exit 75): requeueing job 4242") == 2
    assert "restart 2 of at most 50" in out and "axo4d job: training finished" in out
    assert len(re.findall(r"axo4d\.train: stopped by SIGUSR1 \(received by rank \d\) after step \d+", out)) == 2
    assert _losses(run) == reference, "the requeued run's losses differ from the uninterrupted run's"


def _stopped_line(err: str) -> re.Match:
    m = re.search(r"stopped by (SIG\w+) \(received by rank (\d)\) after step (\d+) of 12: checkpoint (\S+) \(", err)
    assert m, err[-3000:]
    return m


def _within_a_step_and_a_save(out: Path, elapsed: float, what: str) -> None:
    step = max(r["step_time_s"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()))
    saves = [json.loads((c / "COMPLETE").read_text())["save"]["seconds"] for c in (out / "checkpoints").glob("step_*")]
    bound = 2 * step + max(saves) + 20.0  # the step it was in, the save, and the exit of 8 processes on 2 cores
    print(f"{what}: every rank exited {elapsed:.1f} s after the signal (step {step:.2f} s, save {max(saves):.2f} s)")
    assert elapsed <= bound, f"{what}: {elapsed:.1f} s > {bound:.1f} s"


def test_stopped_four_ways_and_resumed(reference, tmp_path: Path) -> None:
    cache, out = tmp_path / "cache", tmp_path / "run"
    ck = out / "checkpoints"
    # A: SIGTERM to the launcher alone (it forwards it to every rank)
    logs = tmp_path / "A"
    logs.mkdir()
    cmd = [sys.executable, "-m", "launch.local", "-n", str(N), "--mode", "env", "--", "axo4d.train"]
    launcher = subprocess.Popen(
        cmd + _args(out, cache, False),
        cwd=ROOT,
        env=_env(),
        stdout=open(logs / "out.txt", "w"),
        stderr=open(logs / "err.txt", "w"),
    )
    _wait_for_step(out, [launcher], 1)
    t0 = time.time()
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=600) == 75, (logs / "err.txt").read_text()[-3000:]
    _within_a_step_and_a_save(out, time.time() - t0, "A (SIGTERM to launch.local)")
    m = _stopped_line((logs / "err.txt").read_text())
    assert m.group(1) == "SIGTERM" and Path(m.group(4)).name == f"step_{int(m.group(3)):06d}"
    assert (Path(m.group(4)) / "COMPLETE").is_file()

    # B: SIGUSR1 to one rank mid-training: every rank stops at the same step with 75
    logs = tmp_path / "B"
    logs.mkdir()
    n0 = len(_losses(out))
    procs = _start(N, _args(out, cache, True), logs)
    _wait_for_step(out, procs, n0 + 1)
    t0 = time.time()
    os.kill(procs[3].pid, signal.SIGUSR1)
    codes = _wait(procs)
    assert codes == [75] * N, (codes, (logs / "err0.txt").read_text()[-3000:])
    _within_a_step_and_a_save(out, time.time() - t0, "B (SIGUSR1 to rank 3)")
    m = _stopped_line((logs / "err0.txt").read_text())
    assert (m.group(1), m.group(2)) == ("SIGUSR1", "3"), m.group(0)
    b_step = int(m.group(3))

    # C: SIGUSR1 arrives while the background save writes (rank 3 sends it to itself there)
    logs = tmp_path / "C"
    logs.mkdir()
    procs = _start(N, _args(out, cache, True), logs, {"AXO4D_FAULT": "usr1:save:3:1"})
    codes = _wait(procs)
    err = (logs / "err0.txt").read_text()
    assert codes == [75] * N, (codes, err[-3000:])
    m = _stopped_line(err)
    saved = (b_step // 3 + 1) * 3  # the periodic save the signal came in
    assert int(m.group(3)) >= saved, m.group(0)
    assert (ck / f"step_{saved:06d}" / "COMPLETE").is_file(), "the save in flight was not completed"
    c_step = int(m.group(3))

    # D: a rank SIGKILLed while the background save writes: the others stop (1), the checkpoint
    # before stays intact, the partial one never counts
    logs = tmp_path / "D"
    logs.mkdir()
    procs = _start(N, _args(out, cache, True), logs, {"AXO4D_FAULT": "kill:save:1:1"})
    codes = _wait(procs)
    assert codes[1] == -9 and all(c == 1 for r, c in enumerate(codes) if r != 1), codes
    partial = (c_step // 3 + 1) * 3
    assert (ck / f".step_{partial:06d}.partial").is_dir() and not (ck / f"step_{partial:06d}").exists()
    v = subprocess.run(
        [sys.executable, "-m", "axo4d.checkpoint", "verify", str(ck / f"step_{c_step:06d}")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert v.returncode == 0 and "crc32 verified" in v.stdout, v.stderr

    # E: --resume auto from that checkpoint to the end: the losses of the uninterrupted run
    logs = tmp_path / "E"
    logs.mkdir()
    procs = _start(N, _args(out, cache, True), logs)
    codes = _wait(procs)
    assert codes == [0] * N, (codes, (logs / "err0.txt").read_text()[-3000:])
    assert f"resumed from {ck / f'step_{c_step:06d}'}" in (logs / "out0.txt").read_text()
    assert _losses(out) == reference, "losses after four stops differ from the uninterrupted run's"
    assert not list(ck.glob(".step_*.partial")), "a partial folder was left behind"


@pytest.mark.parametrize(
    "fault,behind,group,seq_re",
    [
        ("stop:all_gather:z:2:40", 2, "z", r"\d+"),  # SIGSTOPped: wrote no trace
        ("skip:all_reduce:world:1:3", 1, "world", r"\d+"),  # skipped the boundary's agreement
    ],
    ids=["sigstop", "skip"],
)
def test_a_hang_names_the_rank_behind(tmp_path: Path, fault: str, behind: int, group: str, seq_re: str) -> None:
    out = tmp_path / "run"
    sets = [*_sets(tmp_path / "cache"), "train.steps=200", "checkpoint.interval=0", "checkpoint.at_end=false"]
    sets.append("parallel.timeout_s=3")
    procs = _start(4, _args(out, tmp_path / "cache", False, "data=2,z=2", sets), tmp_path, {"AXO4D_FAULT": fault})
    need = 3 if fault.startswith("stop") else 4  # a stopped rank never ends by itself
    try:
        t0 = time.time()
        while time.time() - t0 < 600 and sum(p.poll() is not None for p in procs) < need:
            time.sleep(0.2)
    finally:
        _kill_all(procs)
    errs = {r: (tmp_path / f"err{r}.txt").read_text() for r in range(4)}
    diagnosis = [ln for e in errs.values() for ln in e.splitlines() if ln.startswith("axo4d: hang diagnosis: ")]
    print(f"\n{fault}:\n" + "\n".join(diagnosis[:2]))
    assert diagnosis, errs
    lead = re.search(rf"rank (\d) is behind on (\S+) at #({seq_re}):", diagnosis[0])
    assert lead and (int(lead.group(1)), lead.group(2)) == (behind, group), diagnosis[0]
    written = sorted(int(p.stem[5:]) for p in (out / "traces").glob("rank_*.json"))
    assert written == ([0, 1, 3] if fault.startswith("stop") else [0, 1, 2, 3]), written
    assert (out / "traces" / "summary.txt").read_text().startswith(diagnosis[0][len("axo4d: hang diagnosis: ") :])
    cli = subprocess.run(
        [sys.executable, "-m", "axo4d.trace", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert cli.returncode == 0 and f"rank {behind} is behind on {group} at #{lead.group(3)}" in cli.stdout, cli.stdout
    for r, e in errs.items():
        if r != behind or fault.startswith("skip"):
            assert "Traceback" not in e and re.search(rf"\[rank {r}\] collective trace ", e), (r, e[-2000:])


def test_bench_async_checkpoint_smoke() -> None:
    """The benchmark's smoke run (2 ranks, tiny model): it prints every figure (timing is for a quiet machine)."""
    p = subprocess.run(
        [sys.executable, "-m", "bench.async_checkpoint", "--smoke"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    for s in ("sync  saves: 1", "async saves: 1", "blocked async / sync:", "trace off", "step boundary agreement"):
        assert s in p.stdout, (s, p.stdout)
