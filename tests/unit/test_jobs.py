"""Job-script generation (launch.job) and weak-scaling series/collection (launch.weak_scaling)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from axo4d.facts.grid import Grid
from launch import job as J
from launch import weak_scaling as W
from launch import weak_scaling_local as WL
from launch import weak_scaling_table as WT

MACHINES = {"perlmutter": 4, "frontier": 8, "alps": 4}
MODEL_FOR_NODES = {1: "gpt-1.3b", 64: "gpt-20b", 1024: "gpt-320b"}
ENV_VARS = {
    "perlmutter": (
        "NCCL_NET_GDR_LEVEL",
        "NCCL_CROSS_NIC",
        "NCCL_SOCKET_IFNAME",
        "FI_CXI_DISABLE_HOST_REGISTER",
        "FI_MR_CACHE_MONITOR",
        "MPICH_GPU_SUPPORT_ENABLED",
    ),
    "frontier": (
        "MIOPEN_USER_DB_PATH",
        "NCCL_SOCKET_IFNAME",
        "FI_CXI_ATS",
        "NCCL_CROSS_NIC",
        "NCCL_NET_GDR_LEVEL",
        "FI_MR_CACHE_MONITOR",
        "FI_CXI_RDZV_PROTO",
    ),
    "alps": (
        "NCCL_NET",
        "NCCL_NET_GDR_LEVEL",
        "NCCL_CROSS_NIC",
        "FI_CXI_DISABLE_HOST_REGISTER",
        "FI_MR_CACHE_MONITOR",
        "MPICH_GPU_SUPPORT_ENABLED",
    ),
}
BINDING = {
    "perlmutter": "#SBATCH --gpus-per-node=4",
    "frontier": "--gpu-bind=closest",
    "alps": "#SBATCH --gpus-per-task=1",
}


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined."""
    return text.replace("\\\n", " ").splitlines()


def launch_line(text: str, word: str) -> str:
    lines = [ln for ln in logical_lines(text) if ln.lstrip().startswith(word + " ")]
    assert len(lines) == 1, f"expected one {word} line, found {lines}"
    return re.sub(r"\s+", " ", lines[0])


def bash_syntax_ok(text: str, tmp_path: Path, name: str) -> None:
    p = tmp_path / name
    p.write_text(text)
    r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


#: order and z split fixed: the scripts' rendering is tested here, the search (seconds per 4,096 GPUs) once below
FIXED = ("parallel.order=x,y,z,data", "parallel.z_split=batch")


@pytest.fixture(scope="module")
def plans() -> dict:
    """(machine, nodes, launcher) -> (plan, script); the launcher only changes the rendering."""
    out = {}
    for machine in MACHINES:
        for nodes, model in MODEL_FOR_NODES.items():
            plan = J.plan_job(J.JobRequest(machine=machine, model=model, nodes=nodes, sets=FIXED))
            for launcher in J.LAUNCHERS:
                p = dataclasses.replace(plan, request=dataclasses.replace(plan.request, launcher=launcher))
                out[machine, nodes, launcher] = (p, J.render(p))
    return out


# ---- launch.job: generated scripts ---------------------------------------------------------
@pytest.mark.parametrize("machine", sorted(MACHINES))
@pytest.mark.parametrize("nodes", sorted(MODEL_FOR_NODES))
def test_slurm_script(plans, machine, nodes, tmp_path):
    plan, text = plans[machine, nodes, "slurm"]
    gpn, ntasks = MACHINES[machine], nodes * MACHINES[machine]
    assert text.startswith("#!/bin/bash\n")
    assert f"#SBATCH --nodes={nodes}\n" in text
    assert f"#SBATCH --ntasks-per-node={gpn}\n" in text
    assert BINDING[machine] in text
    assert "#SBATCH --time=00:30:00\n" in text and "#SBATCH --job-name=" in text
    srun = launch_line(text, "srun")
    assert "python -m axo4d.train" in srun and "--launcher slurm" in srun
    assert f"--nodes={nodes} --ntasks={ntasks} --ntasks-per-node={gpn}" in srun
    spec = re.search(r"--grid (\S+)", srun).group(1)
    assert spec == plan.grid.spec() and Grid.parse(spec).world_size == ntasks
    assert f"--config {MODEL_FOR_NODES[nodes]}" in srun and '--out "${RUN_DIR}"' in srun
    for var in ENV_VARS[machine]:
        assert re.search(rf"^\s*(if .*then )?export {var}=", text, re.M), var
    # the perf model's prediction is in the header, and the run uses the checkpointing it assumed
    assert "# perf model prediction" in text and "step time" in text and "memory per GPU" in text
    assert f"train.activation_checkpointing={str(plan.checkpointing).lower()}" in srun
    bash_syntax_ok(text, tmp_path, f"{machine}-{nodes}.sbatch")


