"""Runs at the same time: two runs sharing a fresh cache folder (token cache and GEMM tuner
decisions) both succeed and tokenise once; two runs given the same ``--out`` do not both write
it (the second is refused with one line naming the first: the catalogue case ``out-in-use``
covers the refusal; here the first run is really running)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "axo4d.train",
            "--config",
            "tiny",
            "--set",
            "train.eval_interval=0",
            "--set",
            "data.max_tokens=200000",
            *args,
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=open(log.with_suffix(".out"), "w"),
        stderr=open(log, "w"),
    )


def test_two_runs_share_a_fresh_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    procs = [
        _start(
            ["--set", f"data.cache_dir={cache}", "--set", "train.steps=2", "--out", str(tmp_path / f"run{i}")],
            tmp_path / f"err{i}.txt",
        )
        for i in range(2)
    ]
    codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0, 0], [(tmp_path / f"err{i}.txt").read_text()[-1500:] for i in range(2)]
    prepared = sorted(p.name for p in cache.glob("prepared-*") if p.is_dir())
    assert len(prepared) == 1 and (cache / prepared[0] / "dataset.json").is_file(), prepared  # once, atomically
    assert not list(cache.glob(".*partial*")) and not list(cache.glob("*.tmp")), sorted(os.listdir(cache))
    json.loads((cache / "blas_tuner.json").read_text())  # whole, not interleaved
    losses = [
        [
            json.loads(ln)["loss"]
            for ln in (tmp_path / f"run{i}" / "metrics.jsonl").read_text().splitlines()
            if "\"loss\"" in ln
        ]
        for i in range(2)
    ]
    assert losses[0] == losses[1]  # same data, same run


def test_second_run_on_the_same_out_is_refused(tmp_path: Path) -> None:
    out, cache = tmp_path / "run", tmp_path / "cache"
    first = _start(
        [
            "--set",
            f"data.cache_dir={cache}",
            "--set",
            "train.steps=100000",
            "--set",
            "parallel.tuner=false",
            "--set",
            "checkpoint.at_end=false",
            "--out",
            str(out),
        ],
        tmp_path / "first.txt",
    )
    try:
        t0 = time.time()
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
            assert first.poll() is None and time.time() - t0 < 300, (tmp_path / "first.txt").read_text()[-1500:]
            time.sleep(0.5)
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "axo4d.train",
                "--config",
                "tiny",
                "--set",
                f"data.cache_dir={cache}",
                "--out",
                str(out),
            ],
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert first.poll() is None, "the first run stopped"
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 2, second.stderr[-1500:]
    assert "is in use by another run (pid " in second.stderr and f"pid {first.pid} " in second.stderr, second.stderr
    assert not (out / "checkpoints.prev").exists()
