"""Fault injection at named points (``AXO4D_FAULT``, :mod:`axo4d.dist.faults`): a rank killed
during a checkpoint write, in rank 0's finalisation of a checkpoint, during a resume and during
a data-parallel reduction. One run folder goes through all of them, then a run resumes from what
is left and finishes cleanly:

A. ``kill:save:1:2``: rank 1 dies after writing its shards of the second checkpoint. The other
   rank stops at once (exit 1, the collective named); ``step_000001`` is intact (its checksums
   verify), the second save's ``.partial`` folder is ignored.
B. ``kill:load:1``: rank 1 dies while resuming: the other stops, and the run folder is exactly as
   it was (the folder is only touched after the resume has loaded).
C. ``kill:finalize:0``: rank 0 dies after writing ``COMPLETE`` but before the rename: the partial
   folder holds a COMPLETE marker yet never counts. The other rank stops naming the collective it
   was in: the save's own, or (the save runs in the background) the training step's next one.
D. ``kill:all_reduce:data:1:2``: rank 1 dies in a data-parallel gradient reduction: the other
   stops naming ``all_reduce over axis data``.
E. ``--resume auto`` continues from the newest complete checkpoint, saves, and leaves no partial
   folder; every step is recorded once in metrics.jsonl.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.harness import ROOT
from tests.dist.test_failures import _kill_all, _start


def _snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _launch(tmp: Path, tag: str, out: Path, steps: int, fault: str | None, resume: bool) -> dict[int, tuple]:
    """Start 2 ranks (grid data=2) and wait; {rank: (exit status, stderr)}."""
    logs = tmp / tag
    logs.mkdir()
    args = [
        "--config",
        "tiny",
        "--grid",
        "data=2",
        "--out",
        str(out),
        "--set",
        f"train.steps={steps}",
        "--set",
        "train.eval_interval=0",
        "--set",
        "checkpoint.interval=1",
        "--set",
        f"data.cache_dir={tmp / 'cache'}",
        *(["--resume", "auto"] if resume else []),
    ]
    procs = _start(2, args, logs, {"AXO4D_FAULT": fault} if fault else {})
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        _kill_all(procs)
    return {r: (p.returncode, (logs / f"err{r}.txt").read_text()) for r, p in enumerate(procs)}


def _survivor_failed(res: dict[int, tuple], victim: int, op: str) -> str:
    assert res[victim][0] == -9, f"the victim rank {victim} was not killed: {res[victim]}"
    rc, err = res[1 - victim]
    assert rc == 1, f"survivor exit {rc}:\n{err[-2000:]}"
    assert "Traceback" not in err, err[-2000:]
    assert re.search(rf"\[rank {1 - victim}\] .*{op}", err), f"survivor does not name {op!r}:\n{err[-2000:]}"
    return err.strip().splitlines()[-1]


@pytest.mark.dist
def test_faults_at_checkpoint_resume_and_reduction(tmp_path: Path) -> None:
    out, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    res = _launch(tmp_path, "A", out, 3, "kill:save:1:2", resume=False)
    print("\nA (kill in save): " + _survivor_failed(res, 1, "over world"))
    assert (ck / "step_000001" / "COMPLETE").is_file() and not (ck / "step_000002").exists()
    assert (ck / ".step_000002.partial").is_dir()
    v = subprocess.run(
        [sys.executable, "-m", "axo4d.checkpoint", "verify", str(ck / "step_000001")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert v.returncode == 0 and "crc32 verified" in v.stdout, v.stderr

    before = _snapshot(out)
    res = _launch(tmp_path, "B", out, 3, "kill:load:1", resume=True)
    print("B (kill in resume): " + _survivor_failed(res, 1, "checkpoint load collective|over world"))
    assert _snapshot(out) == before, "a run that died while resuming changed the run folder"

    res = _launch(tmp_path, "C", out, 3, "kill:finalize:0", resume=True)
    # the save is asynchronous: rank 1 meets rank 0's death either in the save's own collective or,
    # training on meanwhile, in the step's next reduction; which comes first is a race
    print("C (kill in finalize): " + _survivor_failed(res, 0, "broadcast_object over world|all_reduce over"))
    assert (ck / ".step_000002.partial" / "COMPLETE").is_file() and not (ck / "step_000002").exists()

    res = _launch(tmp_path, "D", out, 3, "kill:all_reduce:data:1:2", resume=True)
    print("D (kill in a data-parallel reduction): " + _survivor_failed(res, 1, "all_reduce over axis data"))

    res = _launch(tmp_path, "E", out, 3, None, resume=True)
    assert all(rc == 0 for rc, _ in res.values()), {r: e[-1500:] for r, (_, e) in res.items()}
    assert sorted(p.name for p in ck.iterdir()) == ["step_000002", "step_000003"], "partial folders left"
    steps = [
        json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines() if "loss" in json.loads(ln)
    ]
    assert steps == [0, 1, 2], steps
