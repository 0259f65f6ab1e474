"""Unit tests of the performance model: formulas, machines, estimates, ranking, CLI."""

from __future__ import annotations

import json
import time

import pytest

from axo4d.config import ModelConfig, model_from_name
from axo4d.facts.grid import Grid
from perfmodel import collectives as C
from perfmodel.__main__ import main
from perfmodel.machine import MachineError, group_link, load_machine, machine_from_dict, machine_names
from perfmodel.model import estimate, rank_grids, step_flops

GIB = 2**30


# ---- collectives ----------------------------------------------------------------
def test_ring_formulas_hand_computed():
    n, bw, a = 4e9, 100.0, 1e-5  # 4 GB over 100 GB/s, 10 us per step
    assert C.all_gather_time(n, 4, bw, a) == pytest.approx(3 * a + 0.75 * 0.04)
    assert C.reduce_scatter_time(n, 4, bw, a) == pytest.approx(3 * a + 0.03)
    assert C.all_reduce_time(n, 4, bw, a) == pytest.approx(6 * a + 0.06)
    assert C.all_reduce_time(1e9, 2, 10.0, 0.0) == pytest.approx(0.1)  # 2*(1/2)*1e9/1e10
    for kind in C.KINDS:
        assert C.collective_time(kind, n, 1, bw, a) == 0.0
    assert C.ring_bytes(C.ALL_REDUCE, 800, 8) == pytest.approx(1400)
    assert C.ring_bytes(C.ALL_GATHER, 800, 8) == pytest.approx(700)
    assert C.latency_steps(C.ALL_REDUCE, 8) == 14 and C.latency_steps(C.REDUCE_SCATTER, 8) == 7
    with pytest.raises(ValueError, match="unknown collective"):
        C.collective_time("broadcast", 1, 2, 1, 0)


def test_counted_bytes_convention():
    assert C.counted_bytes(C.ALL_REDUCE, 1000, 4) == 1000  # input = output
    assert C.counted_bytes(C.ALL_GATHER, 1000, 4) == 4000  # full gathered output
    assert C.counted_bytes(C.REDUCE_SCATTER, 4000, 4) == 4000  # full pre-scatter input
    assert C.counted_bytes(C.ALL_GATHER, 1000, 1) == 0  # nothing moves
    assert C.group_name(("data", "z")) == "data,z"


# ---- machines -------------------------------------------------------------------
PERLMUTTER = {
    (1, 2): 76,
    (1, 4): 225,
    (1, 8): 80,
    (1, 64): 80,
    (2, 2): 76,
    (2, 4): 40,
    (2, 16): 40,
    (4, 2): 20,
    (8, 4): 20,
    (1024, 32): 20,
}
FRONTIER = {
    (1, 2): 129,
    (1, 4): 52,
    (1, 8): 135,
    (1, 16): 40,
    (2, 2): 50,
    (2, 4): 72,
    (2, 8): 20,
    (4, 2): 36,
    (4, 4): 10,
    (4, 64): 10,
    (8, 2): 5,
    (64, 8): 5,
}


@pytest.mark.parametrize("name,table", [("perlmutter", PERLMUTTER), ("frontier", FRONTIER)])
def test_published_bandwidths(name, table):
    m = load_machine(name)
    for (stride, size), gbps in table.items():
        assert m.bandwidth(stride, size) == gbps, (name, stride, size)


def test_machine_specs():
    assert machine_names() == ["alps", "frontier", "perlmutter"]
    p, f, a = (load_machine(n) for n in ("perlmutter", "frontier", "alps"))
    assert (p.gpus_per_node, p.device_memory_gb, p.gemm_tflops) == (4, 40, 280)
    assert (f.gpus_per_node, f.device_memory_gb, f.gemm_tflops) == (8, 64, 125)
    assert (a.gpus_per_node, a.device_memory_gb, a.gemm_tflops) == (4, 96, 813)
    assert "estimated from published link rates" in a.source
    assert p.gemm_efficiency == 0.9 and p.latency_s(1, 2) == pytest.approx(5e-6)
    for m in (p, f, a):  # documented defaults where nothing was measured (see the files' comments)
        assert m.gemm_half_dim == 128 and m.memory_gbps > 1000 and m.uncertainty == 0.15
        assert m.slowdowns() == (1.1, 1.1, {"intra": 1.3, "inter": 1.8, "mixed": 1.0})


