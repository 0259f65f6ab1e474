"""The memory model (axo4d.facts.memory), its start-up check (axo4d.training.memory_plan), and the pure
parts of the sharded optimizer: owned rectangles, bucket padding, data-parallel bytes.

Every number is computed by hand from the model's parameter counts; the checks name the term
that would be wrong.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from axo4d.config import load_config
from axo4d.config.errors import ConfigError, MemoryBudgetError, TrainError
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid
from axo4d.facts.memory import Setup, auto_fraction, memory, owned_elements
from axo4d.facts.placement import Block3D, Replicated, Split, chunk_view
from axo4d.facts.spec import Dtypes
from axo4d.training.memory_plan import plan_memory, run_setup
from axo4d.training.optim.owned import run_chunks
from axo4d.training.optim.sharded import shard_optimizer_on
from perfmodel import collectives, load_machine
from perfmodel.model import estimate
from tests.helpers import why_not_even

GIB = 2**30


def _cfg(*sets: str, grid: str = "data=1", name: str = "tiny"):
    return load_config(name, list(sets), grid)


# ---- the memory terms ------------------------------------------------------------------------------------
def test_sharded_optimizer_divides_owned_state_by_each_group():
    cfg = _cfg(grid="data=2,z=2")
    spec = model_spec(cfg.model, Grid.parse("data=2,z=2"))
    lin, other = spec.local_params()["linear"], spec.local_params()["other"]
    assert owned_elements(spec, False) == pytest.approx(lin + other)
    # weight pieces are replicated over data only; norms, biases, embeddings over (z, data)
    assert owned_elements(spec, True) == pytest.approx(lin / 2 + other / 4)
    dt = Dtypes.for_compute("fp32")
    off = memory(spec, 64, dt, Setup(shard=False, gpu=False))
    on = memory(spec, 64, dt, Setup(shard=True, gpu=False))
    assert off.device["optimizer"] == pytest.approx(8 * (lin + other))
    assert on.device["optimizer"] == pytest.approx(8 * (lin / 2 + other / 4))
    assert on.device["params"] == off.device["params"]
    # a sharded bucket's gradients shrink to the owned slice once reduced (tiny model: one bucket per group)
    assert on.device["grads"] == pytest.approx(4 * (lin / 2 + other / 4 + lin + other))
    acc = memory(spec, 64, dt, Setup(shard=True, gpu=False, accumulate=True))
    assert acc.device["grads"] == off.device["grads"]  # accumulation keeps whole gradients
    assert memory(spec, 64, dt, Setup(gpu=False)).device["optimizer"] == on.device["optimizer"]  # auto: data > 1


def test_offload_moves_masters_and_moments_to_the_host():
    spec = model_spec(_cfg().model, Grid())
    n = spec.local_params()["linear"] + spec.local_params()["other"]
    dt = Dtypes()  # bf16 compute on a GPU
    none = memory(spec, 64, dt, Setup(offload="none"))
    full = memory(spec, 64, dt, Setup(offload="optimizer"))
    assert none.device["params"] == 4 * n and none.device["optimizer"] == 8 * n and none.host["optimizer"] == 0
    # offloaded: bf16 weights and gradients on the device, fp32 master + 2 moments (12 B) on the host
    assert full.device["params"] == 2 * n and full.device["grads"] == 2 * n and full.device["optimizer"] == 0
    assert full.host["optimizer"] == 12 * n and full.host["grad_copies"] == 2 * n
    half = memory(spec, 64, dt, Setup(offload="auto", device_fraction=0.5))
    assert half.device["optimizer"] == pytest.approx(0.5 * n * 12)  # own fp32 master on the device too
    assert half.host["optimizer"] == pytest.approx(0.5 * n * 12)


def test_auto_fraction_fills_the_budget_and_no_more():
    spec = model_spec(_cfg().model, Grid())
    dt, s = Dtypes(), Setup(offload="auto")
    lo = memory(spec, 64, dt, dataclasses.replace(s, device_fraction=0.0)).reserved()
    hi = memory(spec, 64, dt, dataclasses.replace(s, device_fraction=1.0)).reserved()
    assert auto_fraction(spec, 64, dt, s, hi * 2) == 1.0
    assert auto_fraction(spec, 64, dt, s, lo / 2) == 0.0
    budget = (lo + hi) / 2
    f = auto_fraction(spec, 64, dt, s, budget)
    assert 0.4 < f < 0.6
    assert memory(spec, 64, dt, dataclasses.replace(s, device_fraction=f)).reserved() <= budget
    assert memory(spec, 64, dt, dataclasses.replace(s, device_fraction=f + 1e-6)).reserved() > budget * (1 - 1e-9)


def test_checkpointing_and_micro_batch_shrink_activations():
    spec = model_spec(_cfg().model, Grid())
    dt = Dtypes.for_compute("fp32")
    full = memory(spec, 256, dt, Setup(gpu=False)).device["activations"]
    ck = memory(spec, 256, dt, Setup(checkpointing=True, gpu=False)).device["activations"]
    assert ck < full and memory(spec, 128, dt, Setup(gpu=False)).device["activations"] == pytest.approx(full / 2)


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_memory_model_reads_only_model_facts(name):
    """Any architecture the spec describes is priced (no per-architecture code in the model)."""
    try:
        cfg = _cfg(grid="data=2,x=2", name=name)
    except ConfigError:
        pytest.skip(f"no config {name}")
    spec = model_spec(cfg.model, Grid.parse("data=2,x=2"))
    m = memory(spec, 64, Dtypes(), Setup(shard=True, offload="auto", device_fraction=0.25))
    assert m.device["total"] == pytest.approx(sum(v for k, v in m.device.items() if k != "total"))
    assert m.owned_elements == pytest.approx(owned_elements(spec, True)) and m.owned_elements > 0


# ---- data-parallel bytes of the sharded optimizer ------------------------------------------------------
def test_sharded_bytes_are_a_reduce_scatter_and_an_all_gather():
    """data=2,x=2,y=2,z=2, the tiny GPT: one bucket per group, so the counts are exact."""
    cfg = _cfg(grid="data=2,x=2,y=2,z=2")
    grid, mach = Grid.parse("data=2,x=2,y=2,z=2"), load_machine("perlmutter")
    plain = estimate(cfg.model, grid, 8, mach, shard_optimizer=False).bytes_per_rank
    shard = estimate(cfg.model, grid, 8, mach, shard_optimizer=True).bytes_per_rank
    spec = model_spec(cfg.model, grid)
    lin, other = spec.local_params()["linear"], spec.local_params()["other"]
    pad = lambda n, p: math.ceil(n / p) * p  # noqa: E731
    assert plain[("data", "all_reduce")] == 4 * lin
    assert shard[("data", "reduce_scatter")] == 4 * pad(lin, 2) == shard[("data", "all_gather")]
    assert shard[("data,z", "reduce_scatter")] == 4 * pad(other, 4) == shard[("data,z", "all_gather")]
    # the same bytes on the wire as the all-reduce: 2(p-1)/p n = (p-1)/p n + (p-1)/p n
    ring = lambda k, n, p: collectives.ring_bytes(k, n, p)  # noqa: E731
    assert ring("all_reduce", 4 * lin, 2) == ring("reduce_scatter", 4 * lin, 2) + ring("all_gather", 4 * lin, 2)
    # no gradient all-reduce left: over data only the norm's partial sums (per (split, shard) kind,
    # over the shard axes, then the split axes) and, over (data, z), the loss
    assert shard[("data", "all_reduce")] == 8 and shard[("data,z", "all_reduce")] == 8 * 2 + 8


# ---- the start-up check ---------------------------------------------------------------------------------
def _budget_cfg(gib: float, *sets: str, grid: str = "data=1"):
    return _cfg(f"train.memory_budget_gb={gib!r}", "parallel.tuner=false", *sets, grid=grid)


def test_a_run_that_does_not_fit_stops_naming_the_term_and_the_fix():
    cfg = _budget_cfg(0.1)
    fits = plan_memory(cfg, Grid(), torch.device("cpu"))
    need = fits.memory.reserved()
    small = _budget_cfg(need * 0.99 / GIB)
    with pytest.raises(MemoryBudgetError) as e:
        plan_memory(small, Grid(), torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg and "does not fit the device" in msg and "over by" in msg
    name, _ = fits.memory.largest()
    assert f"largest term: {name}" in msg
    assert "fits with train.activation_checkpointing=true" in msg
    with pytest.raises(MemoryBudgetError, match="fits nowhere"):
        plan_memory(_budget_cfg(1e-4), Grid(), torch.device("cpu"))


def test_offload_without_host_memory_names_the_host_bytes():
    cfg = _cfg("train.offload=optimizer", "train.host_memory_gb=0.0001")
    with pytest.raises(
        MemoryBudgetError,
        match=r"offloaded optimizer state needs .* of host memory per rank > "
        r"0.102 MiB \(train.host_memory_gb\), over by",
    ):
        plan_memory(cfg, Grid(), torch.device("cpu"))


def test_auto_offload_keeps_on_the_device_what_fits():
    base = _cfg("train.offload=auto")
    spec, b, dt, setup = run_setup(base, Grid(), gpu=False)
    lo = memory(spec, b, dt, dataclasses.replace(setup, device_fraction=0.0)).reserved()
    hi = memory(spec, b, dt, dataclasses.replace(setup, device_fraction=1.0)).reserved()
    plan = plan_memory(_budget_cfg((lo + hi) / 2 / GIB, "train.offload=auto"), Grid(), torch.device("cpu"))
    assert 0 < plan.memory.device_fraction < 1 and plan.device_state_bytes < math.inf
    assert (
        plan_memory(_budget_cfg(hi * 2 / GIB, "train.offload=auto"), Grid(), torch.device("cpu")).device_state_bytes
        == math.inf
    )


def test_pinned_memory_failure_is_one_line(monkeypatch):
    from axo4d.training.optim import offload

    def refuse(*a, **kw):
        if kw.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory\nmore lines")
        return torch.zeros(*a, **{k: v for k, v in kw.items() if k != "pin_memory"})

    monkeypatch.setattr(offload.torch, "empty", refuse)
    with pytest.raises(TrainError) as e:
        offload.host_empty(2**28, torch.float32, True, 3, 5 * GIB)
    assert str(e.value).startswith("rank 3: pinning 1.000 GiB of host memory") and "\n" not in str(e.value)
    assert "after 5.00 GiB" in str(e.value)


# ---- settings --------------------------------------------------------------------------------------------
def test_settings_and_their_errors():
    assert shard_optimizer_on(_cfg(grid="data=2").parallel, Grid(data=2))
    assert not shard_optimizer_on(_cfg(grid="z=2").parallel, Grid(z=2))
    assert shard_optimizer_on(_cfg("parallel.shard_optimizer=true").parallel, Grid(z=2))  # YAML true
    assert not shard_optimizer_on(_cfg("parallel.shard_optimizer=off").parallel, Grid(data=2))
    with pytest.raises(ConfigError, match="parallel.shard_optimizer='maybe'; valid: auto, true, false"):
        _cfg("parallel.shard_optimizer=maybe")  # the config loader: the one place choices are checked
    with pytest.raises(ConfigError, match="train.offload='gpu'; valid: none, optimizer, auto"):
        _cfg("train.offload=gpu")


# ---- which rectangles an owned run holds ------------------------------------------------------------------
PLACEMENTS = [
    Block3D((12, 10), in_axis="x", out_axis="y"),
    Block3D((6, 20), in_axis="y", out_axis="x"),
    Split((5, 12), axis="x"),
    Split((12,), axis="y"),
    Replicated((3, 4, 5)),
    Block3D((16, 10), logical_rows=13),
]


@pytest.mark.parametrize("pl", PLACEMENTS, ids=lambda p: f"{type(p).__name__}{p.full_shape}")
@pytest.mark.parametrize("spec", ["data=1", "x=2,z=2", "y=2,z=3", "x=2,y=2,z=2"])
@pytest.mark.parametrize("parts", [2, 3, 7])
def test_owned_runs_tile_the_full_tensor(pl, spec, parts):
    """Cut every rank's piece into ``parts`` owned runs (as ranks of a sharded group would): the
    rectangles of all runs of all pieces cover the logical tensor exactly once, with the right values."""
    grid = Grid.parse(spec)
    full = torch.arange(math.prod(pl.full_shape), dtype=torch.float32).view(pl.full_shape)
    why = why_not_even(pl, grid)
    if why:
        pytest.skip(f"does not split evenly: {why}")
    pieces = [pl.shard(full, grid, r).reshape(-1) for r in range(grid.world_size)]
    assert all(p.numel() == pl.local_numel(grid) for p in pieces)
    target = full[: pl.logical_shape[0]]
    cover = torch.zeros(target.shape, dtype=torch.int64)
    seen = set()
    for r, piece in enumerate(pieces):
        n = piece.numel()
        cuts = [round(i * n / parts) for i in range(parts + 1)]
        for lo, hi in zip(cuts, cuts[1:]):
            run = piece[lo:hi]
            for ch in run_chunks(pl.chunks(grid, r), lo, hi):
                region = tuple(slice(o, o + s) for o, s in zip(ch.offsets, ch.sizes))
                assert torch.equal(chunk_view(run, ch), target[region])
                if (ch.offsets, ch.sizes) not in seen:  # replicas describe identical rectangles
                    seen.add((ch.offsets, ch.sizes))
                    cover[region] += 1
    assert bool((cover == 1).all())
