"""The pruned ranking of :mod:`perfmodel.pruning`: its bound never exceeds the simulated step, and a
ranking that simulates only the grids it can show answers as one that simulates them all."""

from __future__ import annotations

import dataclasses

import pytest

from axo4d.config import model_from_name
from axo4d.facts.grid import Grid
from axo4d.facts.run import run_grid
from axo4d.facts.spec import Dtypes
from perfmodel import model as model_mod
from perfmodel import plan as plan_mod
from perfmodel import pruning
from perfmodel.machine import load_machine
from perfmodel.model import _plan_auto, estimate_auto, in_order, rank_grids
from perfmodel.plan import Options, timed
from perfmodel.tables import rank_text

# (model, seq, batch, machine, grids, options): dense and MoE models, three machines, both splits of z,
# recomputation, cached blocks, accumulation, the eager schedule, FP32, other rank orders
CASES = [
    ("gpt-5b", 2048, 64, "perlmutter", ["data=2,x=2,y=2,z=2", "x=4,y=2,z=1", "data=8", "x=2,y=1,z=4"], {}),
    ("gpt-5b", 2048, 64, "frontier", ["data=2,x=2,y=1,z=2", "data=1,x=2,y=4,z=1"], {"grad_accum": 2}),
    ("gpt-5b", 2048, 32, "perlmutter", ["data=2,x=2,y=2,z=2"], {"overlap": False}),
    ("llama3.1-8b", 16384, 32, "alps", ["data=1,x=2,y=2,z=8", "data=2,x=4,y=1,z=4"], {"cache_weights": "auto"}),
    ("llama3.1-8b", 4096, 16, "alps", ["data=2,x=2,y=2,z=2"], {"dtypes": Dtypes.for_compute("fp32")}),
    ("qwen3-30b-a3b", 4096, 64, "alps", ["data=4,x=2,y=1,z=4", "data=8,x=2,y=2,z=1"], {"expert": 4}),
]


def _plans(name: str, seq: int, batch: int, machine: str, grids: list[str], kw: dict):
    model = dataclasses.replace(model_from_name(name), seq_len=seq)
    m = load_machine(machine)
    for spec in grids:
        for order in (None, "data,z,y,x"):
            g = Grid.parse(spec, order)
            for z_split in ("batch", "sequence") if g.z > 1 else ("batch",):
                o = Options(flash_attention=True, **{**kw, "z_split": z_split})
                yield _plan_auto(model, g, batch, m, None, o)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_bound_never_exceeds_the_simulated_step(case) -> None:
    """bound <= simulated step on every grid, order and split of the sample (feasible or not), and the
    bound is not vacuous: at least the step's compute, plus its blocking collectives."""
    n = 0
    for st in _plans(*case):
        e = timed(st)
        b, comm = pruning.step_bound(st)
        assert b <= e.step_time_s, (st.grid, st.opts)
        # compute alone is a bound already (less the slack the extrapolation needs)
        assert b >= e.compute_s * (1 - pruning.EXTRAPOLATION_SLACK) * (1 - 1e-6), (st.grid, st.opts)
        assert pruning.bound_estimate(st, b, comm).comm_s == e.comm_s  # both on the axes of the grid asked
        n += 1
    assert n >= 2


@pytest.mark.parametrize("grid,batch", [("data=8,x=1,y=4,z=1", 32), ("data=8,x=2,y=2,z=1", 16)])
def test_bound_holds_where_the_extrapolation_undercuts_a_block(grid, batch) -> None:
    """Two grids where the extrapolated step is 3.8% and 3.1% below the step's compute plus its
    blocking stalls (the shorter program ends with more buckets exposed): the bound, with its slack,
    stays below the step (without the slack it did not). (Llama 3.1 8B's x-only grids were the
    examples until its LM head turned on x alone: docs/design.md 2.2.)"""
    model = dataclasses.replace(model_from_name("llama3.2-3b"), seq_len=8192)
    st = _plan_auto(model, Grid.parse(grid), batch, load_machine("alps"), None, Options(flash_attention=True))
    b, _ = pruning.step_bound(st)
    raw = b / (1 - pruning.MARGIN - pruning.EXTRAPOLATION_SLACK)
    assert b <= timed(st).step_time_s < raw


