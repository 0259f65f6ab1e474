"""The run plan (issue 30 item 2): derived once per start-up, written as ``plan.yaml``, the same
derivation in the trainer and ``perfmodel``; the optimizer modes behind one interface; the device
facts in one table; MFU and HFU in the step record."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from axo4d.config import load_config
from axo4d.config.errors import GridError
from axo4d.facts import run as run_facts
from axo4d.facts.devices import gemm_ceiling, peak_line, vendor_peak
from axo4d.facts.grid import Grid
from axo4d.facts.run import derive, micro_batch

ROOT = Path(__file__).resolve().parents[2]

#: one single-process training run of one step, counting the model specs built in it
_COUNTED_RUN = """
import atexit, dataclasses, json, sys
from axo4d.facts import archs
calls = []
# an axo4d command ends its process itself (axo4d.exits: exit handlers, then os._exit)
atexit.register(lambda: print("SPEC_CALLS " + json.dumps(calls), flush=True))
arch = archs.ARCHS["gpt"]
def counted(cfg, grid, _spec=arch.spec):
    calls.append(grid.spec())
    return _spec(cfg, grid)
archs.ARCHS["gpt"] = dataclasses.replace(arch, spec=counted)
from axo4d.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(240)
def test_plan_is_derived_once_and_written(tmp_path):
    """One start-up builds the model spec once (the run plan's; before the plan it was built about
    8 times), and ``plan.yaml`` beside ``config.yaml`` holds the plan's numbers."""
    out = tmp_path / "run"
    args = ["--config", "tiny", "--set", "train.steps=1", "--set", "train.eval_batches=1", "--out", str(out)]
    args += ["--set", "parallel.cache_weights=1", "--launcher", "single"]
    r = subprocess.run(
        [sys.executable, "-c", _COUNTED_RUN, *args], cwd=ROOT, capture_output=True, text=True, timeout=230
    )
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("SPEC_CALLS "))
    assert json.loads(line.split(" ", 1)[1]) == ["data=1,x=1,y=1,z=1"]
    assert r.stdout.count("run plan (grid data=1,x=1,y=1,z=1") == 1
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    facts = derive(load_config("tiny", ["train.steps=1", "parallel.cache_weights=1"]), Grid())
    assert plan["micro_batch"] == facts.micro_batch == 8
    assert plan["optimizer"] == "plain" and plan["z_split"] == "batch" and plan["cache_blocks"] == 1
    assert plan["model_flops_per_step"] == facts.spec.flops_per_step(8, False)
    assert plan["memory"]["fits"] is True and plan["memory"]["device_bytes"] > 0
    assert (out / "config.yaml").exists()


def test_perfmodel_and_trainer_share_the_derivation(monkeypatch):
    """perfmodel's start-up profile and grid checks call the run plan's micro-batch function; both
    sides agree on the number for every batch and accumulation."""
    import axo4d.training.startup as st
    import perfmodel.model as pm
    import perfmodel.startup_profile as sp

    assert pm.micro_batch is run_facts.micro_batch and sp.micro_batch is run_facts.micro_batch
    assert st.micro_batch is run_facts.micro_batch
    seen = []
    monkeypatch.setattr(pm, "micro_batch", lambda gb, ga: seen.append((gb, ga)) or run_facts.micro_batch(gb, ga))
    cfg = load_config("tiny", [])
    assert pm.sizes_reason(cfg.model, Grid.parse("data=2"), 16, 2) == ""
    assert seen == [(16, 2)]
    for gb, ga, spec in ((16, 1, "data=2,z=2"), (16, 4, "data=4"), (8, 2, "data=2,z=2"), (2, 1, "data=2,z=4")):
        c = load_config("tiny", [f"train.global_batch={gb}", f"train.grad_accum={ga}", "parallel.z_split=auto"])
        f = derive(c, Grid.parse(spec))
        assert f.micro_batch == micro_batch(gb, ga) == gb // ga
        assert pm.sizes_reason(c.model, Grid.parse(spec), gb, ga, f.z_split) == ""
    assert derive(c, Grid.parse("data=2,z=4")).z_split == "sequence"  # 2 samples cannot fill data*z=8


def test_derive_refuses_what_the_old_checks_refused():
    with pytest.raises(GridError, match="G_data\\*G_z=4"):
        derive(load_config("tiny", ["train.global_batch=6"]), Grid.parse("data=2,z=2"))
    with pytest.raises(GridError, match="not divisible by train.grad_accum=3"):
        derive(load_config("tiny", ["train.grad_accum=3"]), Grid())


