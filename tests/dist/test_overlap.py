"""Overlap on and off give identical training; gradient consumers see final gradients; the tuner
agrees across ranks, changes results only by rounding, and reuses its cache.

Overlap only moves when collectives are issued and waited for: the same calls with the same
inputs in the same order per group, and weight gradients accumulated as autograd does (set,
then ``add_``). So losses and final weight shards are compared BIT-EXACTLY (==), and the byte
and call counters must be equal. Tuner variants are other BLAS calls (other accumulation
order), so tuner on vs off is compared within 1e-6 relative.
"""

import pytest

from axo4d.config import load_config
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid
from tests.dist.cases_overlap import DEFAULTS_MODEL
from tests.dist.harness import run_on_ranks

GRIDS = ["x=2,y=2,z=2", "data=2,x=2,z=2", "data=2,z=4"]
VARIANTS = {
    "plain": [],
    "accum2+recompute": ["train.grad_accum=2", "train.global_batch=16", "train.activation_checkpointing=true"],
}
ONLY = {"accum2+recompute": ["x=2,y=2,z=2", "data=2,z=4"]}  # plain covers data*x*z
TUNER_TOL = 1e-6


@pytest.mark.dist
def test_overlap_on_off_identical_and_consumer_sees_final_grads():
    res = run_on_ranks(8, "tests.dist.cases_overlap:run", 900, GRIDS, VARIANTS, ONLY)
    bad = []
    for rank, per_rank in enumerate(res):
        for name, grids in per_rank.items():
            for spec, r in grids.items():
                where = f"rank {rank} {name} grid {spec}"
                if rank == 0:
                    print(
                        f"{name:17s} {spec:15s} losses equal {r['loss_equal']} max |dw| {r['max_weight_diff']:.1e} "
                        f"bytes equal {r['bytes_equal']} calls equal {r['calls_equal']} "
                        f"consumer grads equal {r['seen_equal']} prefetch {r['stats']}"
                    )
                if not r["loss_equal"]:
                    bad.append(f"{where}: losses differ")
                if r["max_weight_diff"] != 0.0:
                    bad.append(f"{where}: final weights differ by {r['max_weight_diff']:.2e}")
                if not (r["bytes_equal"] and r["calls_equal"]):
                    bad.append(f"{where}: byte/call counters differ")
                if not (r["seen_equal"] and r["seen_steps"] == 4):
                    bad.append(f"{where}: on_gradients_ready saw other gradients than with overlap off")
                if not r["early_differs"]:
                    bad.append(f"{where}: control: a post-accumulate hook saw the final bias gradient")
                if r["stats"].get("stale", 0) or not r["stats"].get("hits", 0):
                    bad.append(f"{where}: prefetch mispredicted: {r['stats']}")
    assert not bad, "\n".join(bad[:20])


def _chunked(g: Grid) -> bool:
    """Whether a block layer's forward runs in row chunks on ``g`` at :func:`cases_overlap.defaults`'s
    sizes, as the model facts say (:meth:`LinearSpec.fwd_chunks`: at least two chunks of 2^18
    elements of the output reduce-scattered over an input axis of several ranks, or else of the input
    all-gathered over an output axis of several ranks; docs/design.md 2.2)."""
    cfg = load_config("tiny", DEFAULTS_MODEL)
    rows = cfg.train.global_batch // g.size("data", "z") * cfg.model.seq_len
    lins = model_spec(cfg.model, g).linears()
    return any(_chunks(x, g, rows) > 1 for x in lins)


def _chunks(x, g: Grid, rows: int) -> int:
    a_in, a_out = x.axes()
    return x.fwd_chunks(g.size(a_in), rows, x.n / g.size(a_out), g.size(a_out), x.k / g.size(a_in))


def _check_defaults(res: list[dict]) -> None:
    bad = []
    for rank, per in enumerate(res):
        for spec, r in per.items():
            if rank == 0:
                print(f"defaults {spec:10s} {r}")
            where, g = f"rank {rank} grid {spec}", Grid.parse(spec)
            if not (r["loss_equal"] and r["max_weight_diff"] == 0.0 and r["bytes_equal"] and r["calls_equal"]):
                bad.append(f"{where}: overlap on and off differ: {r}")
            if (g.x > 1) != (g.y > 1) and not r["deferred_dw"] > 0:
                bad.append(f"{where}: no dW GEMM deferred behind a dX all-reduce: {r}")
            if (r["chunks"] > 0) != _chunked(g):
                bad.append(f"{where}: forward row chunks {r['chunks']}, the model facts say {_chunked(g)}: {r}")
            if g.data > 1 and not (r["gathers_at_use"] > 0 and r["gathers_at_use_off"] == 0):
                bad.append(f"{where}: the weight all-gathers did not run behind the next forward: {r}")
    assert not bad, "\n".join(bad)


@pytest.mark.dist
def test_default_settings_overlap_on_off_identical_two_ranks():
    """Default settings on 2 ranks: x=2 and y=2 (forward all-reduces in row chunks, the dW GEMMs
    of the layers without a dX all-reduce deferred behind the next one's), data=2 ('auto'
    buckets, the sharded optimizer whose weight all-gathers run behind the next forward): overlap
    on and off bit-identical."""
    _check_defaults(run_on_ranks(2, "tests.dist.cases_overlap:defaults", 600, ["x=2", "y=2", "data=2"]))


@pytest.mark.dist
def test_default_settings_overlap_on_off_identical_four_ranks():
    """The same with data-parallel buckets over deferred dW GEMMs (a deferred weight is final only
    once its GEMM ran, although autograd's hook fires when its backward returned no gradient)."""
    _check_defaults(run_on_ranks(4, "tests.dist.cases_overlap:defaults", 600, ["data=2,x=2", "data=2,y=2"]))


@pytest.mark.dist
def test_tuner_agrees_across_ranks_and_reuses_cache(tmp_path):
    cache = str(tmp_path / "tuner.json")
    res = run_on_ranks(2, "tests.dist.cases_overlap:tuner", 300, "z=2", cache)
    r0, r1 = res
    assert r0["on"]["decisions"] == r1["on"]["decisions"], "ranks chose different GEMM variants"
    assert r0["on"]["timed"] > 0 and r0["on"]["loaded"] == 0
    assert r0["again"]["timed"] == 0, "second run re-timed although the cache had every key"
    assert r0["again"]["loaded"] >= r0["on"]["timed"]
    assert r0["again"]["decisions"] == r0["on"]["decisions"]
    assert (tmp_path / "tuner.json").exists()
    for r in res:
        for label in ("on", "again"):
            print(
                f"tuner {label}: timed {r[label]['timed']} loaded {r[label]['loaded']} "
                f"rel loss {r[label]['max_rel_loss']:.1e} rel weight {r[label]['max_rel_weight']:.1e}"
            )
            assert r[label]["max_rel_loss"] <= TUNER_TOL
            assert r[label]["max_rel_weight"] <= TUNER_TOL


@pytest.mark.dist
def test_compiled_blocks_with_collectives():
    """torch.compile of each block around the eager Linear3D/LayerNorm collectives (aot_eager: the
    graph capture and autograd split, without a C++ build) gives the eager losses."""
    res = run_on_ranks(4, "tests.dist.cases_overlap:compiled", 600, "x=2,z=2", "aot_eager")
    for r in res:
        assert r["max_rel_loss"] <= TUNER_TOL, r
        assert r["compiled_stats"].get("stale", 0) == 0 and r["compiled_stats"]["hits"] > 0
    print(f"compiled vs eager: max rel loss diff {res[0]['max_rel_loss']:.1e}; prefetch {res[0]['compiled_stats']}")