@pytest.mark.parametrize("machine", sorted(MACHINES))
@pytest.mark.parametrize("nodes", sorted(MODEL_FOR_NODES))
def test_mpirun_script(plans, machine, nodes, tmp_path):
    plan, text = plans[machine, nodes, "mpirun"]
    gpn, ntasks = MACHINES[machine], nodes * MACHINES[machine]
    assert not re.search(r"^#SBATCH", text, re.M)
    line = launch_line(text, "mpirun")
    assert f"-np {ntasks} " in line and f"--map-by ppr:{gpn}:node" in line and "--hostfile" in line
    assert "python -m axo4d.train" in line and "--launcher mpi" in line
    assert Grid.parse(re.search(r"--grid (\S+)", line).group(1)).world_size == ntasks
    for var in ENV_VARS[machine]:  # forwarded to the ranks with -x
        assert var in re.search(r"^for v in (.*); do$", text, re.M).group(1)
    bash_syntax_ok(text, tmp_path, f"{machine}-{nodes}.sh")


def _fake_bin(tmp_path: Path, names: list[str], failing_module: str = "") -> dict:
    """Executables that record their arguments in $FAKE_LOG instead of launching anything; a fake
    ``module`` whose ``load`` of ``failing_module`` fails (as Lmod's does for an unknown name)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name in names + ["module"]:
        body = f'#!/bin/bash\necho "{name} $*" >> "$FAKE_LOG"\n'
        if name == "scontrol":
            body += "echo nid000001\necho nid000002\n"
        if name == "module" and failing_module:
            body += (
                f'[ "$2" != "{failing_module}" ] || {{ echo "Lmod has detected the following error" >&2; exit 1; }}\n'
            )
        (bindir / name).write_text(body)
        (bindir / name).chmod(0o755)
    return dict(
        os.environ,
        PATH=f"{bindir}:{os.environ['PATH']}",
        FAKE_LOG=str(tmp_path / "log"),
        SLURM_JOB_NODELIST="nid[000001-000002]",
        SLURM_JOB_ID="42",
        SLURM_JOB_ACCOUNT="CSC123",
        USER=f"axo4d-test-{os.getpid()}",
    )


def _plugin_dir(tmp_path: Path, name: str) -> str:
    """A folder holding a (dummy) network plugin library, for LD_LIBRARY_PATH."""
    d = tmp_path / "plugin"
    d.mkdir(exist_ok=True)
    (d / name).write_bytes(b"")
    return str(d)


def _run(script: Path, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script)], cwd=cwd, env=env, capture_output=True, text=True)


def test_slurm_script_runs_with_fake_srun(plans, tmp_path):
    _, text = plans["frontier", 64, "slurm"]
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = _fake_bin(tmp_path, ["srun", "scontrol"])
    env.update(MEMBERWORK=str(tmp_path / "scratch"), LD_LIBRARY_PATH=_plugin_dir(tmp_path, "librccl-net.so"))
    r = _run(script, env, tmp_path)
    assert r.returncode == 0, r.stderr
    log = (tmp_path / "log").read_text()
    assert "module load rocm" in log and "module load rccl-net-plugin" in log
    assert "srun --nodes=64 --ntasks=512" in log and "python -m axo4d.train" in log
    # the run folder is on the project's scratch ($MEMBERWORK/<project>), not in the submit directory
    assert (tmp_path / "scratch" / "csc123" / "axo4d" / "axo4d-gpt-20b-64n-42").is_dir()
    assert not (tmp_path / "runs").exists()
    shutil.rmtree(f"/tmp/miopen-{env['USER']}-42", ignore_errors=True)  # the script's MIOpen cache dir


def test_scripts_stop_with_one_line(plans, tmp_path):
    """Strict bash before the first module line, no checkout on PYTHONPATH, and one ``axo4d job:
    error:`` line with status 2 for: a module that does not load, a missing scratch variable, a
    missing network plugin on more than one node."""
    for (machine, nodes, launcher), (_, text) in plans.items():
        assert "PYTHONPATH=" not in text and "PYTHONPATH:+" not in text, (machine, launcher)
        before = text[: text.index("set -euo pipefail")].splitlines()[1:]  # only comments before it
        assert all(not ln.strip() or ln.startswith("#") for ln in before), (machine, nodes, launcher)
        assert "set -eo pipefail" not in text
    _, text = plans["frontier", 64, "slurm"]
    script = tmp_path / "frontier.sbatch"
    script.write_text(text)
    env = _fake_bin(tmp_path, ["srun", "scontrol"], failing_module="rocm")
    env.update(MEMBERWORK=str(tmp_path / "scratch"), LD_LIBRARY_PATH=_plugin_dir(tmp_path, "librccl-net.so"))
    r = _run(script, env, tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "axo4d job: error: module load rocm failed: find the module's name with 'module spider rocm' and edit "
        "this script"
    ], r.stderr
    assert "srun " not in (tmp_path / "log").read_text()
    env = _fake_bin(tmp_path, ["srun", "scontrol"])
    env.update(MEMBERWORK=str(tmp_path / "scratch"), LD_LIBRARY_PATH=str(tmp_path))  # no plugin there
    r = _run(script, env, tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "the rccl network plugin (librccl-net*.so, aws-ofi-rccl) is not on LD_LIBRARY_PATH" in r.stderr
    _, text = plans["perlmutter", 64, "slurm"]
    script.write_text(text)
    env = _fake_bin(tmp_path, ["srun", "scontrol"])
    env.pop("PSCRATCH", None)
    env["LD_LIBRARY_PATH"] = _plugin_dir(tmp_path, "libnccl-net.so")
    r = _run(script, env, tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "$PSCRATCH is not set, so the run folder on scratch is unknown: set RUN_DIR=" in r.stderr
    r = _run(script, dict(env, PSCRATCH=str(tmp_path / "ps")), tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ps" / "axo4d" / "axo4d-gpt-20b-64n-42").is_dir()
    r = _run(script, dict(env, RUN_DIR=str(tmp_path / "mine")), tmp_path)  # RUN_DIR=... wins
    assert r.returncode == 0 and (tmp_path / "mine").is_dir(), r.stderr
    # --run-root replaces the scratch default
    plan = J.plan_job(J.JobRequest("alps", "gpt-1.3b", 1, grid="data=4", run_root="/big/disk"))
    assert 'RUN_DIR="${RUN_DIR:-/big/disk/axo4d-gpt-1.3b-1n-${SLURM_JOB_ID:-manual}}"' in J.render(plan)


def test_grid_choice_is_perfmodel_ranks_with_the_z_split(tmp_path):
    """--grid auto ranks grids as ``perfmodel rank`` does (order and z split searched), and the
    job trains with the z split and order that were priced."""
    from perfmodel.model import rank_grids

    # sequences of 4096: the sequence split wins (at 2048 the batch split does, since the K and V
    # all-gathers over z are priced as the two calls they are)
    sets = ("model.seq_len=4096",)
    plan = J.plan_job(J.JobRequest("perlmutter", "gpt-1.3b", 1, sets=sets))
    from axo4d.config import load_config

    cfg = load_config("gpt-1.3b", list(sets))
    ranked = rank_grids(
        cfg.model,
        4,
        4,
        cfg.train.global_batch,
        plan.machine,
        order="search",
        z_split="auto",
        flash_attention=True,
        grad_accum=cfg.train.grad_accum,
    )
    best = next(e for e in ranked if e.feasible)
    assert best.z_split == "sequence"  # the case of the issue: the sequence split wins here
    assert (plan.grid.spec(), plan.grid.order) == (best.grid.spec(), best.grid.order)
    assert plan.estimate.z_split == "sequence" and plan.estimate.step_time_s == pytest.approx(best.step_time_s)
    srun = launch_line(J.render(plan), "srun")
    assert f"--grid {best.grid.spec()}" in srun and "--set parallel.z_split=sequence" in srun
    assert f"--set parallel.order={','.join(best.grid.order)}" in srun
    assert "z splits the sequence" in J.render(plan)
    # the run's derived numbers are the trainer's start-up derivation on the chosen grid and z split
    f = plan.facts
    assert f.z_split == plan.estimate.z_split and f.spec.grid == plan.grid
    assert f.micro_batch == cfg.train.global_batch // cfg.train.grad_accum and f.optimizer == "plain"
    assert f"# run plan  micro-batch {f.micro_batch} x 1 accumulation step(s); z splits the sequence" in J.render(plan)
    # a z split or order the user fixed is kept and not searched
    fixed = J.plan_job(J.JobRequest("perlmutter", "gpt-1.3b", 1, sets=FIXED))
    assert fixed.estimate.z_split == "batch" and fixed.grid.order == ("x", "y", "z", "data")
    assert sum("z_split" in s for s in fixed.sets) == 1 and sum("parallel.order" in s for s in fixed.sets) == 1


def test_fine_tune_job(tmp_path, monkeypatch):
    """--init-from and --set data.source reach the training command (paths made absolute); the
    perf model prices the model of the folder's config.json."""
    hf = tmp_path / "hf" / "llama"
    hf.mkdir(parents=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
    }
    (hf / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "corpus.jsonl").write_text('{"text": "x"}\n')
    monkeypatch.chdir(tmp_path)
    argv = ["--machine", "perlmutter", "--model", "llama3.1-8b", "--nodes", "8", "--init-from", "hf/llama"]
    argv += ["--grid", "data=4,y=4,z=2"]  # given: the search is tested above
    argv += ["--set", "data.source=corpus.jsonl", "--set", "model.seq_len=4096", "--set", "train.steps=20"]
    assert J.main(argv + ["--out", "ft.sbatch"]) == 0
    text = (tmp_path / "ft.sbatch").read_text()
    srun = launch_line(text, "srun")
    assert f"--init-from {hf}" in srun and f"--set data.source={tmp_path / 'corpus.jsonl'}" in srun
    assert "--set model.seq_len=4096" in srun and "--set train.steps=20" in srun
    assert f"# init from {hf}" in text and "# model     llama3.1-8b: 32 layers, hidden 4096" in text
    assert "sequence 4096, vocabulary 128256" in text
    assert J.main(["--machine", "alps", "--model", "small", "--nodes", "1", "--init-from", "nope", "--dry-run"]) == 2