def test_fewer_gpus_per_node_caps_crossing_groups():
    m = load_machine("perlmutter")
    assert m.bandwidth(1, 2, gpus_per_node=2) == 76  # inside a 2-GPU node
    assert m.bandwidth(1, 4, gpus_per_node=2) == 20  # spans two nodes: inter-node
    with pytest.raises(MachineError, match="4 GPUs per node"):
        m.check_gpus_per_node(8)


def test_group_link_uses_grid_order():
    g = Grid(data=2, x=2, y=2, z=2)
    assert group_link(g, ("x",)) == (1, 2) and group_link(g, ("y",)) == (2, 2)
    assert group_link(g, ("data", "z")) == (4, 4)  # fastest axis z, total size 4
    g2 = Grid(data=2, x=2, y=2, z=2, order=("z", "data", "x", "y"))
    assert group_link(g2, ("data", "z")) == (1, 4) and group_link(g2, ("y",)) == (8, 2)


def test_machine_loader_errors(tmp_path):
    with pytest.raises(MachineError, match="known machines: alps, frontier, perlmutter"):
        load_machine("nosuch")
    with pytest.raises(MachineError, match="does not exist"):
        load_machine(str(tmp_path / "x.yaml"))
    good = load_machine("perlmutter").to_dict()
    assert machine_from_dict(good).bandwidth(1, 4) == 225
    bad = dict(good)
    del bad["gemm_tflops"], bad["latency_us"]
    with pytest.raises(MachineError, match="missing key.*'gemm_tflops'.*'latency_us'"):
        machine_from_dict(bad)
    with pytest.raises(MachineError, match="unknown key 'color'"):
        machine_from_dict(dict(good, color=1))
    with pytest.raises(MachineError, match="no entry matches stride 2, size 2"):
        machine_from_dict(dict(good, bandwidth=[{"stride": 1, "size": [2, None], "gbps": 1}]))
    with pytest.raises(MachineError, match="bandwidth entry 0: missing key"):
        machine_from_dict(dict(good, bandwidth=[{"stride": 1, "gbps": 1}]))
    path = tmp_path / "m.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(MachineError, match="not valid YAML"):
        load_machine(str(path))


# ---- estimate: volumes by hand --------------------------------------------------
SMALL = ModelConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256, seq_len=32, vocab_multiple=8)


def test_bytes_per_rank_hand_computed():
    """2 layers, h=64, V=256 (padded to 256), s=32, B=8 on data=x=y=z=2: b = 64 rows."""
    grid = Grid(data=2, x=2, y=2, z=2)
    # the unsharded optimizer (all-reduces over data); sharded: tests/unit/test_memory.py
    e = estimate(SMALL, grid, 8, load_machine("perlmutter"), shard_optimizer=False)
    h, b, l, vp = 64, 64, 2, 256
    wblk = 12 * h * h / 4  # qkv 3h^2 + out h^2 + up 4h^2 + down 4h^2, over x*y
    head = vp * h / 4
    got = e.bytes_per_rank
    assert got[("z", "all_gather")] == 2 * 2 * (l * wblk + head)  # fwd + bwd, bf16
    assert got[("z", "reduce_scatter")] == 4 * (l * wblk + head)  # fp32 gradients
    # section 2.1: per layer a reduce-scatter of Y over its input axis and an all-gather of X over its
    # output axis in forward, the mirror in backward; bf16, so b rows x width/2 x 2 bytes = b x width
    tp = b * (3 * h + 4 * h) + b * (h + 4 * h)  # qkv, up over x (Y); proj, down (X)
    scalar = 8  # fp64 grad-norm / loss bookkeeping, one per group
    assert got[("x", "reduce_scatter")] == l * tp + b * vp  # + the LM head's logits
    assert got[("x", "all_gather")] == l * tp + b * vp
    assert got[("x", "all_reduce")] == scalar
    norm_grads = 2 * 4 * h / 2  # a LayerNorm's weight and bias gradients' y blocks gathered over y (fp32)
    y_block = b * (h + h) + b * (h + h)  # proj, down (Y); qkv, up (X): each way
    assert got[("y", "reduce_scatter")] == l * y_block + b * h  # + the LM head's dX
    assert got[("y", "all_gather")] == l * (y_block + 2 * norm_grads) + b * h + norm_grads + b * h  # + embedding
    assert got[("y", "all_reduce")] == scalar
    # norm statistics (fwd + bwd, 2 fp32 per token) and the loss's max, sum-exp and target logit over (x, y)
    assert got[("x,y", "all_reduce")] == (2 * l + 1) * 2 * 2 * b * 4 + 3 * b * 4
    assert got[("data", "all_reduce")] == 4 * (l * 12 * h * h + vp * h) / 8
    other = l * (4 * h / 2 + 3 * h / 2 + h / 2 + 4 * h / 2 + h / 2) + 2 * h / 2 + (vp + 32) * h / 2
    assert got[("data,z", "all_reduce")] == 4 * other + scalar
    assert got[("x,y,z", "all_reduce")] == scalar
    ck = estimate(SMALL, grid, 8, load_machine("perlmutter"), checkpointing=True, shard_optimizer=False).bytes_per_rank
    assert ck[("x", "reduce_scatter")] - got[("x", "reduce_scatter")] == l * 2 * b * 7 * h / 2  # recomputed Y
    assert ck[("x,y", "all_reduce")] - got[("x,y", "all_reduce")] == l * 2 * 2 * b * 4  # recomputed norms
    assert ck[("z", "all_gather")] == 1.5 * got[("z", "all_gather")] - 0.5 * 2 * 2 * head


