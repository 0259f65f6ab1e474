"""Checkpoints: chunk arithmetic, exact resume, resharding across grids, safetensors round trip.

* every rank's DCP chunks tile the full tensor exactly (pure, many grids and odd shapes);
* 8 ranks: save on x=2,y=2,z=2 at step k; resume there bit-exactly; load on data=4,x=2 (loss
  within 1e-5 of the uninterrupted run, tensors exact); A -> B -> A gives identical tensors, and
  B's checkpoint (pairs turned: x alone) loads exactly on data=4,y=2 (pairs not turned);
  the same checkpoint continues on one process;
* the real CLI on 2 ranks: a run killed by a non-finite loss after a checkpoint, resumed with
  ``--resume auto``, has the uninterrupted run's losses (bitwise), one metrics record per step
  and the same final weights; export -> import -> export is the identity.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from axo4d.facts.grid import Grid
from axo4d.facts.placement import Block3D, Placement, Replicated, Split, chunk_view
from tests.dist.harness import ROOT, run_on_ranks
from tests.helpers import why_not_even

STEPS, K = 6, 3


# ---- chunk arithmetic (no process group) ------------------------------------------------
PLACEMENTS = [
    Block3D((12, 10), in_axis="x", out_axis="y"),
    Block3D((6, 20), in_axis="y", out_axis="x"),
    Block3D((8, 6), in_axis="x", out_axis="y"),
    Split((5, 12), axis="x"),
    Split((12,), axis="y"),
    Replicated((3, 4)),
]


@pytest.mark.parametrize("pl", PLACEMENTS, ids=lambda p: f"{type(p).__name__}{p.full_shape}")
@pytest.mark.parametrize("spec", ["data=1", "x=2", "y=2,z=3", "x=2,y=2,z=2", "data=2,z=4", "z=5", "y=2,z=3,x=2"])
@pytest.mark.parametrize("cut", [0, 3])
def test_chunks_tile_full_tensor(pl: Placement, spec: str, cut: int) -> None:
    grid = Grid.parse(spec)
    full = torch.arange(torch.Size(pl.full_shape).numel(), dtype=torch.float32).view(pl.full_shape)
    why = why_not_even(pl, grid)
    if why:
        pytest.skip(f"does not split evenly: {why}")
    shards = [pl.shard(full, grid, r).reshape(pl.local_shape(grid)) for r in range(grid.world_size)]
    if cut and len(pl.full_shape) == 2:
        pl = pl.with_(logical_rows=pl.full_shape[0] - cut)
    target = full[: pl.logical_shape[0]]
    cover = torch.zeros(target.shape, dtype=torch.int64)
    owners: dict = {}
    for r, shard in enumerate(shards):
        for ch in pl.chunks(grid, r):
            region = tuple(slice(o, o + n) for o, n in zip(ch.offsets, ch.sizes))
            assert torch.equal(chunk_view(shard, ch), target[region]), (spec, ch)
            key = (ch.offsets, ch.sizes)
            if key not in owners:  # replicas describe identical chunks (deduplicated by DCP)
                owners[key] = r
                cover[region] += 1
    assert bool((cover == 1).all()), f"{spec}: chunks do not tile the tensor exactly once"
    assert torch.equal(pl.assemble(shards, grid)[: pl.logical_shape[0]], target)


# ---- folders: only complete checkpoints count; pruning -------------------------------------
def _fake_ckpt(folder: Path, name: str, complete: bool = True) -> Path:
    d = folder / name
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"x")
    if complete:
        (d / "COMPLETE").write_text(json.dumps({"files": {".metadata": 1}}))
    return d


def test_incomplete_checkpoints_are_ignored_and_pruned(tmp_path: Path) -> None:
    from axo4d.training.checkpointing.checkpointer import CheckpointError, complete_checkpoints, find_checkpoint, prune

    ck = tmp_path / "run" / "checkpoints"
    for step in (2, 4, 6):
        _fake_ckpt(ck, f"step_{step:06d}")
    _fake_ckpt(ck, "step_000010", complete=False)  # named like one, no COMPLETE (a partial copy)
    _fake_ckpt(ck, ".step_000008.partial", complete=False)  # crashed mid-save
    assert find_checkpoint(tmp_path / "run") == ck / "step_000006"
    assert find_checkpoint(ck) == ck / "step_000006"
    with pytest.raises(CheckpointError, match="incomplete"):
        find_checkpoint(ck / "step_000010")
    with pytest.raises(CheckpointError, match="incomplete"):
        find_checkpoint(ck / ".step_000008.partial")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        find_checkpoint(tmp_path)
    prune(ck, 2)
    assert [p.name for p in complete_checkpoints(ck)] == ["step_000004", "step_000006"]
    assert not (ck / ".step_000008.partial").exists()


# ---- 8 ranks: exact resume and resharding ---------------------------------------------------
@pytest.mark.dist
def test_resume_and_reshard(tmp_path: Path) -> None:
    r = run_on_ranks(
        8,
        "tests.dist.cases_checkpoint:reshard",
        900,
        str(tmp_path),
        STEPS,
        K,
        "x=2,y=2,z=2",
        "data=4,x=2",
        "data=4,y=2",
    )[0]
    ref = r["ref"]
    print(f"reference losses on x=2,y=2,z=2: {ref}")
    assert r["start"] == K and r["start_b"] == K
    assert not r["resume_load_diff"], f"loaded tensors differ from the saved ones: {r['resume_load_diff'][:5]}"
    assert r["resumed"] == ref[K:], f"resume on the same grid is not bit-exact: {r['resumed']} vs {ref[K:]}"
    assert not r["resume_final_diff"], f"final tensors after resume differ: {r['resume_final_diff'][:5]}"
    assert not r["load_b_diff"], f"tensors loaded on data=4,x=2 differ: {r['load_b_diff'][:5]}"
    rel_b = max(abs(a - b) / abs(b) for a, b in zip(r["losses_b"], ref[K:]))
    print(f"data=4,x=2 after loading the x=2,y=2,z=2 checkpoint: max rel loss diff {rel_b:.2e}")
    assert rel_b <= 1e-5
    assert not r["round_trip_diff"], f"A -> B -> A changed tensors: {r['round_trip_diff'][:5]}"
    # x alone turns the layer pairs (docs/design.md 2.2), y alone does not: the checkpoint holds logical tensors
    assert not r["load_c_diff"], f"the data=4,x=2 checkpoint loaded on data=4,y=2 differs: {r['load_c_diff'][:5]}"
    assert r["meta_b"]["grid"] == "data=4,x=2,y=1,z=1" and r["meta_b"]["step"] == K
    assert "COMPLETE" in r["files_a"] and ".metadata" in r["files_a"]
    assert sum(f.endswith(".distcp") for f in r["files_a"]) >= 2, "shards should come from several ranks"
    one = run_on_ranks(1, "tests.dist.cases_checkpoint:single", 300, r["ckpt_a"], STEPS)[0]
    rel_1 = max(abs(a - b) / abs(b) for a, b in zip(one["losses"], ref[K:]))
    print(f"one process after loading the x=2,y=2,z=2 checkpoint: max rel loss diff {rel_1:.2e}")
    assert one["start"] == K and rel_1 <= 1e-5


# ---- the real CLI: crash, auto-resume, export/import --------------------------------------
def _cli(args: list[str], n: int = 2, env: dict | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    module = "tests.nan_train" if env and "AXO4D_FAULT_NAN_AT_STEP" in env else "axo4d.train"
    cmd = [sys.executable, "-m", "launch.local", "-n", str(n), "--mode", "env", "--", module, *args]
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)


def _losses(out: Path) -> list[tuple[int, float]]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if "loss" in r]


def _tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "axo4d.checkpoint", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


@pytest.mark.dist
def test_cli_crash_and_auto_resume(tmp_path: Path) -> None:
    common = [
        "--config",
        "tiny",
        "--grid",
        "z=2",
        "--set",
        f"train.steps={STEPS}",
        "--set",
        f"checkpoint.interval={K}",
        "--set",
        "train.eval_interval=0",
        "--set",
        "parallel.tuner=false",
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    p = _cli(common + ["--out", str(ref)])
    assert p.returncode == 0, p.stderr[-2000:]
    p = _cli(common + ["--out", str(run)], env={"AXO4D_FAULT_NAN_AT_STEP": str(K + 1)})
    assert p.returncode == 1, p.stderr[-2000:]
    assert "non-finite loss" in p.stderr and f"at step {K + 1}" in p.stderr
    assert f"last checkpoint: {run / 'checkpoints' / f'step_{K:06d}'}" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert [s for s, _ in _losses(run)] == list(range(K + 1))  # steps 0..K logged before the crash
    p = _cli(common + ["--out", str(run), "--resume", "auto"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"continuing at step {K}" in p.stdout
    assert _losses(run) == _losses(ref), "resumed losses differ from the uninterrupted run"
    for d in (ref, run):
        q = _tool("export", str(d), str(d / "final.safetensors"))
        assert q.returncode == 0, q.stderr
    from safetensors.torch import load_file

    a, b = load_file(str(ref / "final.safetensors")), load_file(str(run / "final.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"
    # single-file round trip: export -> import -> export
    q = _tool("import", str(ref / "final.safetensors"), str(tmp_path / "imp"), "--config", "tiny", "--step", "5")
    assert q.returncode == 0, q.stderr
    q = _tool("export", str(tmp_path / "imp"), str(tmp_path / "imp.safetensors"))
    assert q.returncode == 0, q.stderr
    c = load_file(str(tmp_path / "imp.safetensors"))
    assert c.keys() == a.keys() and all(torch.equal(a[k], c[k]) for k in a)
    assert a["lm_head.weight"].shape == (256, 64) and "blocks.0.attn.qkv.weight" in a
