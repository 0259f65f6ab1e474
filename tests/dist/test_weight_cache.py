"""Weight caching (``parallel.cache_weights``): bit-identical training, fewer z all-gathers, as the
performance model predicts; within 1e-4 of the one-process run. One spawned 8-rank group."""

import pytest

from tests.dist.harness import run_on_ranks

GRIDS = ["x=2,y=2,z=2", "data=2,z=4"]
VARIANTS = {
    "plain": [],
    "accum2+recompute": ["train.grad_accum=2", "train.global_batch=16", "train.activation_checkpointing=true"],
}
TOL = 1e-4


@pytest.mark.dist
def test_cached_weights_change_nothing_but_the_gathers():
    res = run_on_ranks(8, "tests.dist.cases_weight_cache:run", 900, GRIDS, VARIANTS)
    bad = []
    for rank, per_rank in enumerate(res):
        for name, grids in per_rank.items():
            for spec, rows in grids.items():
                for setting, r in rows.items():
                    where = f"rank {rank} {name} grid {spec} cache {setting}"
                    if rank == 0:
                        print(
                            f"{where}: z gathers {r['bytes'][0]} B (uncached {r['ref_bytes']} B), calls "
                            f"{r['calls'][0]}, cache {r['cache']}, vs 1 process {r['vs_one_process']:.1e}"
                        )
                    if not r["loss_equal"] or r["max_weight_diff"] != 0.0:
                        bad.append(f"{where}: differs from the uncached run (weights by {r['max_weight_diff']:.1e})")
                    if r["bytes"][0] != r["bytes"][1] or r["calls"][0] != r["calls"][1]:
                        bad.append(
                            f"{where}: z all-gathers {r['bytes'][0]} B / {r['calls'][0]} calls, "
                            f"perfmodel {r['bytes'][1]} B / {r['calls'][1]}"
                        )
                    if not r["bytes"][0] < r["ref_bytes"]:
                        bad.append(f"{where}: no gather saved ({r['bytes'][0]} vs {r['ref_bytes']})")
                    if not r["cache"].get("cache_hits") or r["cache"].get("cache_stale"):
                        bad.append(f"{where}: cache not used or stale: {r['cache']}")
                    if not r["vs_one_process"] <= TOL:
                        bad.append(f"{where}: loss {r['vs_one_process']:.1e} from the one-process run")
    assert not bad, "\n".join(bad[:20])
