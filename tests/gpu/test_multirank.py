"""The multi-rank path on a GPU: 2 and 4 ranks against one process on the same device.

Ranks share one GPU over gloo (NCCL refuses two ranks on one GPU; gloo takes CUDA tensors).
Switches (environment):

* ``AXO4D_GPU_TEST_BACKEND=nccl``: NCCL, one GPU per rank (skipped with fewer GPUs than ranks);
* ``AXO4D_GPU_TESTS_ON_CPU``: where and at what size without a GPU (``tests/gpu/mode.py``: CI runs
  them on CPU ranks at a reduced size, 4 steps and 2 grids per rank count);
* ``AXO4D_GPU_TEST_REPORT=FILE``: also write every figure as JSON (``bench/gpu_check.sh`` does).

For each rank count, one spawned group (``tests.gpu.cases:run_all``) trains the tiny GPT 10 steps
on every grid, in fp32 and bf16 autocast, against the one-process run: fp32 losses within 1e-5
relative (final weights within 1e-4 relative L2), bf16 losses within 2e-2; the overlapped and the
eager schedule give identical losses and weights; a checkpoint saved at step 5 on the first grid
resumes on the second with the uninterrupted run's losses (fp32, 1e-5).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.dist.harness import run_on_ranks
from tests.gpu.cases import backend_env
from tests.gpu.mode import ON_CPU, REDUCED, SKIP, SKIP_REASON

BACKEND = os.environ.get("AXO4D_GPU_TEST_BACKEND", "gloo")
STEPS = 4 if REDUCED else 10
FP32_LOSS, FP32_WEIGHT, BF16_LOSS = 1e-5, 1e-4, 2e-2
GRIDS = (
    {2: ["x=2", "data=2"], 4: ["x=2,z=2", "data=2,y=2"]}  # every axis once, and the checkpoint moved
    if REDUCED
    else {2: ["x=2", "z=2", "y=2", "data=2"], 4: ["x=2,z=2", "data=2,y=2", "x=2,y=2"]}
)

pytestmark = [pytest.mark.dist, pytest.mark.skipif(SKIP, reason=SKIP_REASON)]


def _env(n: int) -> dict[str, str]:
    env = backend_env()
    if ON_CPU:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif BACKEND == "gloo" and "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = "0"  # every rank on one GPU
    elif BACKEND == "nccl" and torch.cuda.device_count() < n:
        pytest.skip(f"nccl needs {n} GPUs, {torch.cuda.device_count()} visible")
    return env


@pytest.fixture(scope="module", params=sorted(GRIDS))
def results(request, tmp_path_factory):
    n = request.param
    with pytest.MonkeyPatch.context() as mp:
        for k, v in _env(n).items():
            mp.setenv(k, v)
        res = run_on_ranks(n, "tests.gpu.cases:run_all", 900, GRIDS[n], STEPS, str(tmp_path_factory.mktemp(f"gpu{n}")))
    r = res[0]
    r["ranks"] = n
    report = os.environ.get("AXO4D_GPU_TEST_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps(r) + "\n")
    print(f"\n{n} ranks on {r['device']} over {r['backend']}:")
    for p in r["parity"]:
        print(f"  {p['dtype']} {p['grid']:12s} max rel loss {p['max_rel_loss']:.2e}  weights {p['max_rel_weight']:.2e}")
    for p in r["overlap"]:
        print(f"  overlap on/off {p['grid']:12s} identical {p['identical']}  max rel loss {p['max_rel_loss']:.2e}")
    s = r["reshard"]
    print(f"  checkpoint {s['from']} -> {s['to']} at step {s['start']}: max rel loss {s['max_rel_loss']:.2e}")
    return r


def test_fp32_parity_with_one_process(results):
    bad = [
        p
        for p in results["parity"]
        if p["dtype"] == "fp32" and not (p["max_rel_loss"] <= FP32_LOSS and p["max_rel_weight"] <= FP32_WEIGHT)
    ]
    assert not bad, f"fp32 grids differ from one process: {bad}"
    assert all(len(p["losses"]) == STEPS for p in results["parity"])
    ref = results["parity"][0]["ref"]
    assert ref[-1] < ref[0], "the one-process loss did not fall"


def test_bf16_parity_with_one_process(results):
    bad = [p for p in results["parity"] if p["dtype"] == "bf16" and not p["max_rel_loss"] <= BF16_LOSS]
    assert not bad, f"bf16 grids differ from one process by more than {BF16_LOSS}: {bad}"


def test_overlap_on_and_off_identical(results):
    bad = [p for p in results["overlap"] if not p["identical"]]
    assert not bad, f"overlapped and eager schedules differ: {bad}"


def test_checkpoint_resumed_on_another_grid(results):
    s = results["reshard"]
    assert s["start"] == s["k"] and len(s["losses"]) == STEPS - s["k"]
    assert s["max_rel_loss"] <= FP32_LOSS, s
