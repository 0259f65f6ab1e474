"""Bad-input catalogue: malformed inputs through the real CLI fail fast, clearly and cleanly.

Every case runs ``python -m axo4d.train ...`` (single process) or ``python -m launch.local
-n 2 --mode env -- axo4d.train ...`` and must: exit non-zero within its time limit, print
one clear error naming the offending value (asserted substrings, printed once), print no
traceback, and leave nothing that looks like a good run (no loss.png, no COMPLETE
checkpoint, metrics.jsonl absent or empty). The cases run concurrently (a few at a time)
from one module fixture; each is its own test.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", "tiny", "--set", "train.steps=1", "--set", "train.eval_interval=0"]
LIMIT_S = 150


@dataclass
class Case:
    id: str
    args: list[str]
    expect: list[str]
    ranks: int = 1
    env: dict = field(default_factory=dict)
    out: str = ""     # --out (default: a fresh folder per case)


def _files(tmp: Path) -> dict[str, Path]:
    """Inputs shared by the cases."""
    f = {"empty": tmp / "empty_dir", "text": tmp / "text", "yaml": tmp / "bad.yaml", "tok": tmp / "tok.json",
         "file": tmp / "a_file", "fake": tmp / "fake"}
    for k in ("empty", "text"):
        f[k].mkdir()
    (f["text"] / "a.txt").write_text("hello world\n" * 200)
    f["yaml"].write_text("model: {n_layer: [1, 2\ntrain: steps: 3\n")
    f["tok"].write_text('{"version": "1.0", "model": {"type": "nonsense"')
    f["file"].write_text("a regular file\n")
    (f["fake"] / "mpi4py").mkdir(parents=True)
    (f["fake"] / "mpi4py" / "__init__.py").write_text("raise ImportError('mpi4py is hidden by this test')\n")
    return f


def _checkpoints(tmp: Path) -> dict[str, Path]:
    """A good checkpoint (one real step), and corrupt/incomplete copies."""
    good = tmp / "good"
    p = subprocess.run([sys.executable, "-m", "axo4d.train", *TINY, "--out", str(good)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode == 0, p.stderr[-2000:]
    ck = good / "checkpoints" / "step_000001"
    trunc = tmp / "trunc" / "step_000001"
    shutil.copytree(ck, trunc)
    shard = next(trunc.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    partial = tmp / "partial" / "step_000001"
    shutil.copytree(ck, partial)
    (partial / "COMPLETE").unlink()
    return {"good": ck, "trunc": trunc, "partial": partial}


def _cases(f: dict[str, Path], ck: dict[str, Path]) -> list[Case]:
    return [
        Case("grid-malformed", ["--grid", "x2"], ["malformed grid spec", "'x2'"]),
        Case("grid-unknown-axis", ["--grid", "w=2"], ["unknown grid axis 'w'"]),
        Case("grid-axis-zero", ["--grid", "x=0"], ["x=0", "must be an integer >= 1"]),
        Case("grid-world-1", ["--grid", "x=2"], ["has 2 ranks but the job has 1"]),
        Case("grid-world-2", ["--grid", "x=4"], ["has 4 ranks but the job has 2"], ranks=2),
        Case("heads-vs-y", ["--grid", "y=2", "--set", "model.n_head=3", "--set", "model.n_embd=48"],
             ["n_head=3 not divisible by G_y=2"]),
        Case("hidden-vs-x", ["--grid", "x=2", "--set", "model.n_embd=63", "--set", "model.n_head=3"],
             ["n_embd=63 not divisible by G_x=2"]),
        Case("batch-vs-data-z", ["--grid", "data=2,z=2", "--set", "train.global_batch=6"],
             ["micro-batch of 6", "G_data*G_z=4"]),
        Case("unknown-key", ["--set", "train.stepz=5"], ["unknown config key 'train.stepz'"]),
        Case("mistyped-value", ["--set", "train.steps=abc"], ["'train.steps' must be an integer", "'abc'"]),
        Case("bad-enum", ["--set", "train.nonfinite=ignore"], ["train.nonfinite='ignore'", "stop, skip"]),
        Case("zero-steps", ["--set", "train.steps=0"], ["train.steps=0 must be >= 1"]),
        Case("unknown-config", ["--config", "tinyy"], ["unknown config 'tinyy'"]),
        Case("missing-config-file", ["--config", "/nonexistent/run.yaml"], ["'/nonexistent/run.yaml' does not exist"]),
        Case("malformed-yaml", ["--config", str(f["yaml"])], [str(f["yaml"]), "is not valid YAML"]),
        Case("missing-data", ["--set", "data.source=/nonexistent/corpus"], ["'/nonexistent/corpus' does not exist"]),
        Case("empty-data-dir", ["--set", f"data.source={f['empty']}"], [str(f["empty"]), "the dataset is empty"]),
        Case("corrupt-tokenizer", ["--set", f"data.source={f['text']}", "--set", f"data.tokenizer={f['tok']}"],
             [str(f["tok"]), "not a valid HuggingFace tokenizer.json"]),
        Case("resume-missing", ["--resume", "/nonexistent/ckpt"], ["checkpoint '/nonexistent/ckpt' does not exist"]),
        Case("resume-truncated", ["--resume", str(ck["trunc"])], [str(ck["trunc"]), "is corrupt", ".distcp",
                                                                  "truncated"]),
        Case("resume-truncated-2", ["--resume", str(ck["trunc"]), "--grid", "data=2"],
             [str(ck["trunc"]), "is corrupt"], ranks=2),
        Case("resume-incomplete", ["--resume", str(ck["partial"])], [str(ck["partial"]), "incomplete"]),
        Case("resume-other-model", ["--resume", str(ck["good"]), "--set", "model.n_embd=128"],
             ["another model", "model.n_embd=64 (this run: 128)"]),
        Case("out-under-file", [], [str(f["file"] / "sub"), "not usable", "Not a directory"],
             out=str(f["file"] / "sub")),
        Case("mpi-missing", ["--launcher", "mpi"], ["MPI launch requested", "mpi4py is hidden by this test"],
             env={"PYTHONPATH": f"{f['fake']}{os.pathsep}{ROOT}"}),
    ]


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.update(extra or {})
    return env


def _run(case: Case, out: Path) -> dict:
    argv = [*TINY, *case.args, "--out", case.out or str(out)]
    if case.ranks == 1:
        cmd = [sys.executable, "-m", "axo4d.train", *argv]
    else:
        cmd = [sys.executable, "-m", "launch.local", "-n", str(case.ranks), "--mode", "env", "--",
               "axo4d.train", *argv]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(case.env), capture_output=True, text=True, timeout=LIMIT_S)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", (e.stderr or b"").decode(errors="replace")
    return {"rc": rc, "stderr": err, "s": time.time() - t0, "out": Path(case.out or out)}


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory) -> dict[str, tuple[Case, dict]]:
    tmp = tmp_path_factory.mktemp("cli_errors")
    t0 = time.time()
    cases = _cases(_files(tmp), _checkpoints(tmp))
    with ThreadPoolExecutor(3) as pool:
        res = list(pool.map(lambda c: _run(c, tmp / "out" / c.id), cases))
    print(f"\n{len(cases)} bad inputs in {time.time() - t0:.1f}s (incl. one good 1-step run):")
    for c, r in zip(cases, res):
        line = r["stderr"].strip().splitlines()[-1] if r["stderr"].strip() else "(no stderr)"
        print(f"  {c.id:20s} exit {r['rc']} {r['s']:5.1f}s  {line[:160]}")
    return {c.id: (c, r) for c, r in zip(cases, res)}


CASE_IDS = [c.id for c in _cases({k: Path("/x") for k in ("empty", "text", "yaml", "tok", "file", "fake")},
                                 {k: Path("/x") for k in ("good", "trunc", "partial")})]


def test_catalogue_size() -> None:
    assert len(CASE_IDS) >= 15 and len(set(CASE_IDS)) == len(CASE_IDS)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_bad_input(catalogue, case_id: str) -> None:
    case, r = catalogue[case_id]
    err = r["stderr"]
    assert r["rc"] != "timeout", f"no exit within {LIMIT_S}s"
    assert r["rc"] != 0, f"exit status 0 for bad input; stderr: {err[-500:]}"
    assert "Traceback" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1, f"expected one error line, got {len(errors)}:\n{err[-2000:]}"
    for s in case.expect:
        assert s in errors[0], f"{s!r} not in the error line: {errors[0]}"
    out = r["out"]
    assert not (out / "loss.png").exists()
    if out.is_dir():
        assert not list(out.rglob("COMPLETE")), "a COMPLETE checkpoint was left behind"
    metrics = out / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text().strip() == ""
