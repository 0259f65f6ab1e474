"""One mapping from a run's config to what the performance model prices (issue 30 item 2): ``--grid
auto`` and ``launch.job`` both call :func:`perfmodel.run_settings.settings_of`; the FP8 layers and
the grids FP8 refuses are the start-up's (:func:`axo4d.facts.run.fp8_of`), so a grid the model
calls feasible is one the trainer accepts; the expert group a ranking chooses is the one trained."""

from __future__ import annotations

import dataclasses

import pytest

from axo4d.config import load_config
from axo4d.config.errors import ConfigError, GridError
from axo4d.facts.grid import Grid, all_grids
from axo4d.facts.run import derive
from perfmodel.machine import load_machine
from perfmodel.plan import Options, plan
from perfmodel.run_settings import settings_of

#: Options fields that are not settings of the config: the ranking searches the expert group, the
#: command lines give recomputation and ranks per node separately, imbalance is the model's own
NOT_SETTINGS = {"expert", "imbalance", "gpus_per_node", "checkpointing"}


def test_every_priced_setting_comes_from_the_config():
    """Every field of perfmodel's Options is mapped from the config (a new one must be added here
    or the test fails), and launch.job's settings are ``settings_of`` on the GPU."""
    from launch.job_plan import _perf_kw

    cfg = load_config("tiny", ["parallel.shard_optimizer=false", "train.offload=optimizer", "train.fp8=rowwise"])
    kw = settings_of(cfg, "cuda")
    assert set(kw) == {f.name for f in dataclasses.fields(Options)} - NOT_SETTINGS
    assert kw["shard_optimizer"] is False and kw["offload"] == "optimizer" and kw["fp8"] == "rowwise"
    assert _perf_kw(cfg) == kw
    assert settings_of(cfg, "cpu")["flash_attention"] is False and kw["flash_attention"] is True


def test_launch_job_prices_the_configured_optimizer():
    """A job script's estimate holds the optimizer state the trainer will: replicated over data=4
    with ``parallel.shard_optimizer=false`` (4x the sharded state), none on the device offloaded."""
    import launch.job_plan as J

    def opt(*sets: str) -> float:
        return J.plan_job(J.JobRequest("perlmutter", "gpt-1.3b", 1, grid="data=4", sets=sets)).estimate.memory_bytes[
            "optimizer"
        ]

    sharded = opt()
    assert opt("parallel.shard_optimizer=false") == pytest.approx(4 * sharded) and sharded > 0
    assert opt("train.offload=optimizer") == 0


def _accepts(cfg, grid: Grid) -> bool:
    try:
        derive(cfg, grid)
        return True
    except (ConfigError, GridError):
        return False


@pytest.mark.parametrize(
    "name,sets",
    [
        ("tiny", ["train.fp8=tensorwise", "train.fp8_layers=all", "model.seq_len=24", "train.global_batch=16"]),
        ("tiny", ["train.fp8=rowwise", "train.fp8_layers=blocks", "model.n_embd=96", "train.global_batch=8"]),
        ("moe-tiny", ["train.fp8=tensorwise", "train.global_batch=16"]),
    ],
)
def test_fp8_grids_and_layers_are_the_start_ups(name, sets):
    """On every grid of 8 ranks (and expert group): perfmodel's plan has no reason against it exactly
    when the start-up's derivation accepts it, and marks the layers the start-up runs in FP8.
    Before the shared rule perfmodel accepted grids whose rows per rank (24, 48) or local widths
    are not multiples of 16 and judged experts without their routed rows."""
    cfg = load_config(name, sets)
    m, t = load_machine("alps"), cfg.train
    o = Options(fp8=t.fp8, fp8_layers=t.fp8_layers, grad_accum=t.grad_accum)
    seen = set()
    for g in all_grids(8):
        for ep in [d for d in (1, 2, 4, 8) if g.data % d == 0] if cfg.model.arch.endswith("moe") else [1]:
            grid = dataclasses.replace(g, expert=ep)
            st = plan(cfg.model, grid, t.global_batch, m, dataclasses.replace(o, expert=ep))
            ok = _accepts(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, expert=ep)), grid)
            assert (not st.reasons) == ok, (grid, ep, st.reasons)
            seen.add(ok)
            if ok:
                facts = derive(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, expert=ep)), grid)
                spec = st.full_spec or st.spec
                marked = {p.name for p in (*spec.block, *spec.head) if getattr(p, "fp8", "")}
                assert marked == set(facts.fp8_layers), (grid, ep)
    assert seen == {True, False}  # both kinds of grid met


def test_grid_auto_trains_the_expert_group_it_priced():
    """A mixture of experts: the ranking chooses G_ep per grid; --grid auto hands that group (with
    the grid, order and z split) to the trainer, and the start-up accepts it."""
    from perfmodel.grid_auto import choose, run_config_on

    cfg = load_config("moe-tiny", ["train.global_batch=16"])
    p = choose(cfg, 8, 4, load_machine("alps"), "cuda", "machine 'alps'")
    run = run_config_on(cfg, p.estimate)
    assert run.parallel.expert == p.estimate.expert and run.parallel.grid == p.grid.spec()
    assert _accepts(run, Grid.parse(run.parallel.grid, run.parallel.order, run.parallel.expert))
    assert "using " + p.grid.spec() in p.banner(8, 4, 16)


def test_fp8_gemms_timed_as_the_layers_run_them():
    """The start-up profile's FP8 rows: e4m3 ``_scaled_mm`` of each shape whose dimensions are
    multiples of 16 (others left out), as ``float8`` rows a machine prices FP8 layers from."""
    import torch

    from perfmodel.measure import measure_fp8_table

    rows = measure_fp8_table(torch.device("cpu"), [(64, 32, 48, "nt"), (24, 32, 48, "nn"), (32, 16, 64, "tn")], 1, 0)
    assert [(r.m, r.n, r.k, r.layout, r.dtype) for r in rows] == [
        (64, 32, 48, "nt", "float8"),
        (32, 16, 64, "tn", "float8"),
    ]
    assert all(r.tflops > 0 for r in rows)


def test_job_script_trains_the_expert_group_it_priced():
    """launch.job on a mixture of experts: the ranking's expert group goes into the job's ``--set``
    options and into the run's derived numbers (before, the job priced G_ep=4 and trained G_ep=1)."""
    import launch.job_plan as J

    p = J.plan_job(J.JobRequest("alps", "moe-tiny", 4))
    assert p.estimate.expert == 4 and "parallel.expert=4" in p.sets
    assert p.facts.spec.grid.expert == 4 and not p.warnings
    assert "parallel.expert" not in " ".join(J.plan_job(J.JobRequest("alps", "moe-tiny", 2)).sets)  # G_ep=1


def test_grid_auto_with_fp8_on_a_machine_without_fp8_says_what_would_work():
    """FP8 priced on a machine file without FP8 GEMMs (frontier): one error naming the machine and what
    would work, instead of a grid chosen as if the run had no FP8 layers."""
    from perfmodel.grid_auto import choose

    cfg = load_config("tiny", ["train.fp8=tensorwise"])
    with pytest.raises(GridError, match="machine frontier has no FP8 GEMMs.*alps, or a profile.*or fp8 off"):
        choose(cfg, 4, 4, load_machine("frontier"), "cuda", "machine 'frontier'")
    assert choose(cfg, 4, 4, load_machine("alps"), "cuda", "machine 'alps'").estimate.feasible