def test_no_bound_when_a_slowdown_is_below_one() -> None:
    """The proof needs every rate <= 1: a machine that speeds a collective up gets no bound (0)."""
    m = dataclasses.replace(load_machine("perlmutter"), compute_slowdown=0.9, _cache={})
    model = model_from_name("gpt-5b")
    st = _plan_auto(model, Grid.parse("data=2,x=2,y=2,z=2"), 64, m, None, Options())
    assert pruning.step_bound(st)[0] == 0.0
    assert pruning.step_bound(dataclasses.replace(st, machine=load_machine("perlmutter")))[0] > 0.0


RANKS = [
    ("gpt-5b", 32, 256, "perlmutter", {"order": "search", "top": 3}, 2),
    ("gpt-5b", 16, 64, "frontier", {"order": "x,y,z,data", "top": 4, "grad_accum": 2}, 3),
    ("llama3.1-8b", 8, 16, "alps", {"order": "search", "top": 2, "z_split": "auto", "cache_weights": "auto"}, 5),
]


@pytest.mark.parametrize("case", RANKS, ids=[f"{c[0]}-{c[1]}" for c in RANKS])
def test_pruned_ranking_is_the_full_ranking(case, monkeypatch) -> None:
    """The table, every shown estimate (all fields) and every infeasible grid's reason are the same
    with pruning as with every grid simulated (fewer simulations); grids left unsimulated are only
    infeasible ones past those shown, listed with their reasons."""
    name, gpus, batch, machine, kw, shown = case
    model = dataclasses.replace(model_from_name(name), seq_len=2048)
    m = load_machine(machine)
    kw = {"flash_attention": True, **kw}
    calls = []
    monkeypatch.setattr(plan_mod, "timed", lambda st, programs=None: calls.append(st) or timed(st, programs))
    full = rank_grids(model, gpus, None, batch, m, prune=False, **kw)
    n_full = len(calls)
    fast = rank_grids(model, gpus, None, batch, m, shown_infeasible=shown, **kw)
    assert 0 < len(calls) - n_full < n_full
    feas = [e for e in full if e.feasible]
    assert [e for e in fast if e.feasible] == feas and feas
    bad, fast_bad = [e for e in full if not e.feasible], [e for e in fast if not e.feasible]
    assert fast_bad[:shown] == bad[:shown] and not any(e.bound_only for e in fast_bad[:shown])
    assert sorted(e.reason for e in fast_bad) == sorted(e.reason for e in bad)
    assert all(e.bound_only for e in fast_bad[shown:] if e.step_time_s < float("inf"))
    assert rank_text(fast, "h", shown) == rank_text(full, "h", shown)


def test_a_failed_bound_ranks_without_pruning(monkeypatch) -> None:
    """Were a simulated step ever below its bound, the ranking is redone simulating every grid."""
    model = model_from_name("gpt-5b")
    m = load_machine("perlmutter")
    want = rank_grids(model, 4, None, 64, m, order="search", top=2, prune=False)
    real = pruning.Bounds.step_bound
    monkeypatch.setattr(pruning.Bounds, "step_bound", lambda self, st: (1e9,) + real(self, st)[1:])
    assert rank_grids(model, 4, None, 64, m, order="search", top=2, shown_infeasible=1) == want


@pytest.mark.parametrize("case", CASES[::2], ids=[f"{c[0]}-{c[3]}" for c in CASES[::2]])
def test_a_plan_in_another_order_is_the_plan_with_its_grid_replaced(case) -> None:
    """What a ranking's plans in other rank orders rely on (perfmodel.model._memo_plan)."""
    name, seq, batch, machine, grids, kw = case
    model = dataclasses.replace(model_from_name(name), seq_len=seq)
    m = load_machine(machine)
    for spec in grids:
        g = Grid.parse(spec)
        for z_split in ("batch", "sequence") if g.z > 1 else ("batch",):
            o = Options(flash_attention=True, **{**kw, "z_split": z_split})
            st = _plan_auto(model, g, batch, m, None, o)
            for order in ("data,z,y,x", "z,x,data,y"):
                g2 = Grid.parse(spec, order)
                run = run_grid(model, g2, m.gpus_per_node)
                if (run.x, run.y) != (st.spec.grid.x, st.spec.grid.y):  # x and y exchanged in one only:
                    with pytest.raises(ValueError, match="runs as"):  # another plan (_memo_plan's key)
                        in_order(st, g2)
                    continue
                assert in_order(st, g2) == _plan_auto(model, g2, batch, m, None, o)


