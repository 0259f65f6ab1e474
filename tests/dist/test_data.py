"""The data pipeline on a grid (one spawned group of 4 ranks, and the real command line):

* grad_accum 1, 2 and 4 give every step's loss within 1e-6 relative of each other, on one process
  and on data=2 x=2 (fp32, 20 steps), with the same logged sample indices; the grid's losses are
  within the parity tolerance of the one-process run's;
* one epoch (``train.epochs=1``) of a 1,000-document JSONL on data=2 x=2 with accumulation trains
  every document token exactly once (token ids are unique per position; counted over the ranks'
  batches, each (data, z) shard once -- the x ranks of a shard read the same batch);
* with ``data.document_mask`` (short documents, many per sample) y=2 z=2 trains like one process;
* a run stopped at step 7 and resumed on another grid logs the same sample indices for every step as
  an uninterrupted run, and losses within the parity tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.data_fixtures import unique_jsonl, unique_tokenizer
from tests.dist.harness import ROOT, run_on_ranks
from tests.dist.test_parity import TOL

STEPS = 10


def _max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.dist
def test_accumulation_and_one_epoch_on_a_grid(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    words = unique_jsonl(tmp_path / "docs.jsonl", 1000)
    unique_tokenizer(tmp_path / "tokenizer.json", words + [["held", "out"]])
    (tmp_path / "val.jsonl").write_text('{"text": "held out"}\n' * 8)
    res = run_on_ranks(4, "tests.dist.cases_data:run", 900, str(tmp_path), "data=2,x=2", STEPS, "y=2,z=2")
    acc = res[0]["accumulation"]
    one, grid = acc["one"], acc["grid"]
    for where, runs in (("one process", one), ("data=2,x=2", grid)):
        for accum in ("2", "4"):
            rel = _max_rel(runs[accum]["losses"], runs["1"]["losses"])
            print(f"{where}: grad_accum {accum} vs 1: max rel loss diff {rel:.2e} over {STEPS} steps")
            assert rel <= 1e-6, f"{where}: grad_accum={accum} changes the loss by {rel:.2e} relative"
            assert runs[accum]["samples"] == runs["1"]["samples"], f"{where}: grad_accum={accum} changes samples"
    rel = _max_rel(grid["1"]["losses"], one["1"]["losses"])
    print(f"data=2,x=2 vs one process: max rel loss diff {rel:.2e}")
    assert rel <= TOL and grid["1"]["samples"] == one["1"]["samples"]
    assert len(one["1"]["losses"]) == STEPS and one["1"]["losses"][-1] < one["1"]["losses"][0]
    # one epoch: each (data, z) shard's targets counted once
    n_tokens = sum(map(len, words))
    counts = np.zeros(2 + n_tokens + 2, np.int64)
    by_shard: dict[tuple, list] = {}
    for r in res:
        e = r["epoch"]
        key = (e["coords"]["data"], e["coords"]["z"])
        if key in by_shard:
            assert by_shard[key] == e["targets"], "the x ranks of one shard read different batches"
            continue
        by_shard[key] = e["targets"]
        counts += np.bincount(e["targets"], minlength=len(counts))
    assert len(by_shard) == 2
    assert counts[1] == 1000, "one end-of-text target after every document"
    bad = np.flatnonzero(counts[2 : 2 + n_tokens] != 1)
    assert not len(bad), f"{len(bad)} document tokens not trained exactly once, e.g. id {bad[:5] + 2}"
    assert counts[0] == 0 and counts.sum() == n_tokens + 1000
    seen, epoch_size = res[0]["epoch"]["epoch"][2:]
    print(f"one epoch: {res[0]['epoch']['steps']} steps, {seen} samples of {epoch_size}, {n_tokens} tokens once each")
    assert res[0]["epoch"]["epoch"][:2] == [0, 1.0] and seen == epoch_size
    # the document mask on heads split over y and rows over z: the one-process run's losses
    m = res[0]["mask"]
    rel = _max_rel(m["grid"]["losses"], m["one"]["losses"])
    print(f"document mask, y=2,z=2 vs one process: max rel loss diff {rel:.2e}")
    assert rel <= TOL and abs(m["grid"]["val"] - m["one"]["val"]) <= TOL * abs(m["one"]["val"])


def _cli(args: list[str], n: int = 4) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launch.local", "-n", str(n), "--mode", "env", "--", "axo4d.train", *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _records(out: Path) -> dict[int, dict]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if "loss" in r}


@pytest.mark.dist
def test_stopped_at_step_7_resumed_on_another_grid_reads_the_same_samples(tmp_path: Path) -> None:
    common = [
        "--config",
        "tiny",
        "--set",
        "train.global_batch=16",
        "--set",
        "train.decay_steps=12",  # the schedule of the 12-step run, whatever train.steps says
        "--set",
        "train.eval_interval=0",
        "--set",
        "parallel.tuner=false",
        "--set",
        "data.log_samples=true",
    ]
    ref, run = tmp_path / "ref", tmp_path / "run"
    p = _cli(common + ["--grid", "data=2,x=2", "--set", "train.steps=12", "--out", str(ref)])
    assert p.returncode == 0, p.stderr[-2000:]
    p = _cli(common + ["--grid", "data=2,x=2", "--set", "train.steps=7", "--out", str(run)])
    assert p.returncode == 0, p.stderr[-2000:]
    p = _cli(common + ["--grid", "x=2,z=2", "--set", "train.steps=12", "--resume", "auto", "--out", str(run)])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "continuing at step 7, sample 112 of the data stream" in p.stdout, p.stdout[-2000:]
    a, b = _records(ref), _records(run)
    assert sorted(a) == sorted(b) == list(range(12))
    for s in range(12):
        assert b[s]["samples"] == a[s]["samples"], f"step {s}: other samples after the resume"
        assert abs(b[s]["loss"] - a[s]["loss"]) <= TOL * abs(a[s]["loss"]), (s, b[s]["loss"], a[s]["loss"])
    assert b[11]["grid"] == "data=1,x=2,y=1,z=2" and b[11]["samples_seen"] == 12 * 16
