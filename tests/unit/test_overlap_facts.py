"""Issue 26's pieces that need no process group: the bucket rule ('auto') and its plan, shared by
the schedule and the performance model; compute alone and communication alone of a step
(bench.overlap_probe); the model's pricing of overlap per link class, of the sharded optimizer's
weight gathers behind the next forward, and of deferred dW GEMMs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from axo4d.config import ConfigError, check_values, load_config, model_from_name
from axo4d.dist.comm import Comm
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid
from axo4d.facts.schedule_rules import (
    MAX_BUCKET_BYTES,
    MIN_BUCKET_BYTES,
    auto_bucket_bytes,
    bucket_limit,
    plan_buckets,
)
from axo4d.facts.spec import Dtypes
from axo4d.models import build_model
from axo4d.nn.context import LayerContext
from axo4d.nn.overlap_schedule import make_schedule
from bench.overlap_probe import NullComm, Recorder, ideal_ratio
from perfmodel import costs
from perfmodel import timeline as S
from perfmodel.engine import Compute, Issue, Task, Wait, simulate
from perfmodel.machine import MachineError, load_machine, machine_from_dict
from perfmodel.model import estimate

MID = dataclasses.replace(model_from_name("tiny"), n_embd=512, n_head=8, seq_len=256)
FP32 = Dtypes.for_compute("fp32")


# ---- the bucket rule -------------------------------------------------------------------------------
def test_auto_bucket_size_is_a_quarter_block_between_the_floor_and_the_cap():
    assert auto_bucket_bytes(40 * 2**20, 2) == 10 * 2**20
    assert auto_bucket_bytes(1.0, 2) == 2 * MIN_BUCKET_BYTES  # the floor grows with the group
    assert auto_bucket_bytes(1.0, 16) == 16 * MIN_BUCKET_BYTES
    assert auto_bucket_bytes(1e12, 2) == MAX_BUCKET_BYTES
    spec = model_spec(MID, Grid(data=2))
    limit = bucket_limit("auto", spec)
    block = 12 * 512 * 512 * 4  # the block's four weights, fp32 (biases are in the other group)
    assert limit(("data",)) == pytest.approx(block / 4)
    assert limit(("z", "data")) == 2 * MIN_BUCKET_BYTES  # norms and biases: a small block share
    assert bucket_limit("2", spec)(("data",)) == 2 * 2**20 == bucket_limit(2.0, spec)(("z", "data"))


def test_plan_closes_a_bucket_at_its_limit_per_group():
    items = [(0, ("a",), 3.0), (1, ("b",), 5.0), (2, ("a",), 1.0), (3, ("a",), 4.0), (4, ("a",), 1.0)]
    assert plan_buckets(items, lambda axes: 4.0) == [(("a",), [0, 2]), (("a",), [3]), (("a",), [4]), (("b",), [1])]


@pytest.mark.parametrize("value", ["auto", "25", "0.5", 3])
def test_bucket_setting_accepted(value):
    check_values(load_config("tiny", [f"parallel.dp_bucket_mb={value}"]))


@pytest.mark.parametrize("value", ["0", "-1", "big", "inf"])
def test_bucket_setting_rejected_in_one_line(value):
    with pytest.raises(ConfigError, match=r"parallel.dp_bucket_mb=.*valid: auto, or a size in MiB > 0"):
        check_values(load_config("tiny", [f"parallel.dp_bucket_mb={value}"]))


@pytest.mark.parametrize("grid", ["data=2", "data=2,z=2", "data=2,x=2,y=2", "z=2"])
@pytest.mark.parametrize("setting", ["auto", "0.05"])
def test_schedule_and_model_plan_the_same_buckets(grid, setting):
    """The buckets the schedule plans over a built model's parameters are the model's (axes,
    elements per bucket, in order), so the calls the model prices are the calls made."""
    g = Grid.parse(grid)
    comm = Comm(g, 0, init_groups=False)
    spec = model_spec(MID, g)
    sched = make_schedule(comm, True, bucket_limit(setting, spec), shard=True)
    build_model(MID, LayerContext(comm, sched, None, None), seed=None)
    got = [(tuple(b.axes), sum(p.numel() for p in b.params)) for b in sched.bucket_plan()]
    want = [(tuple(axes), int(n)) for axes, _, n in costs.dp_buckets(spec, setting)]
    assert got == want and got
    if setting == "auto" and grid == "data=2":
        assert sum(1 for a, _ in got if a == ("data",)) >= 4 * MID.n_layer - 1  # several: overlap starts early


# ---- compute alone, communication alone ----------------------------------------------------------------
@pytest.mark.parametrize("grid", ["z=2", "x=2,y=2", "data=2"])
def test_null_comm_runs_the_step_and_the_recorder_sees_every_call(grid, tmp_path, monkeypatch):
    """A trainer on a NullComm runs a step of any grid in one process; the recorder sees the
    collectives the model says a step issues (kind and group, calls)."""
    from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
    from axo4d.training.trainer import Trainer

    monkeypatch.setenv("AXO4D_CACHE", str(tmp_path))
    sets = ["parallel.tuner=false", "parallel.shard_optimizer=false", "train.steps=2"]
    sets += ["model.n_embd=256", "model.seq_len=128", "train.global_batch=16"]  # forward all-reduces in chunks
    cfg = load_config("tiny", sets, grid)
    prepare_tokens(cfg.data)
    ds = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    comm = NullComm(Grid.parse(grid), 0)
    tr = Trainer(cfg, comm, ds, torch.device("cpu"))
    rec = Recorder(comm)
    rec.start()
    loss = tr.step(0).loss
    calls = rec.stop()
    assert torch.isfinite(torch.tensor(loss))
    m = load_machine("perlmutter")
    e = estimate(cfg.model, Grid.parse(grid), cfg.train.global_batch, m, dtypes=FP32, shard_optimizer=False)
    want: dict[tuple[str, str], int] = {}
    for (group, kind), n in e.calls_per_rank.items():
        key = (kind, ",".join(sorted(group.split(","))))
        want[key] = want.get(key, 0) + n
    got: dict[tuple[str, str], int] = {}
    for c in calls:
        key = (c.kind, ",".join(sorted(c.axes)))
        got[key] = got.get(key, 0) + 1
    assert got == want
    if "x=2" in grid:
        assert tr.model.schedule.stats["chunks"] > 0  # overlapped (the default): the chunks' reduce-scatters in flight
        assert want[("reduce_scatter", "x")] > 2 * cfg.model.n_layer * 2  # the forward outputs in chunks


def test_ideal_ratio():
    assert ideal_ratio(1.0, 1.0) == 0.5 and ideal_ratio(1.0, 3.0) == 0.75 and ideal_ratio(0.0, 2.0) == 1.0


# ---- the model: overlap per link class, gathers behind the next forward, deferred dW ----------------------
def _mach(**kw):
    base = load_machine("perlmutter").to_dict()
    base.update(kw)
    return machine_from_dict(base)


def test_slowdowns_per_link_class():
    m = _mach(compute_slowdown_by_link={"intra": 2.0, "inter": 1.0}, comm_slowdown_by_link={"inter": 1.25})
    assert m.link_slowdowns()[:2] == ({"intra": 2.0, "inter": 1.0}, {"intra": m.comm_slowdown, "inter": 1.25})
    assert machine_from_dict(m.to_dict()).link_slowdowns() == m.link_slowdowns()
    with pytest.raises(MachineError, match="compute_slowdown_by_link must map intra and/or inter"):
        _mach(compute_slowdown_by_link={"mixed": 2.0})
    wire = Task(("z",), "z", "inter", 0.0, 0.5)
    cores = Task(("z",), "z", "intra", 0.0, 0.5)
    by = ({"intra": 2.0, "inter": 1.0}, {"intra": 2.0, "inter": 1.0})
    assert simulate([Issue(wire), Compute(1.0), Wait(wire)], *by).time == pytest.approx(1.0)  # hides
    assert simulate([Issue(cores), Compute(1.0), Wait(cores)], *by).time == pytest.approx(1.5)  # shares


def test_z_prefetch_hides_behind_compute_when_the_wire_takes_no_processor():
    """The cause of the z over-prediction: 'nothing hides' (every slowdown 2) charged the
    prefetched z gathers over a link between nodes as if they took the cores."""
    g = Grid(z=2)
    rule = _mach(compute_slowdown=2.0, comm_slowdown=2.0)
    wire = _mach(compute_slowdown_by_link={"inter": 1.0}, comm_slowdown_by_link={"inter": 1.0})
    kw = dict(gpus_per_node=1, dtypes=FP32)
    off = estimate(MID, g, 16, rule, overlap=False, **kw).step_time_s
    assert estimate(MID, g, 16, wire, overlap=False, **kw).step_time_s == pytest.approx(off)
    on_rule = estimate(MID, g, 16, rule, **kw).step_time_s
    on_wire = estimate(MID, g, 16, wire, **kw).step_time_s
    assert on_wire < on_rule <= off * 1.001


def test_sharded_gathers_run_behind_the_next_forward():
    m = _mach(compute_slowdown=1.0, comm_slowdown=1.0, concurrent_slowdown={"intra": 1.0, "inter": 1.0})
    kw = dict(gpus_per_node=1, dtypes=FP32, shard_optimizer=True)
    on = estimate(MID, Grid(data=2), 16, m, **kw)
    off = estimate(MID, Grid(data=2), 16, m, overlap=False, **kw)
    ag = sum(t * n for c, n, t in on.details if c.kind == "all_gather")
    assert ag > 0 and off.exposed_by_axis["data"] >= ag
    assert on.exposed_by_axis["data"] < off.exposed_by_axis["data"] - 0.5 * ag
    unsharded = estimate(MID, Grid(data=2), 16, m, **dict(kw, shard_optimizer=False))
    assert on.step_time_s <= unsharded.step_time_s * 1.02  # the same bytes, hidden as well


def test_deferred_dw_gemms_hide_more_of_the_tensor_axes(monkeypatch):
    m = _mach(compute_slowdown=1.0, comm_slowdown=1.0)
    kw = dict(gpus_per_node=1, dtypes=FP32)
    spec = model_spec(MID, Grid(x=2))
    # x alone: the pairs are turned (docs/design.md 2.2), so proj and down split their input over x
    assert [p.name for p in spec.all_linears() if S.defers_dw(spec, p)] == ["attn.proj", "mlp.down", "lm_head"]
    with_defer = estimate(MID, Grid(x=2), 16, m, **kw).step_time_s
    monkeypatch.setattr(S, "defers_dw", lambda spec, part: False)
    without = estimate(MID, Grid(x=2), 16, m, **kw).step_time_s
    assert with_defer < without