def test_mpirun_script_checks_hostfile_and_forwards_env(plans, tmp_path):
    _, text = plans["alps", 64, "mpirun"]
    script = tmp_path / "job.sh"
    script.write_text(text)
    env = _fake_bin(tmp_path, ["mpirun"])
    env.update(SCRATCH=str(tmp_path / "scratch"), LD_LIBRARY_PATH=_plugin_dir(tmp_path, "libnccl-net-ofi.so"))
    r = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "hostfile" in r.stderr
    (tmp_path / "hosts").write_text("# nodes\n" + "".join(f"n{i} slots=4\n" for i in range(63)))
    env["HOSTFILE"] = str(tmp_path / "hosts")
    r = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "lists 63 nodes but this job needs 64" in r.stderr
    (tmp_path / "hosts").write_text("".join(f"n{i} slots=4\n" for i in range(64)))
    r = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    log = (tmp_path / "log").read_text()
    assert "mpirun -np 256" in log and "-x NCCL_NET " in log and "-x MASTER_ADDR" in log


def test_explicit_grid_and_errors(capsys):
    plan = J.plan_job(J.JobRequest("perlmutter", "gpt-5b", 16, grid="data=2,z=32"))
    assert plan.grid.spec() == "data=2,x=1,y=1,z=32" and plan.estimate is not None
    bad = J.plan_job(J.JobRequest("perlmutter", "gpt-1.3b", 1, grid="data=4", batch=6))  # the trainer refuses it
    assert bad.facts is None and "# run plan" not in J.render(bad)
    assert any(w.startswith("axo4d.train will refuse this run at start-up: micro-batch of 6") for w in bad.warnings)
    with pytest.raises(
        J.JobError,
        match=r"data=2,x=2,y=1,z=1 has 4 ranks but 2 perlmutter node\(s\) x 4 "
        r"GPUs per node = 8 ranks",
    ):
        J.plan_job(J.JobRequest("perlmutter", "gpt-5b", 2, grid="data=2,x=2"))
    cases = [
        (["--machine", "perlmutter", "--model", "gpt-5b", "--nodes", "2", "--grid", "x=3"], "has 3 ranks"),
        (["--machine", "summit", "--model", "gpt-5b", "--nodes", "2"], "unknown machine 'summit'"),
        (["--machine", "alps", "--model", "gpt-7b", "--nodes", "2"], "unknown config 'gpt-7b'"),
        (["--machine", "alps", "--model", "gpt-5b", "--nodes", "0"], "at least 1 node"),
        (["--machine", "alps", "--model", "gpt-5b", "--nodes", "2", "--grid", "q=8"], "unknown grid axis"),
        (["--machine", "alps", "--model", "gpt-5b", "--nodes", "2", "--time", "90"], "HH:MM:SS"),
        (["--machine", "alps", "--model", "gpt-5b", "--nodes", "2", "--set", "train.nope=1"], "train.nope"),
        (["--machine", "perlmutter", "--model", "gpt-640b", "--nodes", "1"], "no feasible grid"),
    ]
    for argv, msg in cases:
        assert J.main(argv + ["--dry-run"]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, err
    J.main(["--machine", "perlmutter", "--model", "gpt-640b", "--nodes", "1", "--dry-run"])
    err = capsys.readouterr().err
    assert err.count("memory") >= 3 and "GiB" in err  # the closest grids' reasons are listed


def test_cli_dry_run_and_write(capsys, tmp_path):
    argv = [
        "--machine",
        "alps",
        "--model",
        "gpt-10b",
        "--nodes",
        "8",
        "--batch",
        "128",
        "--account",
        "a-g34",
        "--time",
        "01:00:00",
        "--set",
        "train.steps=5",
        *(x for s in FIXED for x in ("--set", s)),
    ]
    assert J.main(argv + ["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "#SBATCH --account=a-g34\n" in text and "#SBATCH --time=01:00:00" in text
    assert "--set train.steps=5" in text and "--set train.global_batch=128" in text
    assert "generated by: python -m launch.job --machine alps" in text
    out = tmp_path / "sub" / "j.sbatch"
    assert J.main(argv + ["--out", str(out)]) == 0
    written = out.read_text()
    assert written.split("\n", 2)[2] == text.split("\n", 2)[2] and os.access(out, os.X_OK)
    assert "--dry-run" not in text and f"--out {out}" in written
    # an explicit checkpointing choice is passed to the perf model and not overridden
    plan = J.plan_job(J.JobRequest("alps", "gpt-10b", 8, sets=("train.activation_checkpointing=true", *FIXED)))
    assert plan.checkpointing is True and sum("activation_checkpointing" in s for s in plan.sets) == 1
    # the config's rank order reaches the perf model (it decides which groups stay inside a node)
    plan = J.plan_job(
        J.JobRequest("frontier", "gpt-5b", 8, sets=("parallel.order=data,x,y,z", "parallel.z_split=batch"))
    )
    assert plan.grid.order == ("data", "x", "y", "z") == plan.estimate.grid.order


def test_template_helpers():
    assert J.fill("a {{x}} b", {"x": "1"}) == "a 1 b"
    with pytest.raises(J.JobError, match="{{y}}"):
        J.fill("{{y}}", {})
    env = "export A=1 B=2  # x\n# export C=3\nif [ 1 ]; then export D=\"q r\"; fi\n"
    assert J.exported_names(env) == ["A", "B", "D"]
    assert J.template_path("slurm", "nowhere").name == "generic.sbatch"


# ---- weak scaling: series ---------------------------------------------------------------------
def test_model_ladder():
    assert W.model_ladder([8, 16, 32]) == ["gpt-5b", "gpt-10b", "gpt-20b"]
    assert W.model_ladder([16, 2048])[-1] == "gpt-640b"
    assert W.model_ladder([1, 3], ["tiny", "small"]) == ["tiny", "small"]
    for nodes, msg in (([8, 24], "power-of-two"), ([1, 256], "after gpt-640b")):
        with pytest.raises(W.WeakScalingError, match=msg):
            W.model_ladder(nodes)
    with pytest.raises(W.WeakScalingError, match="ascending"):
        W.parse_int_list("16,8", "--nodes")


def test_generate_series(tmp_path):
    m = W.generate("frontier", [8, 16], tmp_path, steps=7, sets=FIXED)
    assert [(p["gpus"], p["model"]) for p in m["points"]] == [(64, "gpt-5b"), (128, "gpt-10b")]
    for p in m["points"]:
        text = (tmp_path / p["script"]).read_text()
        assert f"--grid {p['grid']}" in text and f"RUN_DIR:-{p['run_dir']}" in text
        assert "train.steps=7" in text and "checkpoint.at_end=false" in text
        assert "#SBATCH --time=00:30:00" in text  # 15 min + 2 x predicted steps, at least 30 min
        pred = json.loads((tmp_path / p["script"].replace(".sbatch", ".prediction.json")).read_text())
        assert pred["grid"] == p["grid"] and pred["feasible"] and pred["step_time_s"] > 0
    assert "sbatch frontier-gpt-10b-16n.sbatch" in (tmp_path / "submit_all.sh").read_text()


# ---- weak scaling: collection ---------------------------------------------------------------
def _metrics(path: Path, kept: list[tuple[float, float]], warm: int = 2, peak: float = 50.0) -> None:
    """Warm-up steps (slow, to be skipped) then ``kept`` (step_time_s, tflops_per_device)."""
    path.mkdir(parents=True, exist_ok=True)
    rows = [(9.0, 1.0)] * warm + kept
    lines = [
        json.dumps(
            {"step": i, "step_time_s": t, "tflops_per_device": f, "peak_tflops": peak, "grid": "data=1", "loss": 1.0}
        )
        for i, (t, f) in enumerate(rows)
    ]
    lines.insert(3, json.dumps({"step": 2, "val_loss": 1.0}))  # eval records carry no timing
    path.joinpath("metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_collect_hand_computed(tmp_path):
    _metrics(tmp_path / "a", [(2.0, 10.0)] * 3)  # 20 TFLOP/step / 2 s = 10 TFLOP/s
    _metrics(tmp_path / "b", [(2.0, 10.0), (3.0, 20 / 3)])  # 20 TFLOP / 2.5 s = 8 (not mean 8.33)
    _metrics(tmp_path / "c", [(4.0, 5.0)] * 2)  # 5 TFLOP/s
    points = [
        (8, "m2", "g", tmp_path / "b", {"step_time_s": 2.0, "tflops_per_gpu": 1.0}),
        (4, "m1", "g", tmp_path / "a", {"step_time_s": 1.6, "tflops_per_gpu": 1.0}),
        (16, "m3", "g", tmp_path / "c", None),
        (32, "m4", "g", tmp_path / "missing", {"step_time_s": 3.0, "tflops_per_gpu": 4.0}),
    ]
    rows = WT.collect_rows(points, skip=2)
    assert [r.gpus for r in rows] == [4, 8, 16, 32]
    a, b, c, d = rows
    assert (a.steps, a.step_time_s, a.tflops_per_gpu) == (3, pytest.approx(2.0), pytest.approx(10.0))
    assert b.step_time_s == pytest.approx(2.5) and b.tflops_per_gpu == pytest.approx(8.0)
    assert [r.efficiency for r in (a, b, c)] == [pytest.approx(1.0), pytest.approx(0.8), pytest.approx(0.5)]
    assert c.pct_peak == pytest.approx(10.0) and a.pred_tflops_per_gpu == pytest.approx(20 / 1.6)
    assert d.step_time_s is None and d.efficiency is None and d.pred_tflops_per_gpu == 4.0 and d.note
    md = WT.markdown(rows, "T")
    assert "| 8 | m2 | data=1 | 2 | 2.5 | 2 | 8 | 10 | 16.0 | 80.0% |" in md
    assert "| 32 | m4 | g | — | — | 3 | — | 4 | — | — |" in md
    WT.write_outputs(rows, tmp_path / "out" / "ws", "T")
    assert (tmp_path / "out" / "ws.png").stat().st_size > 1000
    csv = (tmp_path / "out" / "ws.csv").read_text().splitlines()
    assert csv[0].startswith("gpus,model,grid") and csv[2].split(",")[:2] == ["8", "m2"]


def test_collect_cli_on_manifest(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(WT, "plot", lambda rows, path, title: Path(path).write_text("png"))
    W.generate("perlmutter", [16, 32], tmp_path, sets=FIXED)
    m = json.loads((tmp_path / "manifest.json").read_text())
    _metrics(Path(m["points"][0]["run_dir"]), [(1.0, 100.0)] * 3)
    _metrics(Path(m["points"][1]["run_dir"]), [(1.0, 90.0)] * 3)
    assert W.main(["collect", str(tmp_path), "--skip", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 128 | gpt-10b |" in out and "90.0%" in out
    assert (tmp_path / "weak_scaling.md").is_file() and (tmp_path / "weak_scaling.csv").is_file()
    assert W.main(["collect", str(tmp_path / "nope")]) == 2


def test_local_with_fake_trainer(tmp_path, monkeypatch):
    monkeypatch.setattr(WL, "cpu_gemm_tflops", lambda *a, **k: 0.05)
    monkeypatch.setattr(WT, "plot", lambda rows, path, title: Path(path).write_text("png"))
    calls = []

    def fake_runner(cmd, env, log, timeout):
        calls.append(cmd)
        n = int(cmd[cmd.index("-n") + 1])
        _metrics(Path(cmd[cmd.index("--out") + 1]), [(0.01 * n, 0.01 / n)] * 4)
        return 0

    rows = WL.run_local([1, 2, 4], 6, tmp_path, runner=fake_runner)
    grids = [c[c.index("--grid") + 1] for c in calls]
    assert grids == ["data=1,x=1,y=1,z=1", "data=1,x=2,y=1,z=1", "data=1,x=2,y=1,z=2"]
    assert [c[c.index("--set") + 1] for c in calls] == [f"train.global_batch={8 * n}" for n in (1, 2, 4)]
    assert [r.efficiency for r in rows] == [pytest.approx(1), pytest.approx(1 / 2), pytest.approx(1 / 4)]
    assert all(r.pred_step_time_s > 0 for r in rows)
    assert (tmp_path / "weak_scaling.md").is_file() and (tmp_path / "weak_scaling.png").is_file()
    with pytest.raises(W.WeakScalingError, match="failed with status 3"):
        WL.run_local([1], 6, tmp_path / "x", runner=lambda *a: 3)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_templates_exist_for_each_machine():
    for machine in MACHINES:
        assert (J.TEMPLATE_DIR / "slurm" / f"{machine}.sbatch").is_file()
        assert (J.TEMPLATE_DIR / "env" / f"{machine}.sh").is_file()
