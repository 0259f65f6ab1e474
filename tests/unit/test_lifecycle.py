"""The life of a job, single-process parts (issue 22): stop signals and the step boundary's word,
the collective trace and its diagnosis, checksums from the bytes written, background saves,
the warning time of job scripts, the launcher's exit status. The multi-rank runs:
``tests/dist/test_lifecycle.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.dist.flight import CollectiveTrace, load_traces
from axo4d.dist.flight_report import diagnose, stuck_collectives, table
from axo4d.facts.grid import Grid
from axo4d.training.checkpointing import integrity
from axo4d.training.lifecycle import Stop, StopSignals, at_boundary, decode, encode


# ---- signals and the boundary ---------------------------------------------------------------
def test_boundary_word_round_trip_and_order():
    for failed in (False, True):
        for sig in (0, signal.SIGINT, signal.SIGUSR1, signal.SIGTERM):
            for rank in (0, 7, 4095):
                assert decode(encode(sig, rank, failed)) == (failed, sig, rank)
    # the max over ranks: a failed save beats any signal, a signal beats none, then the higher rank
    assert max(encode(signal.SIGTERM, 3, False), encode(0, 9, True)) == encode(0, 9, True)
    assert max(encode(0, 9, False), encode(signal.SIGUSR1, 1, False)) == encode(signal.SIGUSR1, 1, False)


def test_stop_signals_note_and_second_ctrl_c_raises(capfd):
    s = StopSignals("SIGUSR1,SIGTERM", rank=0).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)  # the handler runs in this (main) thread between bytecodes
        assert s.signum == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)  # the first signal is the one reported
        time.sleep(0.05)
        assert s.signum == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    finally:
        s.uninstall()
    assert "SIGUSR1: finishing this step, then saving a checkpoint and stopping" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_sighup_stops_like_sigterm_by_default(capfd):
    """A dropped SSH session (SIGHUP) saves and stops like SIGTERM under the default config."""
    from axo4d.config import load_config

    s = StopSignals(load_config("tiny").checkpoint.signals, rank=0).install()
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.05)
        assert s.signum == signal.SIGHUP
    finally:
        s.uninstall()
    assert "SIGHUP: finishing this step, then saving a checkpoint and stopping" in capfd.readouterr().err


def test_at_boundary_single_process():
    comm = Comm(Grid(), 0, init_groups=False)
    s = StopSignals("")
    assert at_boundary(comm, s, None) is None
    s.signum = signal.SIGTERM
    assert at_boundary(comm, s, None) == Stop(signal.SIGTERM, 0) and Stop(signal.SIGTERM, 0).name == "SIGTERM"


# ---- the collective trace -------------------------------------------------------------------
def test_ring_buffer_keeps_the_last_n_in_order():
    t = CollectiveTrace(rank=1, world=2, size=4)
    t.add_group("x", [0, 1])
    recs = [t.start("x", "all_reduce", 8 * i) for i in range(10)]
    for r in recs[:-1]:
        CollectiveTrace.end(r)
    snap = t.snapshot("timed out", recs[-1])
    assert [r["seq"] for r in snap["records"]] == [7, 8, 9, 10] and snap["last_seq"] == {"x": 10}
    assert snap["waiting"]["seq"] == 10 and snap["records"][-1]["end"] is None
    assert all(r["end"] is not None for r in snap["records"][:-1])


def _trace(rank: int, world: int, groups: dict, seqs: dict, waiting: tuple | None, t0: float = 100.0) -> dict:
    recs = []
    for g, n in seqs.items():
        recs += [
            {"group": g, "seq": s, "op": "all_reduce", "bytes": 8, "start": t0, "end": t0} for s in range(1, n + 1)
        ]
    w = None
    if waiting:
        g, s, op, start = waiting
        w = {"group": g, "seq": s, "op": op, "start": start}
        recs.append({"group": g, "seq": s, "op": op, "bytes": 8, "start": start, "end": None})
    return {"rank": rank, "world_size": world, "groups": groups, "last_seq": seqs, "waiting": w, "records": recs}


def test_diagnosis_names_a_stopped_rank():
    """Rank 2 stopped (no trace): its y partner waits in #5; the others wait later on world."""
    world = {"world": [0, 1, 2, 3]}
    tr = {
        0: _trace(0, 4, {**world, "y": [0, 1]}, {"y": 6, "world": 3}, ("world", 4, "all_reduce", 110.0)),
        1: _trace(1, 4, {**world, "y": [0, 1]}, {"y": 6, "world": 3}, ("world", 4, "all_reduce", 110.5)),
        3: _trace(3, 4, {**world, "y": [2, 3]}, {"y": 5, "world": 3}, ("y", 5, "all_gather", 105.0)),
    }
    lines = diagnose(tr, 4)
    assert lines[0].startswith("rank 2 is behind on y at #5: all_gather #5 over y (group ranks [2, 3])"), lines
    assert "rank 2 wrote no trace: stopped, hung or dead" in lines[0]
    assert lines[1].startswith("also stuck: all_reduce #4 over world") and "no trace from rank(s) [2]" in lines[-1]
    rows = table(tr, 4)
    assert "WAITING in #5 all_gather" in rows and "no trace (stopped, hung or dead)" in rows


