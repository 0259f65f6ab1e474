"""Perf-model features matched to the implementation (fp32 sizes, unpadded embedding,
bookkeeping scalars, gradient accumulation, per-collective links, CPU-host terms) and the
pure parts of bench.bytes_check / bench.validate_perfmodel."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from axo4d.config import ModelConfig
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid
from axo4d.facts.spec import Dtypes
from bench import bytes_check as B
from bench import validate_measure as VPM
from bench import validate_perfmodel as VP
from bench import validate_predict as VPP
from bench import validation_stats as VS
from perfmodel.machine import MachineError, load_machine, machine_from_dict
from perfmodel.model import estimate

M = ModelConfig(n_layer=2, n_embd=64, n_head=8, vocab_size=260, seq_len=32, vocab_multiple=8)


def test_fp32_dtypes_double_activation_and_weight_bytes():
    g = Grid(x=2, y=2, z=2)
    bf, fp = (
        estimate(M, g, 8, load_machine("perlmutter"), dtypes=d).bytes_per_rank
        for d in (Dtypes(), Dtypes.for_compute("fp32"))
    )
    assert fp[("z", "all_gather")] == 2 * bf[("z", "all_gather")]
    assert fp[("z", "reduce_scatter")] == bf[("z", "reduce_scatter")]  # gradients fp32 either way
    with pytest.raises(ValueError):
        Dtypes.for_compute("fp8")


def test_embedding_is_unpadded_and_head_is_padded():
    g = Grid(y=4)  # head vocabulary padded to 288
    assert model_spec(M, g).vocab == 288
    other = model_spec(M, g).local_params()["other"]
    assert other == pytest.approx(M.n_layer * (4 * 64 + 3 * 64 / 4 + 64 + 4 * 64 / 4 + 64) + 2 * 64 + (260 + 32) * 64)


def test_bookkeeping_scalars_and_grad_accum():
    g = Grid(data=2, x=2, y=2)
    e = estimate(M, g, 8, load_machine("perlmutter"))
    assert e.bytes_per_rank[("x,y,z", "all_reduce")] == 8 and e.calls_per_rank[("x,y,z", "all_reduce")] == 1
    nb = dataclasses.replace(M, bias=False)
    assert ("y",) not in model_spec(nb, g).split_axes() and ("y",) in model_spec(M, g).split_axes()
    e2 = estimate(M, g, 16, load_machine("perlmutter"), grad_accum=2)
    assert e2.bytes_per_rank[("x", "all_reduce")] == 2 * e.bytes_per_rank[("x", "all_reduce")] - 8
    assert e2.bytes_per_rank[("data", "all_reduce")] == e.bytes_per_rank[("data", "all_reduce")]
    assert "grad_accum" in estimate(M, g, 9, load_machine("perlmutter"), grad_accum=2).reason


CPU = {
    "name": "cpu",
    "gpus_per_node": 4,
    "device_memory_gb": 16,
    "gemm_tflops": 0.04,
    "gemm_efficiency": 1.0,
    "latency_us": 1000,
    "bandwidth": [
        {
            "stride": [1, None],
            "size": [2, None],
            "gbps": 0.1,
            "by_kind": {"reduce_scatter": {"gbps": 0.05, "latency_us": 2000}},
        }
    ],
}


def test_by_kind_links_and_host_terms(tmp_path):
    m = machine_from_dict(CPU)
    assert m.bandwidth(1, 2) == 0.1 and m.bandwidth(1, 2, kind="reduce_scatter") == 0.05
    assert m.latency_s(1, 2, "reduce_scatter") == pytest.approx(2e-3) and m.latency_s(1, 2, "all_gather") == 1e-3
    g = Grid(z=8)
    base = estimate(M, g, 8, m)
    host = estimate(M, g, 8, machine_from_dict(dict(CPU, op_overhead_us=20, memory_gbps=4, overlap_efficiency=0)))
    assert host.compute_detail["other_s"] > 0 and base.compute_detail["other_s"] == 0
    assert base.exposed_comm_s < base.comm_total_s
    # overlap_efficiency 0 (a legacy CPU file): every slowdown 2, nothing hides -- what the compute
    # stream does not wait for, it loses to contention
    assert host.step_time_s == pytest.approx(host.compute_s + host.comm_total_s, rel=1e-9)
    assert host.exposed_comm_s + host.contention_s == pytest.approx(host.comm_total_s, rel=1e-9)
    path = tmp_path / "m.yaml"
    from perfmodel.machine import dump_machine

    dump_machine(machine_from_dict(dict(CPU, op_overhead_us=20)), path)
    again = load_machine(str(path))
    assert again.bandwidth(3, 5, kind="reduce_scatter") == 0.05 and again.op_overhead_us == 20
    with pytest.raises(MachineError, match="by_kind entry 'broadcast' must be one of"):
        machine_from_dict(dict(CPU, bandwidth=[dict(CPU["bandwidth"][0], by_kind={"broadcast": {"gbps": 1}})]))


def test_bytes_check_pure_parts():
    assert B.group_key("z+data") == "data,z" and B.group_key("x+y+z") == "x,y,z"
    rows = B.compare({"x:all_reduce": 10}, {"x:all_reduce": 10, "y:all_reduce": 4})
    assert rows[-1] == ("total", 10.0, 14.0) and ("y:all_reduce", 0.0, 4.0) in rows
    from axo4d.config import load_config

    assert len(B.feasible_specs(load_config(B.CONFIG, list(B.OVERRIDES)))) == 20


def test_spearman_ranks_and_median(tmp_path):
    assert VS.ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]
    assert VS.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert VS.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert VS.spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    f = tmp_path / "metrics.jsonl"
    f.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"step": 0, "step_time_s": 9.0},
                {"step": 1, "step_time_s": 1.0},
                {"step": 2, "step_time_s": 3.0},
                {"val_loss": 1.0},
            ]
        )
    )
    assert VS.median_step_time(f, 1) == (2.0, [1.0, 3.0])
    f.write_text(
        json.dumps({"step": 5, "step_time_s": 7.0, "warmup": True})
        + "\n"
        + json.dumps({"step": 6, "step_time_s": 5.0, "warmup": False})
    )
    assert VS.median_step_time(f, 0)[0] == 5.0


def test_score_and_doc_block(tmp_path):
    class E:
        def __init__(self, t, comm):
            self.step_time_s, self.compute_s, self.exposed_comm_s, self.comm_total_s = t, t / 2, t / 2, comm

    sc = VPP.score({"a": 1.0, "b": 2.0, "c": 3.0}, {"a": E(1.5, 3.0), "b": E(1.0, 2.0), "c": E(4.0, 1.0)})
    assert sc["measured_best"] == "a" and sc["predicted_top2"] == ["b", "a"] and sc["best_in_top2"]
    assert sc["spearman"] == pytest.approx(0.5)
    assert sc["baseline_spearman"] == pytest.approx(-1.0) and sc["baseline_top2"] == ["c", "b"]
    assert not sc["baseline_best_in_top2"]
    assert sc["log_ratio_mean"] == pytest.approx((math.log(1.5) + math.log(0.5) + math.log(4 / 3)) / 3)
    # pairs: (b, a) predicted 1.5x apart and measured a < b: misordered; (a, c), (b, c) right
    assert sorted(VS.misordered([1.5, 1.0, 4.0], [1.0, 2.0, 3.0])) == [(1.5, False), (8 / 3, True), (4.0, True)]
    doc = tmp_path / "v.md"
    doc.write_text("# T\n\nintro\n")
    VP.write_doc(doc, "one")
    VP.write_doc(doc, "two")
    text = doc.read_text()
    assert text.startswith("# T\n\nintro") and "two" in text and "one" not in text and text.count(VP.BEGIN) == 1


def test_sweep_order_and_dirs(tmp_path):
    from bench.perfmodel_sweep import grid_dir, visit_order

    assert visit_order(["a", "b", "c"], 0) == ["a", "b", "c"] and visit_order(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert grid_dir(tmp_path, "data=2,x=4").name == "data2_x4"


def test_validation_configurations_and_freeze(tmp_path):
    specs = VPM.feasible_specs([], 4)
    assert len(specs) == 10 and VPP.configurations(specs, "default", []) == specs
    both = VPP.configurations(specs, "traffic", [])
    # with the split layout (issue 31) x and y move the same bytes, so a traffic order may equal the
    # default on every grid of this sweep: each configuration added is a grid with its order
    assert set(specs) <= set(both) and all("|" in c and c.split("|")[0] in specs for c in set(both) - set(specs))
    grid, _, order = next((c for c in both if "|" in c), "x=2,z=4|z,x,y,data").partition("|")
    from bench.perfmodel_sweep import grid_dir, split_spec

    assert split_spec(f"{grid}|{order}") == (grid, [f"parallel.order={order}"])
    assert grid_dir(tmp_path, "x=2,z=4|z,x,y,data").name == "x2_z4-zxydata"
    rec = VPP.frozen_record()
    assert "perfmodel/timeline.py" in rec and all(len(v) == 16 for v in rec.values())
    yml = VPP.model_yaml(tmp_path / "m.yaml")
    from axo4d.config import load_config

    assert load_config(str(yml)).model.n_embd == 128


def test_bytes_check_moe_cases_and_balanced_routing():
    """``--moe``: 13 grids of 8 ranks with experts over 2 or 4 data ranks; the balanced routing gives
    every expert exactly k*N/E of a rank's N tokens' slots, distinct experts per token, and the
    router's gates (moe-tiny on one process, one forward)."""
    import torch

    from axo4d.config import load_config
    from axo4d.dist.comm import Comm
    from axo4d.models import build_model
    from axo4d.nn.context import LayerContext
    from axo4d.nn.schedule import Schedule
    from bench import bytes_moe as BM

    cases = BM.moe_cases(B._parser().parse_args(["--moe"]), 8)
    assert len(cases) == 13 and {c[1][-1] for c in cases} == {"parallel.expert=2", "parallel.expert=4"}
    assert B._label({"spec": "data=4,x=2,y=1,z=1", "overrides": ["parallel.expert=2"]}) == "data=4(ep=2),x=2,y=1,z=1"
    cfg = load_config(BM.MOE_CONFIG, list(BM.MOE_OVERRIDES))
    comm = Comm(Grid(), 0, init_groups=False)
    model = build_model(cfg.model, LayerContext(comm, Schedule(comm)), seed=1)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    layers = [m for m in model.modules() if type(m).__name__ == "MoE"]
    gates, chosen = layers[0].route(torch.randn(64, 64))
    assert BM.balance_routing(model) == cfg.model.n_layer == len(layers)
    model(idx, idx)
    counts = torch.stack(model.router_stats.counts)  # (layers, E) (token, slot) pairs per expert
    assert torch.equal(counts, torch.full_like(counts, 2 * 32 * 2 / 8))  # 64 tokens, top-2, 8 experts
    g2, c2 = layers[0].route(torch.randn(64, 64))
    assert all(len(set(row.tolist())) == 2 for row in c2) and torch.allclose(g2.sum(-1), torch.ones(64))
    assert not torch.equal(c2, chosen)  # the router's own choice differs
