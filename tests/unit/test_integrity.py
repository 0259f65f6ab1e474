"""Checkpoint integrity in one process: checksums in the manifest catch a byte changed in place,
the files are shared out evenly among ranks, older manifests (sizes only) still load, a model
with non-finite weights is never saved, and fault specs parse (or fail in one line)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from axo4d.config import load_config
from axo4d.config.errors import CheckpointError, ConfigError, TrainError
from axo4d.dist import faults
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.models import build_model
from axo4d.nn.context import as_context
from axo4d.training.checkpointing import integrity
from axo4d.training.checkpointing.checkpointer import Checkpointer, read_info, read_manifest


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    cfg = load_config("tiny")
    comm = Comm(Grid(), 0, init_groups=False)
    model = build_model(cfg.model, as_context(comm), seed=1)
    return Checkpointer(tmp_path_factory.mktemp("ck") / "run", cfg, comm, model, None).save(3)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_manifest_holds_size_and_crc32_of_every_file(saved: Path) -> None:
    m = read_manifest(saved)
    assert sorted(m) == sorted(p.name for p in saved.iterdir() if p.name != "COMPLETE")
    for name, e in m.items():
        assert e["bytes"] == (saved / name).stat().st_size and e["crc32"] == integrity.crc32_file(saved / name)
    assert read_info(saved, verify=True)["step"] == 3


def test_a_byte_changed_in_place_is_found(saved: Path, tmp_path: Path) -> None:
    ck = _copy(saved, tmp_path / "step_000003")
    f = next(ck.glob("*.distcp"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 1  # one bit, same size
    f.write_bytes(bytes(data))
    read_info(ck)  # sizes alone cannot see it
    with pytest.raises(CheckpointError, match=rf"is corrupt: file '{f.name}' does not match its checksum"):
        read_info(ck, verify=True)
    bad, nbytes, _ = integrity.verify(ck, read_manifest(ck), [f.name])
    assert f.name in bad and nbytes == len(data)


def test_old_manifests_check_sizes_only(saved: Path, tmp_path: Path) -> None:
    ck = _copy(saved, tmp_path / "step_000003")
    m = read_manifest(ck)
    (ck / "COMPLETE").write_text(json.dumps({"files": {n: e["bytes"] for n, e in m.items()}}))
    assert not integrity.has_checksums(read_manifest(ck))
    assert read_info(ck, verify=True)["step"] == 3
    (ck / "COMPLETE").write_text('{"files": [1, 2]}')
    with pytest.raises(CheckpointError, match="its COMPLETE manifest"):
        read_info(ck)


def test_share_out_balances_and_agrees() -> None:
    manifest = {f"__{i}_0.distcp": {"bytes": 1000 + i} for i in range(8)} | {".metadata": {"bytes": 10}}
    for world in (1, 3, 8, 16):
        shares = integrity.share_out(manifest, world)
        assert sorted(n for s in shares for n in s) == sorted(manifest) and len(shares) == world
        loads = [sum(manifest[n]["bytes"] for n in s) for s in shares]
        assert max(loads) - min(loads) <= 1010 and shares == integrity.share_out(
            dict(reversed(manifest.items())), world
        )


def test_never_saves_non_finite_weights(tmp_path: Path) -> None:
    cfg = load_config("tiny")
    comm = Comm(Grid(), 0, init_groups=False)
    model = build_model(cfg.model, as_context(comm), seed=1)
    ck = Checkpointer(tmp_path / "run", cfg, comm, model, None)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = math.nan
    with pytest.raises(TrainError, match="not finite .* not saving them") as e:
        ck.save(5)
    assert e.value.agreed and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    "raw,parsed",
    [
        ("kill:save:1", ("kill", "save", 1, 1)),
        ("stop:start:0:2", ("stop", "start", 0, 2)),
        ("kill:all_reduce:data:3", ("kill", "all_reduce:data", 3, 1)),
        ("enospc:all_reduce:z+data:0:4", ("enospc", "all_reduce:z+data", 0, 4)),
    ],
)
def test_fault_specs(raw: str, parsed: tuple) -> None:
    f = faults.Faults.parse(raw)
    assert (f.action, f.point, f.rank, f.n) == parsed


@pytest.mark.parametrize("raw", ["boom", "kill", "explode:save:1", "kill:save:x", "kill:a:b:c:d:e"])
def test_bad_fault_specs(raw: str) -> None:
    with pytest.raises(ConfigError, match="AXO4D_FAULT"):
        faults.Faults.parse(raw)


def test_fault_hit_counts_and_raises(monkeypatch) -> None:
    monkeypatch.setenv("AXO4D_FAULT", "enospc:save:2:2")
    f = faults.armed()
    f.hit("save", 2)  # the first time: nothing
    f.hit("save", 1)  # another rank: nothing
    with pytest.raises(OSError, match="No space left on device"):
        f.hit("save", 2)
    assert faults.armed() is f  # one object per process: its counts run across every Comm
    monkeypatch.delenv("AXO4D_FAULT")
    assert faults.armed() is None  # unarmed: nothing to call per collective