def test_single_gpu_has_no_communication():
    e = estimate(SMALL, Grid(), 8, load_machine("perlmutter"))
    assert e.comm_total_s == 0 and e.exposed_comm_s == 0 and e.bytes_per_rank == {}
    assert e.step_time_s == pytest.approx(e.compute_s) and e.feasible


def test_step_flops_matches_design_formula():
    m = model_from_name("gpt-20b")
    B, s, l, h, V = 64, m.seq_len, m.n_layer, m.n_embd, m.vocab_size
    assert step_flops(m, B) == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)))
    assert step_flops(m, B, True) == pytest.approx(96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)))


def test_overlap_and_checkpointing_effects():
    m, mach, g = model_from_name("gpt-5b"), load_machine("perlmutter"), Grid(data=2, x=4, y=4, z=4)
    on = estimate(m, g, 64, mach)
    off = estimate(m, g, 64, mach, overlap=False)
    # eager: everything exposed but what each layer's dX all-reduce hides behind its own dW GEMM
    dx = sum(t * reps for c, reps, t in off.details if c.pool == "dx")
    assert off.comm_total_s - dx - 1e-9 <= off.exposed_comm_s < off.comm_total_s
    assert on.exposed_comm_s < off.exposed_comm_s and on.step_time_s < off.step_time_s
    assert on.comm_total_s == pytest.approx(off.comm_total_s)
    ck = estimate(m, g, 64, mach, checkpointing=True)
    assert ck.memory_bytes["activations"] < on.memory_bytes["activations"] / 5
    assert ck.compute_s > on.compute_s and ck.comm_total_s > on.comm_total_s
    mem = estimate(m, g, 64, mach, shard_optimizer=False).memory_bytes  # sharded: tests/unit/test_memory.py
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))
    assert mem["optimizer"] == 2 * mem["params"] == 2 * mem["grads"]


def test_infeasible_reasons():
    mach = load_machine("perlmutter")
    m20 = model_from_name("gpt-20b")  # 56 heads, h = 7168
    e = estimate(m20, Grid(data=4, x=2, y=16, z=2), 64, mach)
    assert not e.feasible and "n_head=56 not divisible by G_y=16" in e.reason
    e = estimate(SMALL, Grid(x=3), 8, mach)
    assert "n_embd=64 not divisible by G_x*G_y=3" in e.reason
    e = estimate(SMALL, Grid(data=4, z=4), 8, mach)
    assert "micro-batch of 8 samples not divisible by G_data*G_z=16" in e.reason
    e = estimate(model_from_name("gpt-640b"), Grid(data=8, x=8), 64, mach, checkpointing=True)
    assert not e.feasible and e.reason.startswith("memory ") and "over by" in e.reason
    with pytest.raises(ValueError, match="global batch"):
        estimate(SMALL, Grid(), 0, mach)


# ---- ranking --------------------------------------------------------------------
@pytest.mark.parametrize("machine", ["perlmutter", "frontier"])
def test_rank_reference_family(machine):
    mach = load_machine(machine)
    for name, gpus in (("gpt-5b", 64), ("gpt-80b", 2048)):
        ests = rank_grids(model_from_name(name), gpus, None, 256, mach, top=3)
        feas = [e for e in ests if e.feasible]
        assert 1 <= len(feas) <= 3, name
        assert [e.step_time_s for e in feas] == sorted(e.step_time_s for e in feas)
        assert all(e.grid.world_size == gpus for e in ests)
        assert all(e.memory_bytes["total"] <= mach.usable_memory_bytes for e in feas)
        assert all(not e.feasible for e in ests[len(feas) :])