def test_diagnosis_names_a_rank_that_skipped_a_collective():
    """Rank 1 did not enter world #4 (its last there is #3) and waits in z #9 its partner never entered."""
    g = {"world": [0, 1], "z": [0, 1]}
    tr = {
        0: _trace(0, 2, g, {"world": 4, "z": 8}, ("world", 4, "all_reduce", 100.0)),
        1: _trace(1, 2, g, {"world": 3, "z": 9}, ("z", 9, "all_gather", 100.2)),
    }
    first = diagnose(tr, 2)[0]
    assert first.startswith("rank 1 is behind on world at #4: all_reduce #4 over world (group ranks [0, 1])"), first
    assert "its last there: #3; rank 1 waits in all_gather #9 over z" in first
    stuck = stuck_collectives(tr, 2)
    assert [(e["group"], e["seq"], e["behind"]) for e in stuck] == [("world", 4, [1]), ("z", 9, [0])]


def test_diagnosis_when_nobody_is_behind_and_without_traces():
    g = {"world": [0, 1]}
    tr = {r: _trace(r, 2, g, {"world": 4}, ("world", 4, "all_reduce", 100.0)) for r in (0, 1)}
    assert diagnose(tr, 2)[0].startswith("every member entered all_reduce #4 over world")
    assert diagnose({}, 2) == ["no rank wrote a trace"]


def test_trace_failed_writes_the_file_and_reports(tmp_path, capfd):
    t = CollectiveTrace(rank=0, world=1, size=8, grid="data=1")
    t.add_group("world", [0])
    t.dump_into(tmp_path)
    rec = t.start("world", "all_reduce", 8)
    t.failed("all_reduce over world timed out", rec)
    t.failed("again", rec)  # once per process
    err = capfd.readouterr().err
    assert f"collective trace {tmp_path / 'rank_0.json'}: waiting in all_reduce #1 over world" in err
    assert "axo4d: hang diagnosis: every member entered all_reduce #1 over world" in err
    assert load_traces(tmp_path)[0]["failed"] == "all_reduce over world timed out"
    assert (tmp_path / "summary.txt").read_text().startswith("every member entered")
    cli = subprocess.run([sys.executable, "-m", "axo4d.trace", str(tmp_path)], capture_output=True, text=True)
    assert cli.returncode == 0 and "1 of 1 ranks wrote a trace" in cli.stdout and "WAITING in #1" in cli.stdout
    empty = subprocess.run(
        [sys.executable, "-m", "axo4d.trace", str(tmp_path / "none")], capture_output=True, text=True
    )
    assert empty.returncode == 2 and "no collective trace in" in empty.stderr


def test_trace_costs_little():
    """Recording is a few list/dict operations: well under 5 us per collective even on a loaded CPU."""
    t = CollectiveTrace(0, 2, 512)
    t0 = time.perf_counter()
    for _ in range(20000):
        CollectiveTrace.end(t.start("x", "all_gather", 1024))
    assert (time.perf_counter() - t0) / 20000 < 5e-6


# ---- checkpoints: checksums as written, background saves -------------------------------------------
def _checkpointer(tmp_path: Path, background: bool):
    from axo4d.models import build_model
    from axo4d.nn.context import as_context
    from axo4d.training.checkpointing.checkpointer import Checkpointer

    cfg = load_config("tiny")
    comm = Comm(Grid(), 0, init_groups=False)
    model = build_model(cfg.model, as_context(comm), seed=1)
    opt = torch.optim.AdamW(model.parameters())
    return Checkpointer(tmp_path, cfg, comm, model, opt, background=background), model


