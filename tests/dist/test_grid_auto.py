"""``python -m axo4d.train --grid auto``: the performance model picks the grid and rank order of a
real 4-rank run, prints its best three with predicted step times, trains on the first, and prints
the first step's measured time beside the prediction; with a machine file and with a start-up
profile of the job's own ranks (with FP8 layers: their GEMMs profiled and priced, so the prediction
is of the run that trains); ``parallel.cache_weights=auto`` becomes a number of blocks."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.dist.harness import ROOT

COMMON = [
    "--config",
    "tiny",
    "--grid",
    "auto",
    "--set",
    "train.steps=2",
    "--set",
    "train.eval_interval=0",
    "--set",
    "checkpoint.at_end=false",
    "--set",
    "train.global_batch=16",
    "--set",
    "parallel.tuner=false",
]


def _train(out, extra: list[str]) -> tuple[int, str]:
    cmd = [
        sys.executable,
        "-m",
        "launch.local",
        "-n",
        "4",
        "--mode",
        "env",
        "--",
        "axo4d.train",
        *COMMON,
        "--out",
        str(out),
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.dist
@pytest.mark.parametrize(
    "extra,source",
    [
        ([], "start-up profile"),
        (["--set", "parallel.machine=perlmutter", "--set", "parallel.cache_weights=auto"], "machine 'perlmutter'"),
        (["--set", "train.fp8=tensorwise", "--set", "train.fp8_layers=all"], "start-up profile"),
    ],
)
def test_grid_auto_trains_on_the_predicted_best(tmp_path, extra, source):
    rc, out = _train(tmp_path / "run", extra)
    assert rc == 0, out[-3000:]
    assert "grid auto: " in out and source in out, out[-3000:]
    assert len(re.findall(r"^\s+[123]\. .* s/step predicted", out, re.M)) == 3, out[-3000:]
    chosen = re.search(r"^using (\S+) order (\S+)$", out, re.M)
    assert chosen, out[-3000:]
    m = re.search(r"^step time: measured ([0-9.e+-]+) s .*predicted ([0-9.e+-]+) s", out, re.M)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, out[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert recs and recs[0]["grid"] == chosen.group(1)
    import yaml

    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert cfg["parallel"]["grid"] == chosen.group(1) and cfg["parallel"]["order"] == chosen.group(2)
    if "train.fp8" in " ".join(extra):  # FP8 GEMMs profiled and priced: the prediction was 33x short without
        assert float(m.group(1)) / float(m.group(2)) < 10, out[-3000:]
    if "cache_weights=auto" in " ".join(extra):
        assert cfg["parallel"]["cache_weights"].isdigit() and "cache_weights auto:" in out
