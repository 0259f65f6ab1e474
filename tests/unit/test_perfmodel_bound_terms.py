"""The lower bound's term for a GEMM in row chunks (:mod:`perfmodel.bound_terms`): its arithmetic by
hand, and the bound with it never above a simulated program that is not extrapolated."""

from __future__ import annotations

import dataclasses

from axo4d.config import model_from_name
from axo4d.facts.grid import Grid
from axo4d.facts.spec import ALL_GATHER, REDUCE_SCATTER, Coll
from perfmodel import pruning
from perfmodel.bound_terms import segment_extra
from perfmodel.machine import load_machine
from perfmodel.one_grid import _plan_auto
from perfmodel.plan import Options, timed
from perfmodel.search import distinct_orders, with_order


def _coll(axes: str, kind: str) -> Coll:
    return Coll("l", "fwd", (axes,), kind, 1.0, 4, "chunks")


def test_segment_extra_by_hand() -> None:
    """4 chunks of a 4 s GEMM, each chunk's gather 2 s alone: the gathers in a row (8 s) and the last
    chunk (1 s) outlast the first gather and the GEMM (6 s); a reduce-scatter of 0.5 s per chunk on
    another group adds its last call, on the same group all four."""
    seconds = {("y", ALL_GATHER): 2.0, ("x", REDUCE_SCATTER): 0.5, ("y", REDUCE_SCATTER): 0.5}
    t = lambda c: seconds[(c.axes[0], c.kind)]
    ag, rs_x, rs_y = _coll("y", ALL_GATHER), _coll("x", REDUCE_SCATTER), _coll("y", REDUCE_SCATTER)
    assert segment_extra(("fwd", 4.0, 4, (ag,), (), 1), t) == 8.0 + 1.0 - 4.0
    assert segment_extra(("fwd", 4.0, 4, (ag,), (rs_x,), 1), t) == 8.0 + 1.0 + 0.5 - 4.0
    assert segment_extra(("fwd", 4.0, 4, (ag,), (rs_y,), 1), t) == 4 * (2.0 + 0.5) - 4.0
    # collectives shorter than the GEMM's chunks: the first gather and the last reduce-scatter only
    cheap = lambda c: 0.1
    assert abs(segment_extra(("fwd", 4.0, 4, (ag,), (rs_x,), 1), cheap) - 0.2) < 1e-12


def _plans():
    """Plans of 3 blocks (the timeline simulates them whole: no extrapolation), one micro-step."""
    for name, seq, batch, mach in [("llama3.1-8b", 8192, 16, "alps"), ("gpt-5b", 2048, 64, "frontier")]:
        model = dataclasses.replace(model_from_name(name), seq_len=seq, n_layer=3)
        m = load_machine(mach)
        for spec in ["data=8,x=2,y=1,z=1", "x=4,y=2,z=1", "data=1,x=2,y=4,z=1", "x=2,y=1,z=4", "data=2,x=1,y=4,z=2"]:
            g0 = Grid.parse(spec)
            for order in distinct_orders(g0)[:3]:
                for overlap in (True, False):
                    o = Options(flash_attention=True, z_split="batch", overlap=overlap)
                    yield _plan_auto(model, with_order(g0, order), batch, m, None, o)


def test_bound_without_slack_holds_on_whole_programs(monkeypatch) -> None:
    """On programs simulated whole, the bound before its extrapolation slack never exceeds the step;
    and the segments raise it above the per-record form on some of them (the term is not idle)."""
    scale = 1 - pruning.MARGIN - pruning.EXTRAPOLATION_SLACK
    plans = list(_plans())
    new = [pruning.step_bound(st)[0] / scale for st in plans]
    monkeypatch.setattr(pruning, "segments", lambda *a: None)  # the per-record form
    old = [pruning.step_bound(st)[0] / scale for st in plans]
    steps = [timed(st).step_time_s for st in plans]
    assert len(plans) >= 40
    for st, b, t in zip(plans, new, steps):
        assert b <= t, (st.grid, st.opts.overlap, b, t)
    assert all(b >= a * (1 - 1e-12) for a, b in zip(old, new))
    assert sum(b > 1.05 * a for a, b in zip(old, new)) >= 5