def test_checksums_are_of_the_bytes_written_and_background_saves_stage_the_state(tmp_path):
    ck, model = _checkpointer(tmp_path, background=True)
    sync = ck.save(1)
    manifest = json.loads((sync / "COMPLETE").read_text())
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "config.yaml", "meta.json"}
    for name, e in manifest["files"].items():  # hashed as written, equal to a re-read
        assert integrity.crc32_file(sync / name) == e["crc32"] and (sync / name).stat().st_size == e["bytes"]
    assert manifest["save"]["background"] is False and manifest["save"]["seconds"] >= manifest["save"]["blocked_s"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    path = ck.save(2, background=True)
    with torch.no_grad():  # training goes on while the write runs: the staged copy is saved
        for p in model.parameters():
            p.add_(1.0)
    assert ck.wait() == path and not ck.in_flight
    from axo4d.training.hf.weights import read_logical_tensor

    for name in ("wte", "blocks.0.mlp.up.weight"):
        assert torch.equal(read_logical_tensor(path, name).reshape(-1), before[name].reshape(-1))
    m = json.loads((path / "COMPLETE").read_text())
    assert m["save"]["background"] is True and integrity.verify(path, m["files"])[0] is None
    assert ck.last_save["step"] == 2 and ck.last_save["write_s"] > 0


def test_a_background_failure_is_kept_for_the_training_thread(tmp_path, monkeypatch):
    from axo4d.config.errors import CheckpointWriteError
    from axo4d.training.checkpointing import background

    ck, _ = _checkpointer(tmp_path, background=True)
    ck.save(1)

    def fail(*a, **k):
        raise CheckpointWriteError("rank 0: writing checkpoint failed: disk on fire")

    monkeypatch.setattr(background, "write_shards", fail)
    ck.save(2, background=True)
    while ck.in_flight:
        time.sleep(0.01)
    assert ck.failed()
    with pytest.raises(CheckpointWriteError, match="disk on fire; the partial checkpoint .step_000002.partial"):
        ck.wait()
    assert not ck.failed() and ck.last.name == "step_000001"
    assert not (tmp_path / "checkpoints" / ".step_000002.partial").exists()


# ---- job scripts and launchers --------------------------------------------------------------------
def test_warning_time_from_the_perf_model_or_the_last_run(tmp_path):
    from launch import job as J
    from perfmodel.saves import WARNING_FLOOR_S, save_seconds, warning_seconds

    assert warning_seconds(0.1, 5.0) == WARNING_FLOOR_S
    assert warning_seconds(60.0, 100.0) == int(1.5 * (60 + 200 + 30))
    assert warning_seconds(1e6, 1e6) == 65535
    grid = "data=8,x=4,y=4,z=2"  # given: ranking every grid of 256 GPUs is not what this tests
    plan = J.plan_job(J.JobRequest("perlmutter", "gpt-20b", 64, grid=grid))
    t, why = plan.signal
    assert t >= WARNING_FLOOR_S and "perf model" in why
    assert save_seconds(plan.model_cfg, 64, plan.machine) > save_seconds(plan.model_cfg, 128, plan.machine)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000010").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "step_time_s": 50.0}) + "\n" for i in range(5)))
    (run / "checkpoints" / "step_000010" / "COMPLETE").write_text(json.dumps({"files": {}, "save": {"seconds": 200}}))
    plan = J.plan_job(J.JobRequest("perlmutter", "gpt-20b", 64, grid=grid, run_dir=str(run), time="04:00:00"))
    t, why = plan.signal
    assert t == int(1.5 * (50 + 400 + 30)) and "the last run" in why
    text = J.render(plan)
    assert f"#SBATCH --signal=B:USR1@{t}\n" in text and "#SBATCH --requeue\n" in text
    assert "--resume auto" in text and 'scontrol requeue "${SLURM_JOB_ID}"' in text and not plan.warnings
    short = J.plan_job(J.JobRequest("perlmutter", "gpt-20b", 64, grid=grid, run_dir=str(run), time="00:12:00"))
    assert any("leaves" in w and "before the warning signal" in w for w in short.warnings), short.warnings


def test_launcher_status_prefers_a_rank_killed_by_a_signal(capfd):
    """launch.local --mode env reported 1 for a SIGKILLed rank when a peer's exit 1 was seen first;
    it names the rank on one line, as in mpi mode."""
    from launch.local import wait_all

    code = "import os, signal, sys, time; r = int(sys.argv[1]); time.sleep(0.3); "
    code += "os.kill(os.getpid(), signal.SIGKILL) if r == 1 else sys.exit(1)"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], start_new_session=True) for r in range(3)]
    time.sleep(1.5)  # every rank has ended before the launcher looks: one sweep sees them all
    assert wait_all(procs) == 137
    err = capfd.readouterr().err
    assert f"launch.local: rank 1 (pid {procs[1].pid}) was killed by SIGKILL; stopping the other ranks" in err, err
    resume = [subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(75)"]) for _ in range(2)]
    assert wait_all(resume) == 75


# ---- the staging copy in the memory model ---------------------------------------------------------
def test_staging_copy_is_priced_and_auto_stays_off_when_it_does_not_fit():
    from axo4d.config.errors import MemoryBudgetError
    from axo4d.facts.archs import model_spec
    from axo4d.facts.memory import Setup, memory
    from axo4d.facts.spec import Dtypes
    from axo4d.training.memory_plan import plan_memory

    grid = Grid.parse("x=2,z=2")
    spec = model_spec(load_config("tiny").model, grid)
    n = sum(spec.local_params().values())
    dt = Dtypes.for_compute("fp32")
    on = memory(spec, 100.0, dt, Setup(gpu=False, staging=True))
    off = memory(spec, 100.0, dt, Setup(gpu=False))
    assert on.host["staging"] == pytest.approx(12 * n) and off.host["staging"] == 0  # fp32 weight + 2 moments
    data2 = model_spec(load_config("tiny").model, Grid.parse("data=2"))
    shard = memory(data2, 100.0, dt, Setup(shard=True, staging=True))
    assert shard.host["staging"] == pytest.approx(12 * shard.owned_elements)
    cpu = torch.device("cpu")
    base = ["checkpoint.interval=5", "train.memory_budget_gb=1", "train.host_memory_gb=0.0001"]
    auto = plan_memory(load_config("tiny", base), Grid(), cpu)
    assert not auto.async_checkpoints and "checkpoint.async=auto: saves block training" in auto.note
    assert plan_memory(load_config("tiny", ["checkpoint.interval=5"]), Grid(), cpu).async_checkpoints
    assert not plan_memory(load_config("tiny", ["checkpoint.interval=0"]), Grid(), cpu).async_checkpoints
    with pytest.raises(MemoryBudgetError, match="the checkpoint staging copy needs .* with checkpoint.async=false"):
        plan_memory(load_config("tiny", [*base, "checkpoint.async=true"]), Grid(), cpu)


def test_steps_zero_evaluates_the_checkpoint_only(tmp_path):
    """train.steps=0 with --resume: the validation loss of the checkpoint's weights (equal to the
    trained run's last one, computed on the same weights), no step, no checkpoint, exit 0."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    common = ["--config", "tiny", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--launcher", "single"]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")

    def train(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "axo4d.train", *common, *args]
        return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)

    r = train("--set", "train.steps=2", "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr[-2000:]
    r = train("--set", "train.steps=0", "--resume", str(tmp_path / "a"), "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr[-2000:]
    val = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    got = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert got == [{"step": 2, "val_loss": val[-1]["val_loss"]}]
    assert not (tmp_path / "b" / "checkpoints").exists() or not any((tmp_path / "b" / "checkpoints").iterdir())


def test_orderly_exit_skips_the_interpreter_teardown(tmp_path: Path) -> None:
    """A rank that ends in order runs what a normal exit would (a non-daemon thread finishes, exit
    handlers run, its records are written, the status is kept) but not the teardown of every object
    (seconds for torch's, docs/faults.md): an object freed only by that teardown is never freed."""
    src = """
import atexit, sys, threading, time
from axo4d import exits
from axo4d.dist import rankfiles

class Teardown:
    def __del__(self):
        print("teardown ran", flush=True)

kept = Teardown()  # a module global: freed only by the interpreter's teardown
threading.Thread(target=lambda: (time.sleep(1.0), print("thread finished", flush=True))).start()
atexit.register(lambda: print("exit handler ran", flush=True))
rankfiles.register()
print("buffered", end="")
sys.exit(exits.orderly_exit(75))
"""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), AXO4D_RANK_FILES=str(tmp_path), RANK="3")
    p = subprocess.run([sys.executable, "-c", src], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 75, p.stderr
    for line in ("thread finished", "exit handler ran", "buffered"):
        assert line in p.stdout, p.stdout
    assert "teardown ran" not in p.stdout, p.stdout
    assert (tmp_path / "rank_3.exit").read_text().strip() == "75"
