"""``train.tensorboard``: event files beside metrics.jsonl with the same numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")

ROOT = Path(__file__).resolve().parents[2]


def test_tensorboard_scalars_match_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "axo4d.train",
            "--config",
            "tiny",
            "--out",
            str(out),
            "--set",
            "train.steps=3",
            "--set",
            "train.eval_interval=2",
            "--set",
            "train.tensorboard=true",
            "--set",
            "parallel.tuner=false",
            "--set",
            "train.peak_tflops=1.0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert list(out.glob("events.out.tfevents.*")), "no TensorBoard event file beside metrics.jsonl"
    ev = EventAccumulator(str(out))
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "perf/tokens_per_s",
        "perf/mfu",
        "perf/gemm_ceiling_frac",
        "perf/memory_gib",
        "perf/tflops_per_device",
        "val/loss",
    } <= tags, tags
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert [pytest.approx(e.value, rel=1e-6) for e in ev.Scalars("train/loss")] == losses
    assert [e.step for e in ev.Scalars("val/loss")] == [r["step"] for r in recs if "val_loss" in r]


def test_tensorboard_missing_package_is_a_clear_error(tmp_path):
    out = tmp_path / "run"
    code = (
        "import sys, runpy; sys.modules['torch.utils.tensorboard'] = None; "
        f"sys.argv = ['axo4d.train', '--config', 'tiny', '--out', {str(out)!r}, '--set', 'train.tensorboard=true']; "
        "runpy.run_module('axo4d.train', run_name='__main__')"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "needs the 'tensorboard' package" in r.stderr, r.stderr[-2000:]
    assert not out.exists()
