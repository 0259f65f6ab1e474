"""The published-points check (bench.published_points): its FLOP convention, the ratios and the
stated bound decide the exit status, the baseline strips exactly the measured terms. The model
itself is replaced by fixed step times here (the real run is a benchmark, ~10 min)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from axo4d.config import model_from_name
from axo4d.facts.grid import Grid
from bench import published_points as P
from perfmodel.machine import load_machine
from perfmodel.model import step_flops


@pytest.mark.parametrize("name", ["gpt-40b", "gpt-320b"])
def test_flop_convention_is_narayanan_72(name):
    m = model_from_name(name)
    b, s, l, h, v = 2048, m.seq_len, m.n_layer, m.n_embd, m.vocab_size
    f72 = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert step_flops(m, b) == pytest.approx(f72, rel=2e-3)
    assert step_flops(m, b, checkpointing=True) == pytest.approx(f72 * 96 / 72, rel=2e-2)


def test_baseline_strips_the_measured_terms():
    base = P.baseline_machine(load_machine("frontier"))
    assert base.gemm_efficiency == 0.7 and not base.gemm_table and base.memory_gbps is None
    assert base.slowdowns()[:2] == (1.0, 1.0) and set(base.slowdowns()[2].values()) <= {1.0}


def _fake_best(ratio_of: dict[str, float]):
    """A ``best`` whose predicted throughput is ``ratio`` x published (TTS: days x ratio)."""

    def best(point, machine, batch):
        flops = step_flops(model_from_name(point.model), batch)
        r = ratio_of[point.name]
        if point.published_pflops:
            step = flops / (r * point.published_pflops * 1e15)
        else:
            step = r * point.tts_days * 86400 / (point.tts_tokens / (batch * P.SEQ))
        return SimpleNamespace(
            grid=Grid(data=point.gpus),
            step_time_s=step,
            model_flops_per_step=flops,
            flops_per_step=flops * 4 / 3,
            cached_blocks=0,
            feasible=True,
        )

    return best


def test_ratios_bound_and_exit_status(monkeypatch, capsys):
    inside = {p.name: 1.2 for p in P.POINTS}
    monkeypatch.setattr(P, "best", _fake_best(inside))
    row = P.evaluate(P.POINTS[0], 2048)
    assert row["model"]["ratio"] == pytest.approx(1.2) and row["within"]
    assert row["model"]["r96"] == pytest.approx(1.2 * 4 / 3)
    tts = P.evaluate(P.POINTS[-1], 2048)
    assert tts["model"]["days"] == pytest.approx(1.2 * 25.5) and tts["within"]
    assert P.main(["--sensitivity", ""]) == 0
    # one point just outside ln 1.5 fails the check, whatever the others do
    outside = dict(inside, **{P.POINTS[1].name: math.exp(P.BOUND) * 1.01})
    monkeypatch.setattr(P, "best", _fake_best(outside))
    assert P.main(["--sensitivity", ""]) == 1
    out = capsys.readouterr().out
    assert out.count("OUTSIDE BOUND") == 1 and "baseline" in out and "|ln r|" in out
