"""The measurement tools of issue 26, without measuring: the bootstrap intervals of Spearman's rho,
the preregistered plan (configurations, the bound, the report on synthetic results), the frozen
record, the overlap table's verdicts and predictions; and, where root and network namespaces
exist, a one-step smoke run of bench.overlap on the virtual cluster."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench import overlap as OV
from bench import overlap_table as OT
from bench import validate_measure as VPM
from bench import validate_perfmodel as VP
from bench import validate_predict as VPP
from bench import validation_plan as PLAN
from bench.validation_stats import bootstrap_rho, percentiles, pooled_delta
from tests.helpers import can_netns


def _noisy(values, sd, n=12, seed=0):
    r = random.Random(seed)
    return [[v * (1 + sd * r.gauss(0, 1)) for _ in range(n)] for v in values]


def test_bootstrap_intervals_of_rho_and_of_the_margin():
    pred = [float(i) for i in range(1, 11)]
    base = [2.0, 1.0, 4.0, 3.0, 6.0, 5.0, 8.0, 7.0, 10.0, 9.0]  # swaps neighbours
    ci = bootstrap_rho(pred, base, _noisy(pred, 0.01), reps=500)
    assert ci["model"] == (1.0, 1.0, 1.0)  # well separated, tight: every replicate orders them right
    assert ci["baseline"][0] == pytest.approx(0.939, abs=1e-3) and ci["baseline"][2] < 1.0
    assert ci["delta"][1] > 0  # the margin is beyond the noise
    flat = bootstrap_rho(pred, base, _noisy([5.0] * 10, 0.3), reps=500)  # measurements that order nothing
    assert flat["model"][1] < 0 < flat["model"][2] and flat["delta"][1] < 0 < flat["delta"][2]
    assert pooled_delta([(pred, base, _noisy(pred, 0.01, seed=s)) for s in range(3)], reps=200)[1] > 0
    assert percentiles(list(range(1, 101))) == (3, 98)
    with pytest.raises(ValueError, match="three or more"):
        bootstrap_rho([1.0, 2.0], [1.0, 2.0], [[1.0], [2.0]])


def test_frozen_record_hashes_every_source_a_prediction_reads():
    rec = VPP.frozen_record()
    for f in (
        "perfmodel/timeline.py",
        "perfmodel/engine.py",
        "axo4d/facts/spec.py",
        "axo4d/facts/parts.py",
        "axo4d/facts/schedule_rules.py",
    ):
        assert f in rec, f
    assert all(len(v) == 16 for v in rec.values()) and not any("torch" in k for k in rec)


def test_heldout_configurations_are_new_and_measurable():
    built = {128, 192, 96, 512}  # hidden sizes of the earlier validations and of bench.overlap
    sizes = set()
    for name, h in PLAN.HELDOUT.items():
        sets = h["sets"]
        hidden = int(next(s for s in sets if s.startswith("model.n_embd=")).split("=")[1])
        assert hidden not in built, name
        sizes.add(hidden)
        world = h["nodes"] * h["ranks_per_node"]
        assert world <= 2 * 2, f"{name}: more than two ranks per core of a 2-core host"
        assert len(VPM.feasible_specs(sets, world)) >= 9, name
        args = PLAN.argv_of(name, Path("runs/x"))
        assert args[args.index("--rounds") + 1] == str(PLAN.ROUNDS) and args.count("--set") == len(sets)
    assert len(sizes) == len(PLAN.HELDOUT) >= 3
    assert {h["rate"] for h in PLAN.HELDOUT.values()} >= {"500mbit", "1gbit", "2gbit"}
    assert {h["nodes"] for h in PLAN.HELDOUT.values()} == {2, 4} and "traffic" in {
        h["orders"] for h in PLAN.HELDOUT.values()
    }


def test_verdict_of_the_preregistered_bound():
    good = {"H1": {"spearman": 0.9}, "H2": {"spearman": 0.85}}
    assert PLAN.verdict(good, (0.1, 0.02, 0.2)) == (True, [])
    met, why = PLAN.verdict({**good, "H3": {"spearman": 0.7}}, (0.1, -0.01, 0.2))
    assert not met and len(why) == 2 and "H3: rho 0.700" in why[0] and "reaches 0" in why[1]


def test_report_on_synthetic_results(tmp_path, capsys, monkeypatch):
    """Measured times equal to the model's own predictions: rho = 1 everywhere, the verdict as
    printed; one configuration missing makes it incomplete (fewer bootstrap replicates here)."""
    import functools

    from bench import validation_stats

    monkeypatch.setattr(PLAN, "REPS", 300)
    monkeypatch.setattr(VPP, "bootstrap_rho", functools.partial(validation_stats.bootstrap_rho, reps=300))
    for name, h in PLAN.HELDOUT.items():
        world = h["nodes"] * h["ranks_per_node"]
        pred = VPP.predict("perlmutter", h["sets"], world, h["ranks_per_node"])
        runs = {}
        for spec in VPM.feasible_specs(h["sets"], world):
            t = pred[spec].step_time_s
            runs[spec] = {"rc": 0, "median_s": t, "times": [t * (1 + 0.001 * k) for k in (-1, 0, 1)]}
        rec = {"machine_file": "perlmutter", "extra_sets": h["sets"], "nodes": h["nodes"]}
        rec.update({"ranks_per_node": h["ranks_per_node"], "runs": runs, "load_start": 0.5})
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(rec))
    a = type("A", (), {"out": str(tmp_path), "only": "", "doc": str(tmp_path / "v.md")})
    rc = PLAN.report(a)
    out = capsys.readouterr().out
    assert "| H1 |" in out and "1.000 [1.000, 1.000]" in out
    assert (rc == 0) == ("): met.**" in out) and rc in (0, 1)
    assert "issue26-validation:begin" in (tmp_path / "v.md").read_text()
    (tmp_path / "H4" / "results.json").unlink()
    assert PLAN.report(a) == 1 and "incomplete: H4 not measured" in capsys.readouterr().out


def test_measure_within_a_budget_then_resume(tmp_path, monkeypatch, capsys):
    """--budget starts only the configurations expected to fit (their expected durations scaled
    by how long the first took), in order, and names the rest; --resume then measures only those
    (a configuration is measured once every run in its results.json exited 0), expecting the rest
    to take as much longer than expected as the measured ones did; a failed one is re-run once, as
    the plan says, and counted."""
    clock, ran = [0.0], []
    monkeypatch.setattr(PLAN.time, "time", lambda: clock[0])
    monkeypatch.setattr(PLAN, "wait_quiet", lambda limit_s: 0.5)

    def fake_validate(argv):
        out = Path(argv[argv.index("--out") + 1])
        ran.append(out.name)
        clock[0] += 2 * PLAN.EXPECTED_S[out.name]  # twice as slow as expected
        out.mkdir(parents=True, exist_ok=True)
        rc = 1 if ran.count("H3") == 1 and out.name == "H3" else 0  # H3's first sweep fails: re-run once
        (out / "results.json").write_text(json.dumps({"runs": {"x=4": {"rc": rc}}}))
        return rc

    monkeypatch.setattr(VP, "main", fake_validate)
    first = 2 * PLAN.EXPECTED_S["H1"] + 2 * PLAN.EXPECTED_S["H2"]
    args = ["measure", "--out", str(tmp_path), "--budget", str(first + 1)]
    assert PLAN.main(args) == 0 and ran == ["H1", "H2"]
    assert "not measured within the budget" in capsys.readouterr().out
    ran.clear()  # a later window: H1 and H2 took twice as long as expected, so H3 is expected to as well
    tight = ["measure", "--out", str(tmp_path), "--resume", "--budget", str(2 * PLAN.EXPECTED_S["H3"] - 1)]
    assert PLAN.main(tight) == 0 and ran == [] and PLAN._attempt_record(tmp_path, "H1")["seconds"] > 0
    assert PLAN.main(["measure", "--out", str(tmp_path), "--resume"]) == 0 and ran == ["H3", "H3", "H4"]
    assert PLAN._attempts(tmp_path, "H3") == 2 and PLAN._attempts(tmp_path, "H4") == 1
    assert PLAN.measured(tmp_path, "H1") and not PLAN.measured(tmp_path, "H9")
    (tmp_path / "H1" / "results.json").write_text(json.dumps({"runs": {"x=4": {"rc": 1}}}))
    assert not PLAN.measured(tmp_path, "H1")
    assert PLAN.fits("H1", 0, 0, {}) and not PLAN.fits("H2", 0, PLAN.EXPECTED_S["H2"] * 1.5, {"H1": 600.0})


def test_overlap_table_predictions_and_verdicts():
    a = OT._parser().parse_args(["--smoke"])
    p = OT.predict(OT.model_config(a, "z=2"), "z=2", "perlmutter", 1)
    assert p["on_s"] <= p["off_s"] and 0 < p["ratio_on_off"] <= 1 and 0.5 <= p["ideal_ratio"] <= 1
    row = {"grid": "z=2", "ranks": 2, "median_s": {"off": 1.0, "on": 0.75, "compute": 0.6, "comm": 0.4}}
    row.update({"ratio_on_off": 0.75, "ideal_ratio": 0.6, "distance_to_ideal": 0.15, "load": {"before": 1, "max": 2}})
    row["predicted"] = dict(p, ratio_on_off=0.9)
    bad = OT.verdicts([row])
    assert len(bad) == 3 and "0.750 > 0.7" in bad[0] and "above the ideal" in bad[1] and "predicted" in bad[2]
    assert "| z=2 | 2 | 1000 | 750 | 0.750 |" in OT.table([row])


@pytest.mark.skipif(not can_netns(), reason="needs root with ip netns and tc")
def test_overlap_bench_smoke_on_the_virtual_cluster(tmp_path):
    """One timed step of every mode of bench.overlap on z=2 (the plumbing, not a figure)."""
    js = tmp_path / "z2.json"
    cmd = [sys.executable, "-m", "bench.overlap", "--vcluster", "--ranks", "2", "--grid", "data=2", "--json", str(js)]
    cmd += ["--n-embd", "32", "--seq", "16", "--batch", "4", "--n-layer", "1", "--steps", "1", "--warmup", "1"]
    env = dict(os.environ, PYTHONPATH=str(VPP.ROOT), AXO4D_CACHE=str(tmp_path / "cache"))
    p = subprocess.run(cmd, cwd=VPP.ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(js.read_text())
    assert set(r["median_s"]) == {"off", "on", "on_unsharded", "compute", "comm"} and r["replayed_calls"] > 0
    assert 0.5 <= r["ideal_ratio"] <= 1 and "ratio_sharded_unsharded" in r and r["weight_gathers"]["issued"] > 0
    assert r["cpu_floor"] == pytest.approx(OV.cpu_floor(r)["cpu_floor"]) and "floor with communication" in p.stdout
    assert r["denormals"] == "flushed"  # observed on the ranks' computing thread


def test_cpu_floor_counts_the_communication_cpu_on_the_core_that_computes():
    r = {"median_s": {"off": 4.0, "compute": 2.0, "comm": 1.0}, "ratio_on_off": 0.9}
    assert OV.cpu_floor(r) == {}  # no CPU times: no floor
    r["cpu_s"] = {"compute": 1.9, "comm": 0.5}
    f = OV.cpu_floor(r)
    assert f["cpu_floor"] == pytest.approx(2.4 / 4.0) and f["distance_to_cpu_floor"] == pytest.approx(0.9 - 0.6)
    r["cpu_s"] = {"compute": 1.0, "comm": 0.1}  # less CPU than compute alone's wall time: that bounds it
    assert OV.cpu_floor(r)["cpu_floor"] == pytest.approx(2.0 / 4.0)
    assert "floor with communication's own CPU" in OV.report({**_report_stub(), **r, **OV.cpu_floor(r)})


def _report_stub() -> dict:
    return {
        "ranks": 2,
        "where": "one machine",
        "threads": 1,
        "cores": 2,
        "grid": "x=2",
        "batch": 4,
        "sets": [],
        "model": {"n_layer": 1, "n_embd": 32, "seq": 16},
        "load_avg_end": 0.1,
        "bytes_per_step": 0,
        "buckets": 1,
        "sharded": False,
        "times_s": {},
        "min_s": {},
        "ratio_on_off_min": 0.9,
        "ideal_ratio": 0.67,
        "distance_to_ideal": 0.23,
        "prefetch": {},
        "weight_gathers": {},
    }
