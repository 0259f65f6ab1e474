"""A full disk: found before training (one line, exit 2, nothing written), before each save and
during a save (exit 1, the message says the disk is full, the partial folder removed, no stray
probe file), after which ``--resume auto`` works without cleaning up by hand.

Real full disks are small tmpfs mounts (needs root, as CI runs; skipped where mounting is
impossible). The same paths also run without a mount: a full disk injected into a save
(``AXO4D_FAULT=enospc:save:0``) and the free-space check with a patched ``free_bytes``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = ["--config", "tiny", "--set", "train.eval_interval=0", "--set", "parallel.tuner=false"]
#: runs the real command line with the free-space checks switched off: the save meets the full disk itself
NO_PRECHECK = (
    "import sys, axo4d.training.checkpointing.integrity as i; i.space_problem = lambda *a: None; "
    "from axo4d.train import main; sys.exit(main(sys.argv[1:]))"
)


def _train(args: list[str], cache: Path, env: dict | None = None, precheck: bool = True) -> subprocess.CompletedProcess:
    head = ["-m", "axo4d.train"] if precheck else ["-c", NO_PRECHECK]
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run(
        [sys.executable, *head, *RUN, "--set", f"data.cache_dir={cache}", *args],
        cwd=ROOT,
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _one_error(p: subprocess.CompletedProcess, code: int, *expect: str) -> str:
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr and "(None)" not in p.stderr, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, p.stderr[-2000:]
    for s in expect:
        assert s in errors[0], (s, errors[0])
    return errors[0]


def _leftovers(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.name.endswith((".partial", ".write-test")))


@pytest.fixture
def tmpfs(tmp_path: Path):
    """A 3 MiB tmpfs (one tiny checkpoint of 1.8 MiB fits, a second does not)."""
    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_disk_on_a_real_file_system(tmpfs: Path, tmp_path: Path) -> None:
    cache, out = tmp_path / "cache", tmpfs / "run"
    # 1. before training: one checkpoint does not fit in what is left -> exit 2, nothing written
    filler = tmpfs / "filler"
    filler.write_bytes(b"\0" * (2 << 20))
    print(
        "\n"
        + _one_error(_train(["--out", str(out), "--set", "train.steps=1"], cache), 2, "not enough disk space", "free")
    )
    assert not out.exists(), "a run rejected for disk space touched --out"
    filler.unlink()
    # 2. the first checkpoint fits; before the second save the check finds too little space -> exit 1
    p = _train(["--out", str(out), "--set", "train.steps=2", "--set", "checkpoint.interval=1"], cache)
    print(_one_error(p, 1, "not enough disk space", "last checkpoint:", "step_000001"))
    assert (out / "checkpoints" / "step_000001" / "COMPLETE").is_file() and not _leftovers(out)
    # 3. the same with the checks off: the save itself meets the full disk -> exit 1, partial removed
    p = _train(
        ["--out", str(out), "--set", "train.steps=2", "--set", "checkpoint.interval=1", "--resume", "auto"],
        cache,
        precheck=False,
    )
    print(_one_error(p, 1, "disk is full", "partial checkpoint .step_000002.partial was removed"))
    assert not _leftovers(out), _leftovers(out)
    # 4. --resume auto works again without cleaning up by hand (nothing left to train: no save)
    p = _train(["--out", str(out), "--set", "train.steps=1", "--resume", "auto"], cache)
    assert p.returncode == 0 and "continuing at step 1" in p.stdout, p.stderr[-2000:]


def test_full_disk_injected_during_save(tmp_path: Path) -> None:
    """Without a mount: ENOSPC raised inside the save after the shards are written."""
    out = tmp_path / "run"
    p = _train(
        ["--out", str(out), "--set", "train.steps=2", "--set", "checkpoint.interval=1"],
        tmp_path / "cache",
        env={"AXO4D_FAULT": "enospc:save:0:2"},
    )
    print(
        "\n"
        + _one_error(
            p, 1, "saving a checkpoint", "No space left on device", "disk is full", ".step_000002.partial was removed"
        )
    )
    assert sorted(c.name for c in (out / "checkpoints").iterdir()) == ["step_000001"]
    assert not _leftovers(out)


def test_space_checks_without_a_mount(tmp_path: Path, monkeypatch) -> None:
    """The start-up check and the per-save check with the free space patched (in one process)."""
    from axo4d.config import load_config
    from axo4d.config.errors import CheckpointError, CheckpointWriteError
    from axo4d.dist.comm import Comm
    from axo4d.facts.grid import Grid
    from axo4d.models import build_model
    from axo4d.nn.context import as_context
    from axo4d.training.checkpointing import integrity
    from axo4d.training.checkpointing.checkpointer import Checkpointer

    cfg = load_config("tiny")
    comm = Comm(Grid(), 0, init_groups=False)
    ck = Checkpointer(tmp_path / "run", cfg, comm, build_model(cfg.model, as_context(comm), seed=1), None)
    assert 0.5e6 < ck.expected_bytes() < 1e6  # the tiny model's weights: ~0.53 MB in fp32
    ck.check_space_at_start()  # plenty of space here
    monkeypatch.setattr(integrity, "free_bytes", lambda path: 100_000)
    with pytest.raises(CheckpointError, match=r"not enough disk space .* 0\.1 MiB is free"):
        ck.check_space_at_start()
    with pytest.raises(CheckpointWriteError, match="not enough disk space"):
        ck.save(1)
    assert not list((tmp_path / "run" / "checkpoints").glob(".*partial"))
