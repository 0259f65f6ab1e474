"""Bytes per rank per step counted by Comm equal the performance model's, exactly.

One spawned 8-rank group runs a training step on a few grids (and one with
activation checkpointing and gradient accumulation); every rank's counts per
(group, collective), bytes and calls, must equal ``perfmodel.estimate``'s.
The full sweep over all 20 grids is ``python -m bench.bytes_check`` (with the sequence split over
z: ``python -m bench.bytes_check --set parallel.z_split=sequence``); the mixture of experts' is
``python -m bench.bytes_check --moe`` (13 grids with experts over 2 and 4 ranks).
"""

import pytest

from bench.bytes_check import MOE_CONFIG, MOE_OVERRIDES, OVERRIDES, _config, run_on
from tests.dist.harness import run_on_ranks

BASE = list(OVERRIDES)
CKPT = BASE + ["train.activation_checkpointing=true", "train.grad_accum=2", "train.global_batch=16"]
CASES = [
    ["x=2,y=2,z=2", BASE],
    ["data=2,y=4", BASE],
    ["z=8", BASE],
    ["data=2,x=4", BASE],
    # x=4 across nodes of 4 ranks (x second in the order): run with x and y exchanged (design.md 2.2)
    ["x=4,y=2", BASE + ["parallel.order=y,x,z,data"]],
    ["data=2,y=2,z=2", CKPT],
    # weight caching: the backward (and recompute) z all-gathers of the cached layers disappear
    ["x=2,y=2,z=2", BASE + ["parallel.cache_weights=all"]],
    ["data=2,y=2,z=2", CKPT + ["parallel.cache_weights=1"]],
    # FP8 GEMMs in the blocks: 1-byte z all-gathers, the scales' small all-reduces (cached and recomputed too)
    ["x=2,y=2,z=2", BASE + ["train.fp8=tensorwise", "train.fp8_layers=blocks"]],
    ["data=2,y=2,z=2", CKPT + ["train.fp8=rowwise", "train.fp8_layers=blocks", "parallel.cache_weights=1"]],
    # the sequence split over z: K/V all-gathers (forward, recompute) and their reduce-scatters (backward)
    ["z=8", BASE + ["parallel.z_split=sequence"]],
    ["data=2,y=2,z=2", CKPT + ["parallel.z_split=sequence", "parallel.cache_weights=1"]],
    # moe-tiny, experts over 2 data ranks (exactly balanced routing): the expert group's all-to-alls
    # (counts, dispatch, combine), the experts' gradients over edp, the routers' statistics
    ["data=2,y=2,z=2", list(MOE_OVERRIDES) + ["parallel.expert=2"], MOE_CONFIG],
]


def _diff(r: dict) -> str:
    keys = sorted(set(r["bytes"]) | set(r["pred_bytes"]) | set(r["calls"]) | set(r["pred_calls"]))
    return "; ".join(
        f"{k}: bytes {r['bytes'].get(k, 0)} vs {r['pred_bytes'].get(k, 0)}, "
        f"calls {r['calls'].get(k, 0)} vs {r['pred_calls'].get(k, 0)}"
        for k in keys
        if r["bytes"].get(k, 0) != r["pred_bytes"].get(k, 0) or r["calls"].get(k, 0) != r["pred_calls"].get(k, 0)
    )


@pytest.mark.dist
def test_measured_bytes_equal_model():
    exchanged = ["x=4,y=2", BASE + ["parallel.order=y,x,z,data"]]  # the case of x and y exchanged, so exchanged
    assert exchanged in CASES and run_on(_config(exchanged), "x=4,y=2").spec() == "data=1,x=2,y=4,z=1"
    res = run_on_ranks(8, "bench.bytes_check:check", 600, CASES)
    bad = [
        f"rank {rank} grid {r['spec']} {' '.join(r['overrides'][len(BASE) :])}: {_diff(r)}"
        for rank, per in enumerate(res)
        for r in per
        if not r["equal"]
    ]
    assert not bad, "measured != predicted:\n" + "\n".join(bad[:8])
    assert all(len(per) == len(CASES) for per in res)