def test_a_sequence_split_bounded_above_the_batch_split_is_not_simulated() -> None:
    """estimate_auto's ``bound`` (a pruned ranking's): the sequence split is simulated only when its
    bound does not certainly exceed the batch split's step; the answer is the same either way."""
    model = model_from_name("gpt-5b")
    g, m = Grid.parse("data=2,x=2,y=1,z=2"), load_machine("perlmutter")
    kw = {"z_split": "auto", "flash_attention": True}
    want = estimate_auto(model, g, 64, m, None, **kw)
    seen: list[str] = []

    def priced(st):
        seen.append(st.opts.z_split)
        return timed(st)

    assert estimate_auto(model, g, 64, m, None, timed=priced, bound=lambda st: 0.0, **kw) == want
    assert seen == ["batch", "sequence"]
    seen.clear()
    e = estimate_auto(model, g, 64, m, None, timed=priced, bound=lambda st: 1e9, **kw)
    assert seen == ["batch"] and e.z_split == "batch" and e.step_time_s < 1e9


@pytest.mark.parametrize(
    "name,grid,batch,kw,least",
    [
        # the z group's weight gathers and reduce-scatters are most of the step (busiest group)
        ("gpt-80b", "data=2,x=2,y=2,z=512", 2048, {}, 0.9),
        # the eager schedule's buckets after eight micro-steps' backward (data-parallel tail)
        ("gpt-5b", "data=64", 512, {"grad_accum": 8, "overlap": False}, 0.93),
    ],
)
def test_the_bound_counts_a_busy_group_and_the_data_parallel_tail(name, grid, batch, kw, least) -> None:
    """Where one group's collectives, not compute, make the step, the bound follows them (compute and
    blocking collectives alone give 0.25 and 0.87 of these steps)."""
    st = _plan_auto(model_from_name(name), Grid.parse(grid), batch, load_machine("perlmutter"), None,
                    Options(flash_attention=True, **kw))  # fmt: skip
    e = timed(st)
    b, _ = pruning.step_bound(st)
    assert least * e.step_time_s <= b <= e.step_time_s


def test_a_size_bounded_above_the_step_found_is_not_simulated() -> None:
    """``estimate_auto(limit=...)``: a plan whose bound certainly exceeds the step already found for
    the grid is not simulated (a bound comes back, above the limit); one that may be faster is."""
    model = model_from_name("gpt-5b")
    m = load_machine("perlmutter")
    g = Grid.parse("data=2,x=2,y=1,z=2")
    calls: list = []

    def priced(st):
        calls.append(st)
        return timed(st)

    want = estimate_auto(model, g, 64, m, None, timed=priced, z_split="auto")
    n = len(calls)
    e = estimate_auto(model, g, 64, m, None, timed=priced, bound=lambda st: 1e9, limit=1.0, z_split="auto")
    assert len(calls) == n and e.bound_only and e.step_time_s == 1e9
    again = estimate_auto(model, g, 64, m, None, timed=priced, bound=lambda st: 0.0, limit=1.0, z_split="auto")
    assert again == want and len(calls) > n


def test_moe_ranking_prunes_expert_group_sizes(monkeypatch) -> None:
    """A mixture-of-experts ranking: an expert-group size whose bound exceeds the step of a size
    already simulated for the grid is not simulated -- the same table, fewer simulations (93 -> 85
    here)."""
    model = dataclasses.replace(model_from_name("qwen3-30b-a3b"), seq_len=2048, n_layer=8)
    m = load_machine("alps")
    calls = []
    monkeypatch.setattr(plan_mod, "timed", lambda st, programs=None: calls.append(st) or timed(st, programs))
    kw = {"top": 3, "shown_infeasible": 2, "order": "search"}
    fast = rank_text(rank_grids(model, 16, 4, 64, m, **kw), "h", 2)
    n_fast = len(calls)
    real = model_mod.estimate_auto
    monkeypatch.setattr(model_mod, "estimate_auto", lambda *a, limit=None, **k: real(*a, **k))  # sizes not pruned
    assert rank_text(rank_grids(model, 16, 4, 64, m, **kw), "h", 2) == fast
    assert 0 < n_fast < len(calls) - n_fast