def test_rank_32768_gpus():
    t0 = time.process_time()  # CPU seconds (the host is shared): a guard, not a benchmark
    ests = rank_grids(model_from_name("gpt-640b"), 32768, None, 2048, load_machine("frontier"))
    assert time.process_time() - t0 < 30
    assert len(ests) == 816 and ests[0].feasible and ests[0].checkpointing  # auto picked it
    assert 0 < ests[0].peak_fraction < 1


def test_rank_auto_checkpointing_only_when_needed():
    ests = rank_grids(SMALL, 8, None, 8, load_machine("perlmutter"))
    assert all(not e.checkpointing for e in ests)
    forced = rank_grids(SMALL, 8, None, 8, load_machine("perlmutter"), checkpointing=True, top=2)
    assert all(e.checkpointing for e in forced)


# ---- CLI ----------------------------------------------------------------------
RANK = ["rank", "--model", "gpt-20b", "--gpus", "128", "--batch", "64", "--machine", "perlmutter"]


def test_cli_rank_text_and_json(capsys):
    assert main(RANK + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "data=" in out and "infeasible grid(s)" in out and "n_head not divisible by G_y" in out
    assert "order search" in out and " tie " in out and "exp_data" in out
    assert main(RANK + ["--top", "2", "--json", "--no-overlap", "--checkpointing", "on", "--order", "x,y,z,data"]) == 0
    rows = json.loads(capsys.readouterr().out)
    feas = [r for r in rows if r["feasible"]]
    assert len(feas) == 2 and all(r["checkpointing"] and not r["overlap"] for r in rows)
    g = Grid.parse(feas[0]["grid"])
    assert g.world_size == 128 and feas[0]["step_time_s"] <= feas[1]["step_time_s"]
    assert set(feas[0]["comm_s"]) == {"x", "y", "z", "data"}


def test_cli_explain_and_tts(capsys):
    base = ["--model", "gpt-5b", "--batch", "64", "--machine", "alps"]
    assert main(["explain", "--grid", "data=2,x=4,y=4,z=2"] + base) == 0
    out = capsys.readouterr().out
    assert "qkv" in out and "reduce_scatter" in out and "optimizer" in out and "feasible" in out
    assert "exposed (compute stream waiting) per axis" in out and "GEMMs:" in out
    assert main(["explain", "--grid", "data=2,x=4,y=4,z=2", "--json"] + base) == 0
    assert json.loads(capsys.readouterr().out)["collectives"]
    assert main(["tts", "--tokens", "10B", "--gpus", "64", "--json"] + base) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["steps"] == -(-(10**10) // (64 * 2048)) and d["days"] > 0


@pytest.mark.parametrize(
    "argv,msg",
    [
        (
            ["rank", "--model", "nope", "--gpus", "8", "--batch", "8", "--machine", "perlmutter"],
            "unknown config 'nope'",
        ),
        (["rank", "--model", "tiny", "--gpus", "8", "--batch", "8", "--machine", "cray"], "unknown machine 'cray'"),
        (["rank", "--model", "tiny", "--gpus", "8", "--batch", "0", "--machine", "alps"], "--batch must be >= 1"),
        (
            ["explain", "--grid", "data=3", "--gpus", "8", "--model", "tiny", "--batch", "8", "--machine", "alps"],
            "has 3 ranks but the job has 8",
        ),
        (
            [
                "tts",
                "--tokens",
                "1e9",
                "--grid",
                "x=4",
                "--gpus",
                "8",
                "--model",
                "tiny",
                "--batch",
                "8",
                "--machine",
                "alps",
            ],
            "has 4 ranks but the job has 8",
        ),
        (
            ["rank", "--model", "tiny", "--gpus", "8", "--gpus-per-node", "16", "--batch", "8", "--machine", "alps"],
            "4 GPUs per node",
        ),
        (
            ["rank", "--model", "tiny", "--gpus", "8", "--batch", "8", "--machine", "alps", "--cache-weights", "most"],
            "--cache-weights 'most'",
        ),
        (
            ["explain", "--grid", "x=8", "--order", "search", "--model", "tiny", "--batch", "8", "--machine", "alps"],
            "--order search ranks grids",
        ),
    ],
)
def test_cli_errors_exit_2(capsys, argv, msg):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