def test_commands_check_the_grid_with_the_start_up_derivation():
    """generate, eval and the memorization study check their model on the grid with ``derive`` (the
    training start-up's), not a divisibility rule of their own: only the facts and the model's own
    build call ``divisibility_reasons``; ``batch=False`` (generation, evaluation) refuses a model that
    does not fit the grid and leaves the training batch unchecked."""
    import ast

    callers = set()
    for f in sorted((ROOT / "axo4d").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "divisibility_reasons":
                callers.add(f.relative_to(ROOT).as_posix())
    assert callers == {"axo4d/facts/run/derive.py", "axo4d/models/base.py"}, callers
    for cmd in ("generate.py", "eval.py", "memorization/__main__.py"):
        assert "derive(" in (ROOT / "axo4d" / cmd).read_text(), cmd
    cfg = load_config("tiny", ["train.global_batch=3"])
    assert derive(cfg, Grid.parse("data=2"), batch=False).micro_batch == 3
    with pytest.raises(GridError, match="model does not fit grid .*n_head=4 not divisible by G_y=3"):
        derive(cfg, Grid.parse("y=3"), batch=False)


def test_checkpoint_records_the_plan_and_a_resume_names_its_changes(tmp_path):
    """meta.json's ``plan`` holds the run plan's derived numbers; resolving a resume hands them on and
    the resumed run names what differs (micro-batch, accumulation, z split, optimizer mode); a
    checkpoint saved without them (before they were recorded, or by a caller that gives none)
    resumes with no such note."""
    from axo4d.dist.comm import Comm
    from axo4d.models import build_model
    from axo4d.nn.context import as_context
    from axo4d.training.checkpointing.checkpointer import Checkpointer
    from axo4d.training.checkpointing.resume import resolve_resume, resume_changes

    cfg = load_config("tiny", ["train.grad_accum=2"])
    comm = Comm(Grid(), 0, init_groups=False)
    model = build_model(cfg.model, as_context(comm), seed=1)
    facts = derive(cfg, Grid())
    path = Checkpointer(tmp_path / "run", cfg, comm, model, None, facts=facts).save(2)
    assert json.loads((path / "meta.json").read_text())["plan"] == json.loads(json.dumps(facts.to_dict()))
    res = resolve_resume(str(path), tmp_path / "run", cfg)
    assert resume_changes(res, cfg.train, facts) == []
    now = load_config("tiny", ["train.grad_accum=4", "parallel.shard_optimizer=true"])
    assert resume_changes(res, now.train, derive(now, Grid())) == [
        "note: the run plan differs from the checkpoint's run: micro_batch 4 -> 2, grad_accum 2 -> 4, "
        "optimizer plain -> sharded"
    ]
    old = Checkpointer(tmp_path / "old", cfg, comm, model, None).save(2)
    assert "plan" not in json.loads((old / "meta.json").read_text())
    assert resume_changes(resolve_resume(str(old), tmp_path / "old", now), now.train, derive(now, Grid())) == []


def test_optimizer_modes_share_one_interface():
    """The trainer has no isinstance branch on the optimizer; both classes have every method of the
    interface, and the plan's mode picks the class."""
    from axo4d.training import trainer
    from axo4d.training.optim.build import PlainAdamW, RunOptimizer
    from axo4d.training.optim.sharded import ShardedAdamW

    assert "isinstance(self.opt" not in inspect.getsource(trainer)
    for cls in (PlainAdamW, ShardedAdamW):
        for name in ("zero_grad", "grad_norm", "update", "skip", "settle", "after_load", "queues_step"):
            assert hasattr(cls, name), (cls, name)
    assert PlainAdamW.queues_step and not ShardedAdamW.queues_step
    assert {"queues_step"} <= set(RunOptimizer.__annotations__)
    modes = {
        spec: derive(load_config("tiny", extra), Grid.parse(spec)).optimizer
        for spec, extra in (("data=1", []), ("data=2", []), ("data=2,z=2", ["train.offload=optimizer"]))
    }
    assert modes == {"data=1": "plain", "data=2": "sharded", "data=2,z=2": "offload"}


def test_device_facts_one_table():
    """Vendor dense bf16 peaks from the data sheets, and perfmodel's bundled machines take their
    GEMM ceiling from the same table as the trainer."""
    from perfmodel import load_machine

    assert [vendor_peak(n)[0] for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA GH200 480GB")] == [989.0] * 3
    assert vendor_peak("NVIDIA A100-SXM4-40GB")[0] == 312.0 and vendor_peak("AMD Instinct MI250X")[0] == 191.5
    assert vendor_peak("NVIDIA H100 PCIe")[0] == 756.0 and vendor_peak("a CPU") == (0.0, "")
    for machine, device in (("alps", "GH200"), ("frontier", "MI250X"), ("perlmutter", "A100")):
        assert load_machine(machine).gemm_tflops == gemm_ceiling(device)[0] > 0
    assert "312" in peak_line("A100") and "280" in peak_line("A100")


def test_step_record_has_mfu_and_hfu(tmp_path):
    """MFU divides model FLOPs, HFU hardware FLOPs (with recomputation), both by the vendor peak;
    the GEMM-ceiling share is of the hardware FLOPs."""
    from axo4d.training.metrics_log import StepLog, efficiency
    from axo4d.training.perf import Peaks

    cfg = load_config("tiny", ["train.activation_checkpointing=true"])
    spec = derive(cfg, Grid()).spec
    model, hw = spec.flops_per_step(8, False), spec.flops_per_step(8, True)
    assert hw > model
    log = StepLog(
        tmp_path, cfg, 1, 2, "data=2", (model, hw), Peaks(100.0, "test", 50.0, "test"), 1024, torch.device("cpu")
    )
    s = SimpleNamespace(step=0, loss=1.0, lr=1e-3, grad_norm=1.0, step_time_s=1e-9, skipped=False, dropped=0.0)
    s.__dict__.update(epoch=0, epoch_fraction=0.0, samples_seen=8, samples=None, fp8=None, moe=None)
    rec = log.step(s)
    assert rec["mfu"] == pytest.approx(model / 1e-9 / 2 / 1e12 / 100.0)
    assert rec["hfu"] == pytest.approx(hw / 1e-9 / 2 / 1e12 / 100.0)
    assert rec["gemm_ceiling_frac"] == pytest.approx(hw / 1e-9 / 2 / 1e12 / 50.0)
    assert efficiency(rec).startswith("MFU ") and "| HFU " in efficiency(rec)
