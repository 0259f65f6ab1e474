"""perfmodel's mixture-of-experts pricing (perfmodel/expert_pricing.py): experts priced on their
routed rows, E/G_ep experts a rank, the all-to-all on the expert group's link against the
machine table by hand, the expert-group size searched and printed. Cheap: moe-tiny and one
Qwen3-30B-A3B grid, single estimates."""

from __future__ import annotations

import math

import pytest

from axo4d.config import load_config
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid
from axo4d.facts.moe_memory import ExpertParallel
from axo4d.facts.parts import ALL_GATHER, ALL_REDUCE
from axo4d.facts.spec import Dtypes
from perfmodel import compute as C
from perfmodel import expert_pricing as P
from perfmodel.collectives import collective_time
from perfmodel.machine import load_machine
from perfmodel.model import estimate, rank_grids
from perfmodel.plan import Options
from perfmodel.tables import rank_text

E, K = 8, 2  # moe-tiny


def _tiny():
    return load_config("moe-tiny", [], None).model


def _experts(spec):
    return [p for p in spec.block if p.name.startswith(P.EXPERT_PREFIX)]


def test_routed_spec_keeps_a_ranks_experts_on_their_rows():
    spec = model_spec(_tiny(), Grid.parse("data=4"))
    same = P.routed_spec(spec, ExpertParallel(1))
    assert same.block == spec.block  # G_ep = 1, balanced: the spec's own k/E
    four = P.routed_spec(spec, ExpertParallel(4, 1.5))
    ex = _experts(four)
    assert sorted({p.name.split(".")[2] for p in ex}) == ["0", "1"] and len(ex) == 2 * E // 4
    assert all(p.active == pytest.approx(K * 4 * 1.5 / E) for p in ex)
    assert P.rows_of(ex[0], 100.0) == pytest.approx(100 * K * 4 * 1.5 / E)
    assert P.rows_of(spec.block[0], 100.0) == 100.0


def test_expert_gemms_and_collectives_scale_with_routed_rows():
    spec = model_spec(_tiny(), Grid.parse("data=2,x=2"))
    dt, rows = Dtypes(), 256.0
    lin = _experts(spec)[0]
    g = C.linear_gemms(lin, spec.grid, P.rows_of(lin, rows))
    assert g["fwd"][0] == rows * K / E  # M of the forward GEMM: the routed rows
    colls = P.micro_collectives(spec, rows, dt, False, 0)
    full = spec.collectives(rows, dt, False, 0)
    mine = [c for c in colls if c.layer == lin.name]
    whole = [c for c in full if c.layer == lin.name]
    assert len(mine) == len(whole) == 7
    for a, b in zip(mine, whole):  # weight blocks over z: whole; activations over x, y: routed rows
        assert a.nbytes == (b.nbytes if a.axes == ("z",) else b.nbytes * K / E), (a, b)
    dense = [c for c in colls if not c.layer.startswith(P.EXPERT_PREFIX)]
    assert dense == [c for c in full if not c.layer.startswith(P.EXPERT_PREFIX)]


def test_a2a_seconds_by_hand():
    spec = model_spec(_tiny(), Grid.parse("data=8"))
    m, dt, rows = load_machine("alps"), Dtypes(), 1024.0
    o = Options(checkpointing=True, grad_accum=2)
    assert P.a2a_seconds(spec, rows, dt, ExpertParallel(1), m, 4, o) == 0.0
    ep = ExpertParallel(4)
    stride = spec.grid.stride("data")
    gbps, alpha = m.bandwidth(stride, 4, 4, ALL_GATHER), m.latency_s(stride, 4, ALL_GATHER)
    elems = 2 * K * rows * 64 * 3 / 4  # dispatch + combine, C_l = 64, (G_ep-1)/G_ep
    per_pass = elems * dt.act / (gbps * 1e9) + 2 * 3 * alpha
    assert P.a2a_seconds(spec, rows, dt, ep, m, 4, o) == pytest.approx(per_pass * 3 * 2 * 2)  # 3 passes, L, accum
    assert P.a2a_bytes(spec, rows, dt, ep, o) == pytest.approx(elems * dt.act * 3 * 2 * 2)


def test_estimates_with_expert_groups():
    m = load_machine("alps")
    cfg = load_config("qwen3-30b-a3b", [], None).model
    g = Grid.parse("data=64,z=4")
    one, eight = (estimate(cfg, g, 512, m, expert=d, z_split="sequence") for d in (1, 8))
    assert one.expert == 1 and eight.expert == 8
    assert eight.memory_bytes["params"] < one.memory_bytes["params"] / 4  # experts are most of the weights
    assert eight.exposed_by_axis["data"] > 0
    bad = estimate(cfg, g, 512, m, expert=3, z_split="sequence")
    assert not bad.feasible and "parallel.expert=3" in bad.reason
    assert P.grid_label("data=16,x=2", 8) == "data=16(ep=8),x=2" and P.grid_label("data=4", 1) == "data=4"


