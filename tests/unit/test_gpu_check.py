"""bench/gpu_check.sh: the script parses, refuses a machine without CUDA in GPU mode with one
line, and its summary table reads what the parts write (synthetic figures; the parts themselves
run in ``bench/gpu_check.sh --cpu``, minutes on 2 cores, and on a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def test_script_parses_and_is_executable():
    assert os.access(SCRIPT, os.X_OK)
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_gpu_mode_without_cuda_is_one_clear_line(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(
        ["bash", str(SCRIPT), "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 2 and "no CUDA device here" in r.stderr and "--cpu" in r.stderr, r.stderr
    assert r.stdout == ""


def _contender(tflops: float, gib: float) -> dict:
    return {
        "median_s": 1.0,
        "min_s": 1.0,
        "tflops": tflops,
        "mfu": tflops / 989,
        "gemm_ceiling_frac": tflops / 813,
        "peak_gib": gib,
    }


def test_summary_table_reads_the_parts(tmp_path):
    gpt = {"config": "gpt-1.3b", "flops_per_step": 1.0e15, "vendor_peak": 989.0, "gemm_ceiling": 813.0}
    eager = {"plain eager": _contender(502, 50.0), "axo4d eager": _contender(560, 48.0)}
    compiled = {"plain compiled": _contender(562, 47.3), "axo4d compiled": _contender(610, 48.5)}
    # the eager and the compiled parts write a file each: the summary takes them as one model's run
    (tmp_path / "speed_gpt-1.3b.json").write_text(json.dumps(gpt | {"contenders": eager}))
    (tmp_path / "speed_compiled_gpt-1.3b.json").write_text(json.dumps(gpt | {"contenders": compiled}))
    (tmp_path / "speed_llama3.2-1b.json").write_text(
        json.dumps(
            {  # another shape: not the trainer's yardstick
                "config": "llama3.2-1b",
                "flops_per_step": 7.0e14,
                "vendor_peak": 989.0,
                "gemm_ceiling": 813.0,
                "contenders": {"plain compiled": _contender(700, 30.0), "axo4d compiled": _contender(900, 30.0)},
            }
        )
    )
    (tmp_path / "sanity.json").write_text(
        json.dumps(
            {
                "config": "gpt-1.3b",
                "dtype": "torch.bfloat16",
                "axo4d": [[11.2, 7.0], [11.0, 6.0]],
                "plain": [[11.2, 7.0], [11.01, 6.1]],
                "max_rel": 1e-3,
                "trainer_tflops": 600.0,
                "compile": True,
                "flops_per_step": 1.0e15,
            }
        )
    )
    (tmp_path / "gpu_tests.jsonl").write_text(
        json.dumps(
            {
                "ranks": 2,
                "backend": "gloo",
                "parity": [
                    {"dtype": "fp32", "grid": "x=2", "max_rel_loss": 1e-7},
                    {"dtype": "bf16", "grid": "x=2", "max_rel_loss": 4e-3},
                ],
                "overlap": [{"identical": True}],
                "reshard": {"from": "x=2", "to": "z=2", "max_rel_loss": 2e-7},
            }
        )
        + "\n"
        + json.dumps(
            {
                "test": "offload",
                "ranks": 2,
                "rows": [
                    {"dtype": "fp32", "mode": "sharded", "max_rel_loss": 0.0},
                    {"dtype": "fp32", "mode": "offload", "max_rel_loss": 3e-7},
                ],
            }
        )
        + "\n"
    )
    pair = {"pair": "x2", "grid": "x=2", "peer": "torch TP (parallelize_module)", "ratio": 0.5, "losses_agree": True}
    pair |= {"median_s": {"axo4d": 0.010, "peer": 0.020}, "first_loss": {"axo4d": 5.5, "peer": 5.5}}
    bad = pair | {"pair": "z2", "grid": "z=2", "peer": "FSDP2 (fully_shard)", "losses_agree": False}
    (tmp_path / "peers.json").write_text(
        json.dumps({"load_before": [0, 0, 0], "load_after": None, "pairs": [pair, bad]})
    )
    (tmp_path / "status.txt").write_text("speed_gpt 0 150\nsanity 0 60\ngpu_tests 0 90\n")
    r = subprocess.run(
        [sys.executable, "-m", "bench.gpu_summary", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    names = [line.split("|")[0].strip() for line in r.stdout.splitlines()]
    assert names.count("gpt-1.3b: best axo4d >= 600 TFLOP/s") == 1  # one row per model, not per file
    rows = {line.split("|")[0].strip(): line for line in r.stdout.splitlines()}
    assert (
        "PASS" in rows["gpt-1.3b: best axo4d / plain compiled"]
        and "1.085" in rows["gpt-1.3b: best axo4d / plain compiled"]
    )
    assert "PASS" in rows["gpt-1.3b: best axo4d >= 600 TFLOP/s"]
    assert (
        "1.025" in rows["gpt-1.3b: peak memory axo4d/plain compiled"]
        and "PASS" in rows["gpt-1.3b: peak memory axo4d/plain compiled"]
    )
    assert "0.984" in rows["trainer step (compile=True) / best bench axo4d"]
    assert "PASS" in rows["loss sanity: max rel diff axo4d vs plain"]
    assert "3.00e-07" in rows["2 ranks fp32 sharded optimizer / offload vs unsharded"]
    assert "True" in rows["2 ranks overlap on/off identical"] and "PASS" in rows["tests/gpu (pytest)"]
    assert "ratio 0.500" in rows["peers x2 (x=2) vs torch TP"] and rows["peers x2 (x=2) vs torch TP"].endswith("PASS")
    assert rows["peers z2 (z=2) vs FSDP2"].endswith("FAIL")  # the losses disagree: not the same work