def test_rank_searches_the_expert_group():
    """moe-tiny on 4 ranks: every grid tried with each valid G_ep; the table shows the chosen one."""
    m = load_machine("alps")
    ests = rank_grids(_tiny(), 4, 4, 8, m, order="x,y,z,data", z_split="batch")
    assert {e.expert for e in ests} <= {1, 2, 4}
    by_grid = {}
    for d in (1, 2, 4):
        e = estimate(_tiny(), Grid.parse("data=4"), 8, m, expert=d, gpus_per_node=4)
        by_grid[d] = e.step_time_s
    best = next(e for e in ests if e.grid.spec() == "data=4,x=1,y=1,z=1")
    assert best.step_time_s == pytest.approx(min(by_grid.values()))
    text = rank_text(ests, "h")
    assert (f"data=4(ep={best.expert})" in text) == (best.expert > 1)


def test_ep_points_bench_smoke(capsys):
    """bench/moe_ep_points on Mixtral's grid on one machine: one line per valid G_ep (E = 8)."""
    from bench.moe_ep_points import main

    assert main(["--machine", "alps", "--model", "mixtral-8x7b=data=8,x=2,z=4"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split()[2] for ln in lines] == ["data=8,x=2,z=4"] + [f"data=8(ep={d}),x=2,z=4" for d in (2, 4, 8)]


def test_expert_gradients_priced_over_edp_with_its_link():
    """Each expert's gradient is summed over the ranks holding copies of it (``edp``: every G_ep-th
    data rank, G_data/G_ep of them), not over all data ranks, on that group's link; the rest of the
    gradients still over data. moe-tiny on data=8 (4 GPUs a node), unsharded optimizer (one
    all-reduce per bucket), experts over 1 and then 2 ranks (one process: the data-parallel records
    of one grid are not shared between expert-group sizes)."""
    m, g, gpn = load_machine("alps"), Grid.parse("data=8"), 4
    one, two = (estimate(_tiny(), g, 8, m, expert=d, gpus_per_node=gpn, shard_optimizer=False) for d in (1, 2))
    spec = model_spec(_tiny(), g)
    experts = spec.n_layer * sum(math.prod(pl.full_shape) for n, pl, _ in spec.placements() if "experts" in n)
    assert experts == 2 * E * (64 * 64 + 32 * 64)
    grad = Dtypes().grad
    assert ("edp", "all_reduce") not in one.bytes_per_rank
    assert two.bytes_per_rank[("edp", "all_reduce")] == experts // 2 * grad  # the rank's E/2 experts
    assert one.bytes_per_rank[("data", "all_reduce")] - two.bytes_per_rank[("data", "all_reduce")] == experts * grad
    edp = [(c, t) for c, _, t in two.details if c.axes == ("edp",)]
    assert edp and all(c.kind == ALL_REDUCE for c, _ in edp)
    stride, p = g.stride("data") * 2, 4  # ranks 0, 2, 4, 6 hold copies of rank 0's experts
    bw, alpha = m.bandwidth(stride, p, gpn, ALL_REDUCE), m.latency_s(stride, p, ALL_REDUCE)
    assert bw != m.bandwidth(g.stride("data"), 8, gpn, ALL_REDUCE) or alpha != m.latency_s(1, 8, ALL_REDUCE)
    for c, t in edp:
        assert t == pytest.approx(collective_time(ALL_REDUCE, c.nbytes, p, bw, alpha))


def test_all_to_all_records_counted_per_rank():
    """The facts' all-to-alls (counts, dispatch and combine forward, the two backward) in the
    estimate's bytes and calls: moe-tiny on data=8 with experts over 2 ranks, bf16, 32 rows a rank."""
    e = estimate(_tiny(), Grid.parse("data=8"), 8, load_machine("alps"), expert=2, gpus_per_node=4)
    rows_bytes = K * 32 * 64 * 2  # k * b rows of C/(x*y) features, 2 bytes
    assert e.bytes_per_rank[("ep", "all_to_all")] == 2 * (E * 8 + 4 * rows_bytes)  # 2 layers
    assert e.calls_per_rank[("ep", "all_to_all")] == 2 * 5
    assert ("ep", "all_to_all") not in estimate(_tiny(), Grid.parse("data=8"), 8, load_machine("alps")).bytes_per_rank
