"""Bad-input catalogue: malformed inputs through the real CLI fail fast, clearly and cleanly.

Every case runs ``python -m axo4d.train ...`` (single process), ``python -m launch.local
-n 2 --mode env -- axo4d.train ...`` or another command line (``axo4d.generate``, ``axo4d.data``)
and must: exit with status 2 within its time limit, print
one clear error naming the offending value (asserted substrings, printed once), print no
traceback, and leave nothing that looks like a good run (no loss.png, no COMPLETE
checkpoint, metrics.jsonl absent or empty). Cases marked ``existing`` run with ``--out`` a copy
of a finished run's folder and must leave every file of it as it was (no input check may come
after ``--out`` is touched). The single-process cases run in :mod:`tests.forked_cli` (the
commands imported once, each case in a forked child: the import was nearly all of each case's
time), the others as subprocesses beside them, all from one module fixture; each is its own test.
The checkpoint command line's errors follow the catalogue.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.forked_cli import run_many

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config", "tiny", "--set", "train.steps=1", "--set", "train.eval_interval=0"]
LIMIT_S = 300  # a hang detector: on a quiet 2-core machine each case takes seconds
pytestmark = pytest.mark.timeout(1800)  # the catalogue fixture runs every case (a few minutes on 2 cores)


@dataclass
class Case:
    id: str
    args: list[str]
    expect: list[str]
    ranks: int = 1
    env: dict = field(default_factory=dict)
    out: str = ""  # --out (default: a fresh folder per case)
    existing: bool = False  # --out is a copy of a finished run that must stay unchanged
    command: str = "axo4d.train"  # another command line: ``args`` are its whole argv


def _files(tmp: Path) -> dict[str, Path]:
    """Inputs shared by the cases."""
    f = {
        "empty": tmp / "empty_dir",
        "text": tmp / "text",
        "yaml": tmp / "bad.yaml",
        "tok": tmp / "tok.json",
        "file": tmp / "a_file",
        "fake": tmp / "fake",
        "ids": tmp / "ids300.npy",
        "emptyyaml": tmp / "empty.yaml",
        "neg": tmp / "negative.npy",
        "nofield": tmp / "nofield.jsonl",
        "badindex": tmp / "badindex",
        "randcfg": tmp / "random.yaml",
        "randtxt": tmp / "prompts.txt",
        "randjsonl": tmp / "prompts.jsonl",
    }
    import numpy as np

    for k in ("empty", "text"):
        f[k].mkdir()
    (f["text"] / "a.txt").write_text("hello world\n" * 200)
    f["yaml"].write_text("model: {n_layer: [1, 2\ntrain: steps: 3\n")
    f["tok"].write_text('{"version": "1.0", "model": {"type": "nonsense"')
    f["file"].write_text("a regular file\n")
    f["emptyyaml"].write_text("# a config still to be written\n")
    noise = b"\xff" + np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()  # not UTF-8
    for k in ("randcfg", "randtxt", "randjsonl"):
        f[k].write_bytes(noise)
    (f["fake"] / "mpi4py").mkdir(parents=True)
    (f["fake"] / "mpi4py" / "__init__.py").write_text("raise ImportError('mpi4py is hidden by this test')\n")
    np.save(f["ids"], np.arange(20000, dtype=np.int64) % 300)  # ids up to 299 > vocabulary 256
    np.save(f["neg"], np.arange(20000, dtype=np.int64) % 200 - 3)  # ids from -3
    f["nofield"].write_text('{"text": "a document"}\n{"body": "no text field"}\n')
    f["badindex"].mkdir()  # a prepared folder whose index ends past its token file
    np.arange(1000, dtype=np.uint16).tofile(f["badindex"] / "tokens.u16")
    np.save(f["badindex"] / "documents.npy", np.array([0, 600, 1200], np.int64))
    (f["badindex"] / "dataset.json").write_text(
        '{"format": "axo4d-tokens/1", "tokens_file": "tokens.u16", "dtype": "uint16", "documents": 2, '
        '"tokens": 1000, "separator": [10], "vocab_size": 256}'
    )
    return f


def flip_byte_in(ckpt: Path, key_part: str) -> str:
    """Change one byte (same size) inside the stored bytes of the first DCP entry whose key holds
    ``key_part``, in place; returns the file name."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if key_part in k.fqn)
    f = ckpt / info.relative_path
    data = bytearray(f.read_bytes())
    data[info.offset + info.length - 9] ^= 0x40  # inside the tensor's bytes, near the end of its record
    f.write_bytes(bytes(data))
    return info.relative_path


def _checkpoints(tmp: Path) -> dict[str, Path]:
    """A good checkpoint (one real step), and corrupt/incomplete copies."""
    good = tmp / "good"
    p = subprocess.run(
        [sys.executable, "-m", "axo4d.train", *TINY, "--out", str(good)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    ck = good / "checkpoints" / "step_000001"
    trunc = tmp / "trunc" / "step_000001"
    shutil.copytree(ck, trunc)
    shard = next(trunc.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    partial = tmp / "partial" / "step_000001"
    shutil.copytree(ck, partial)
    (partial / "COMPLETE").unlink()
    out = {"good": ck, "trunc": trunc, "partial": partial, "run": good}
    for name, key in (("flip_weight", "attn.qkv.weight"), ("flip_adam", "exp_avg_sq"), ("flip_mlp", "mlp.up.weight")):
        out[name] = tmp / name / "step_000001"
        shutil.copytree(ck, out[name])
        flip_byte_in(out[name], key)
    out["corrupt_run"] = tmp / "corrupt_run"
    shutil.copytree(good, out["corrupt_run"])
    flip_byte_in(out["corrupt_run"] / "checkpoints" / "step_000001", "attn.qkv.weight")
    return out


def _cases(f: dict[str, Path], ck: dict[str, Path]) -> list[Case]:
    return [
        Case("grid-malformed", ["--grid", "x2"], ["malformed grid spec", "'x2'"]),
        Case("grid-unknown-axis", ["--grid", "w=2"], ["unknown grid axis 'w'"]),
        Case("grid-axis-zero", ["--grid", "x=0"], ["x=0", "must be an integer >= 1"]),
        Case("grid-world-1", ["--grid", "x=2"], ["has 2 ranks but the job has 1"]),
        Case("grid-world-2", ["--grid", "x=4"], ["has 4 ranks but the job has 2"], ranks=2),
        Case(
            "heads-vs-y",
            ["--grid", "y=2", "--set", "model.n_head=3", "--set", "model.n_embd=48"],
            ["n_head=3 not divisible by G_y=2"],
        ),
        Case(
            "hidden-vs-x",
            ["--grid", "x=2", "--set", "model.n_embd=63", "--set", "model.n_head=3"],
            ["n_embd=63 not divisible by G_x*G_y=2"],
        ),
        Case(
            "batch-vs-data-z",
            ["--grid", "data=2,z=2", "--set", "train.global_batch=6"],
            ["micro-batch of 6", "G_data*G_z=4"],
        ),
        Case("unknown-key", ["--set", "train.stepz=5"], ["unknown config key 'train.stepz'"]),
        Case("mistyped-value", ["--set", "train.steps=abc"], ["'train.steps' must be an integer", "'abc'"]),
        Case("bad-enum", ["--set", "train.nonfinite=ignore"], ["train.nonfinite='ignore'", "stop, skip"]),
        Case("negative-steps", ["--set", "train.steps=-1"], ["train.steps=-1 must be >= 0"]),
        Case("unknown-config", ["--config", "tinyy"], ["unknown config 'tinyy'"]),
        Case("missing-config-file", ["--config", "/nonexistent/run.yaml"], ["'/nonexistent/run.yaml' does not exist"]),
        Case("malformed-yaml", ["--config", str(f["yaml"])], [str(f["yaml"]), "is not valid YAML"]),
        Case("missing-data", ["--set", "data.source=/nonexistent/corpus"], ["'/nonexistent/corpus' does not exist"]),
        Case("empty-data-dir", ["--set", f"data.source={f['empty']}"], [str(f["empty"]), "the dataset is empty"]),
        Case(
            "corrupt-tokenizer",
            ["--set", f"data.source={f['text']}", "--set", f"data.tokenizer={f['tok']}"],
            [str(f["tok"]), "not a valid HuggingFace tokenizer.json"],
        ),
        Case("resume-missing", ["--resume", "/nonexistent/ckpt"], ["checkpoint '/nonexistent/ckpt' does not exist"]),
        Case(
            "resume-truncated", ["--resume", str(ck["trunc"])], [str(ck["trunc"]), "is corrupt", ".distcp", "truncated"]
        ),
        Case(
            "resume-truncated-2",
            ["--resume", str(ck["trunc"]), "--grid", "data=2"],
            [str(ck["trunc"]), "is corrupt"],
            ranks=2,
        ),
        Case("resume-incomplete", ["--resume", str(ck["partial"])], [str(ck["partial"]), "incomplete"]),
        Case(
            "resume-other-model",
            ["--resume", str(ck["good"]), "--set", "model.n_embd=128"],
            ["another model", "model.n_embd=64 (this run: 128)"],
        ),
        Case(
            "out-under-file", [], [str(f["file"] / "sub"), "not usable", "Not a directory"], out=str(f["file"] / "sub")
        ),
        Case(
            "mpi-missing",
            ["--launcher", "mpi"],
            ["MPI launch requested", "mpi4py is hidden by this test"],
            env={"PYTHONPATH": f"{f['fake']}{os.pathsep}{ROOT}"},
        ),
        # model shapes that cannot be (one line, not a ZeroDivisionError)
        *[
            Case(f"model-{k.replace('_', '-')}-zero", ["--set", f"model.{k}=0"], [f"model.{k}=0 must be >= 1"])
            for k in ("n_head", "vocab_multiple")
        ],  # the others: test_values_checked_before_start
        Case("log-interval-zero", ["--set", "train.log_interval=0"], ["train.log_interval=0 must be >= 1"]),
        # checked before --out is touched: a finished run's folder stays as it was
        Case(
            "token-ids-out-of-range",
            ["--set", f"data.source={f['ids']}"],
            ["token id 299", "outside the model vocabulary 0..255"],
            existing=True,
        ),
        Case("val-fraction", ["--set", "data.val_fraction=1.5"], ["data.val_fraction=1.5"], existing=True),
        Case("dtype", ["--set", "train.dtype=fp64"], ["train.dtype='fp64'", "auto, fp32, bf16"], existing=True),
        Case(
            "seq-len-vs-data",
            ["--set", "data.max_tokens=600", "--set", "model.seq_len=64"],
            ["seq_len+1=65"],
            existing=True,
        ),
        # bad data: one line naming the file and what is wrong, before --out is touched
        Case(
            "token-ids-negative",
            ["--set", f"data.source={f['neg']}"],
            [str(f["neg"]), "token id -3", "is negative"],
            existing=True,
        ),
        Case(
            "jsonl-missing-field",
            ["--set", f"data.source={f['nofield']}"],
            [str(f["nofield"]), "line 2 has no string field 'text'"],
            existing=True,
        ),
        Case(
            "index-mismatch",
            ["--set", f"data.source={f['badindex']}"],
            [str(f["badindex"] / "documents.npy"), "does not match its token file", "holds 1000 tokens"],
            existing=True,
        ),
        Case(
            "mixture-weights",
            ["--set", f"data.sources=[{{path: {f['text']}, weight: 0}}, {{path: {f['ids']}, weight: 0}}]"],
            ["data.sources weights must sum to a positive number", str(f["text"])],
            existing=True,
        ),
        Case("vocab-size-zero-existing", ["--set", "model.vocab_size=0"], ["model.vocab_size=0"], existing=True),
        Case("out-in-use", [], ["is in use by another run", "pid"], existing=True),
        # silent corruption: one byte changed in place (same size) is found by its checksum
        Case(
            "resume-corrupt-weight",
            ["--resume", str(ck["flip_weight"])],
            [str(ck["flip_weight"]), "is corrupt", "'__0_0.distcp'", "checksum"],
        ),
        Case("resume-corrupt-adam", ["--resume", str(ck["flip_adam"])], ["is corrupt", "'__0_0.distcp'", "checksum"]),
        Case(
            "resume-corrupt-2",
            ["--resume", str(ck["flip_weight"]), "--grid", "data=2"],
            ["is corrupt", "checksum"],
            ranks=2,
        ),
        # every load verified (issue 22): --init-from an axo4d checkpoint read a flipped byte without a word
        Case(
            "init-from-corrupt",
            ["--init-from", str(ck["flip_mlp"])],
            [str(ck["flip_mlp"]), "is corrupt", "'__0_0.distcp'", "checksum"],
            existing=True,
        ),
        Case(
            "init-from-corrupt-2",
            ["--init-from", str(ck["flip_mlp"]), "--grid", "data=2"],
            ["is corrupt", "'__0_0.distcp'", "checksum"],
            ranks=2,
        ),
        # found by a probe (issue 22): tracebacks, a reset --out, a kernel OOM kill, silent defaults
        Case(
            "lr-overflow", ["--set", "train.lr=1e300"], ["train.lr=1e+300 is beyond", "largest float32"], existing=True
        ),
        Case(
            "steps-beyond-int64",
            ["--set", "train.steps=99999999999999999999999"],
            ["'train.steps'=99999999999999999999999 is too large"],
        ),
        Case("empty-yaml", ["--config", str(f["emptyyaml"])], [str(f["emptyyaml"]), "is empty"]),
        Case(
            "batch-beyond-memory",
            ["--set", "train.global_batch=1000000"],
            ["does not fit this machine's memory", "available host memory / 1 ranks", "largest term: activations"],
            existing=True,
        ),
        Case(
            "layers-beyond-memory",
            ["--set", "model.n_layer=100000"],
            ["does not fit this machine's memory", "parameters)"],
            existing=True,
        ),
        Case(
            "batch-astronomical",
            ["--set", "train.global_batch=100000000000"],
            ["does not fit this machine's memory"],
        ),
        # found by a probe (issue 33 item 7): four tracebacks and a misleading line
        Case("config-random-bytes", ["--config", str(f["randcfg"])], [str(f["randcfg"]), "is not UTF-8 text"]),
        Case("config-folder", ["--config", str(f["empty"])], [str(f["empty"]), "is a folder, not a file"]),
        *[
            Case(
                f"prompts-file-random-{k[4:]}",
                ["--init-from", str(ck["good"]), "--prompts-file", str(f[k])],
                ["--prompts-file", str(f[k]), "is not UTF-8 text", "give a UTF-8 text file"],
                command="axo4d.generate",
            )
            for k in ("randtxt", "randjsonl")
        ],
        Case(
            "prepare-out-under-file",
            ["prepare", str(f["text"]), "--tokenizer", "byte", "--out", str(f["file"] / "sub")],
            [str(f["file"] / "sub"), f"under {str(f['file'])!r}, which is a file"],
            out=str(f["file"] / "sub"),
            command="axo4d.data",
        ),
        Case(
            "resume-auto-none-usable",
            ["--resume", "auto"],
            ["no usable checkpoint", "checksum"],
            out=str(ck["corrupt_run"]),
            existing=True,
        ),
    ]


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.update(extra or {})
    return env


def _snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``folder``: (size, mtime, first bytes) by relative path."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()[:4096])
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _command(case: Case, out: Path) -> list[str]:
    """The case's argv after ``python``."""
    if case.command != "axo4d.train":
        return ["-m", case.command, *case.args]
    argv = [*TINY, *case.args, "--out", str(out)]
    if case.ranks == 1:
        return ["-m", "axo4d.train", *argv]
    return ["-m", "launch.local", "-n", str(case.ranks), "--mode", "env", "--", "axo4d.train", *argv]


def _forkable(case: Case) -> bool:
    """One process in the runner's environment: run by :mod:`tests.forked_cli` (shared imports)."""
    return case.ranks == 1 and not case.env


def _prepare(case: Case, out: Path, ck: dict[str, Path]) -> dict:
    """The case's ``--out`` as it must be before the run (copied, locked, snapshotted)."""
    out = Path(case.out or out)
    lock = None
    if case.existing and not case.out:
        shutil.copytree(ck["run"], out)
    if case.id == "out-in-use":  # another run holds the folder
        lock = open(out / ".lock", "a")
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    return {"out": out, "lock": lock, "before": _snapshot(out) if case.existing else None}


def _subprocess(case: Case, out: Path) -> dict:
    t0 = time.time()
    try:
        p = subprocess.run(
            [sys.executable, *_command(case, out)],
            cwd=ROOT,
            env=_env(case.env),
            capture_output=True,
            text=True,
            timeout=LIMIT_S,
        )
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", (e.stderr or b"").decode(errors="replace")
    return {"rc": rc, "stderr": err, "s": time.time() - t0}


def _forked(cases: list[Case], outs: list[Path], tmp: Path) -> list[dict]:
    """The cases run by :mod:`tests.forked_cli` (one import of the commands, a fork per case)."""
    return run_many([_command(c, o)[1:] for c, o in zip(cases, outs)], tmp, LIMIT_S)


def _run_all(cases: list[Case], tmp: Path, ck: dict[str, Path]) -> list[dict]:
    """Every case's outcome: forkable cases in the fork runner, the others (several ranks, their
    own environment) as subprocesses beside it; ``--out`` prepared before and snapshotted after."""
    outs = [tmp / "out" / c.id for c in cases]
    state = [_prepare(c, o, ck) for c, o in zip(cases, outs)]
    fork = [i for i, c in enumerate(cases) if _forkable(c)]
    rest = [i for i, c in enumerate(cases) if not _forkable(c)]
    res: dict[int, dict] = {}
    with ThreadPoolExecutor(1) as pool:
        later = pool.map(lambda i: _subprocess(cases[i], state[i]["out"]), rest)
        tmp_jobs = tmp / "forked"
        tmp_jobs.mkdir()
        res.update(zip(fork, _forked([cases[i] for i in fork], [state[i]["out"] for i in fork], tmp_jobs)))
        res.update(zip(rest, later))
    for i, c in enumerate(cases):
        st = state[i]
        if st["lock"] is not None:
            st["lock"].close()
        res[i].update(out=st["out"], before=st["before"], after=_snapshot(st["out"]) if c.existing else None)
    return [res[i] for i in range(len(cases))]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[dict[str, Path], dict[str, Path]]:
    """Inputs, and a good checkpoint (one real step) with corrupt copies, shared by this module."""
    tmp = tmp_path_factory.mktemp("cli_inputs")
    return _files(tmp), _checkpoints(tmp)


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory, files) -> dict[str, tuple[Case, dict]]:
    tmp = tmp_path_factory.mktemp("cli_errors")
    t0 = time.time()
    cases = _cases(*files)
    res = _run_all(cases, tmp, files[1])
    print(f"\n{len(cases)} bad inputs in {time.time() - t0:.1f}s:")
    for c, r in zip(cases, res):
        line = r["stderr"].strip().splitlines()[-1] if r["stderr"].strip() else "(no stderr)"
        print(f"  {c.id:26s} exit {r['rc']} {r['s']:5.1f}s  {line[:160]}")
    return {c.id: (c, r) for c, r in zip(cases, res)}


_NAMES = ("empty", "text", "yaml", "tok", "file", "fake", "ids", "emptyyaml", "neg", "nofield", "badindex")
_NAMES += ("randcfg", "randtxt", "randjsonl")
CASE_IDS = [
    c.id
    for c in _cases(
        {k: Path("/x") for k in _NAMES},
        {
            k: Path("/x")
            for k in ("good", "trunc", "partial", "run", "flip_weight", "flip_adam", "flip_mlp", "corrupt_run")
        },
    )
]


def test_catalogue_size() -> None:
    assert len(CASE_IDS) >= 15 and len(set(CASE_IDS)) == len(CASE_IDS)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_bad_input(catalogue, case_id: str) -> None:
    case, r = catalogue[case_id]
    err = r["stderr"]
    assert r["rc"] != "timeout", f"no exit within {LIMIT_S}s"
    assert r["rc"] == 2, f"exit status {r['rc']} for bad input (2 expected); stderr: {err[-500:]}"
    assert "Traceback" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1, f"expected one error line, got {len(errors)}:\n{err[-2000:]}"
    for s in case.expect:
        assert s in errors[0], f"{s!r} not in the error line: {errors[0]}"
    out = r["out"]
    if case.existing:
        changed = sorted(k for k in set(r["before"]) | set(r["after"]) if r["before"].get(k) != r["after"].get(k))
        assert not changed, f"a rejected run changed {changed} in the existing --out"
        return
    assert not (out / "loss.png").exists()
    if out.is_dir():
        assert not list(out.rglob("COMPLETE")), "a COMPLETE checkpoint was left behind"
    metrics = out / "metrics.jsonl"
    assert not metrics.exists() or metrics.read_text().strip() == ""


# ---- python -m axo4d.checkpoint ---------------------------------------------------------------
def _ckpt_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "axo4d.checkpoint", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
    )


def _one_error_line(p: subprocess.CompletedProcess, *expect: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("axo4d.checkpoint: error:"), p.stderr
    for s in expect:
        assert s in lines[0], f"{s!r} not in {lines[0]!r}"


def test_checkpoint_cli_export_and_verify(files, tmp_path: Path) -> None:
    """export to a missing folder is one line; export and verify find a byte changed in place."""
    _, ck = files
    out = tmp_path / "out"
    out.mkdir()
    c = "axo4d.checkpoint"
    cmds = {
        "export-missing": [c, "export", str(ck["good"]), str(out / "missing" / "m.safetensors")],
        "export-corrupt": [c, "export", str(ck["flip_weight"]), str(out / "m.safetensors")],
        "verify-corrupt": [c, "verify", str(ck["flip_adam"])],
        "verify-good": [c, "verify", str(ck["run"])],
        "export-hf-corrupt": [c, "export-hf", str(ck["flip_mlp"]), str(out / "hf")],
        "list-corrupt": [c, "list", str(ck["flip_mlp"])],
        "list-good": [c, "list", str(ck["run"])],
        "list-sizes": [c, "list", "--sizes-only", str(ck["flip_mlp"])],
        "generate-corrupt": ["axo4d.generate", "--init-from", str(ck["flip_mlp"]), "--prompt", "def f"],
    }
    # independent command lines: one fork runner (tests.forked_cli) for them all
    r = dict(zip(cmds, (_done(x) for x in run_many(list(cmds.values()), tmp_path / "forked", LIMIT_S))))
    _one_error_line(r["export-missing"], "does not exist", str(out / "missing"))
    _one_error_line(r["export-corrupt"], "is corrupt", "'__0_0.distcp'", "checksum")
    _one_error_line(r["verify-corrupt"], "'__0_0.distcp'", "checksum")
    ok = r["verify-good"]
    assert ok.returncode == 0 and "ok" in ok.stdout and "crc32 verified" in ok.stdout, ok.stderr + ok.stdout
    # every load verified (issue 22): export-hf wrote a weight off by 149 from a flipped byte, list said nothing
    _one_error_line(r["export-hf-corrupt"], "is corrupt", "'__0_0.distcp'", "checksum")
    left = sorted(p.name for p in out.iterdir())  # export's and export-hf's outputs share ``out``
    assert left in ([], ["hf"]) and not (left and any((out / "hf").iterdir())), f"a failed export left {left}"
    listed = r["list-corrupt"]
    assert listed.returncode == 2 and "CORRUPT: file '__0_0.distcp' does not match its checksum" in listed.stdout
    listed = r["list-good"]
    assert listed.returncode == 0 and "verified (crc32 of" in listed.stdout, listed.stdout + listed.stderr
    quick = r["list-sizes"]
    assert quick.returncode == 0 and "sizes checked (not verified)" in quick.stdout, quick.stdout + quick.stderr
    gen = r["generate-corrupt"]
    assert gen.returncode == 2 and "Traceback" not in gen.stderr, gen.stderr[-2000:]
    lines = [ln for ln in gen.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "is corrupt: file '__0_0.distcp' does not match its checksum" in lines[0], lines


def _done(r: dict) -> subprocess.CompletedProcess:
    """A :func:`run_many` result as ``subprocess.run``'s."""
    return subprocess.CompletedProcess([], r["rc"], r["stdout"], r["stderr"])


def test_checkpoint_cli_import_never_replaces_or_prunes(files, tmp_path: Path) -> None:
    """import into a run folder: an existing step is an error (nothing changed), other checkpoints
    are never pruned, and the note says which one --resume RUN would take."""
    _, ck = files
    model = tmp_path / "m.safetensors"
    assert _ckpt_cli("export", str(ck["good"]), str(model)).returncode == 0
    run = tmp_path / "run"
    shutil.copytree(ck["run"], run)  # holds step_000001 (with optimizer state)
    before = _snapshot(run)
    _one_error_line(
        _ckpt_cli("import", str(model), str(run), "--config", "tiny", "--step", "1"), "step_000001", "already exists"
    )
    assert _snapshot(run) == before, "a refused import changed the run folder"
    for step in ("0", "5", "7"):  # checkpoint.keep=1: import must still prune nothing
        p = _ckpt_cli("import", str(model), str(run), "--config", "tiny", "--set", "checkpoint.keep=1", "--step", step)
        assert p.returncode == 0, p.stderr
        assert f"wrote {run / 'checkpoints' / f'step_{int(step):06d}'}" in p.stdout
    assert sorted(c.name for c in (run / "checkpoints").iterdir()) == [
        "step_000000",
        "step_000001",
        "step_000005",
        "step_000007",
    ]
    assert (run / "checkpoints" / "step_000001" / "__0_0.distcp").read_bytes()[:4096] == before[
        "checkpoints/step_000001/__0_0.distcp"
    ][2]
    p = _ckpt_cli("import", str(model), str(run), "--config", "tiny", "--step", "2")
    assert "newer checkpoints" in p.stdout and "step_000007" in p.stdout, p.stdout
    assert _ckpt_cli("verify", str(run)).returncode == 0


def test_resume_auto_passes_over_a_corrupt_newest(files, tmp_path: Path) -> None:
    """--resume auto: the newest checkpoint fails its checksum -> a warning, then the one before;
    the corrupt one is set aside in checkpoints.prev."""
    _, ck = files
    run = tmp_path / "run"
    shutil.copytree(ck["run"], run)
    newest = run / "checkpoints" / "step_000002"
    shutil.copytree(run / "checkpoints" / "step_000001", newest)
    flip_byte_in(newest, "exp_avg_sq")
    p = subprocess.run(
        [sys.executable, "-m", "axo4d.train", *TINY, "--set", "train.steps=2", "--out", str(run), "--resume", "auto"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"warning: checkpoint '{newest}' is corrupt: file '__0_0.distcp' does not match its checksum" in p.stdout
    assert f"resumed from {run / 'checkpoints' / 'step_000001'}" in p.stdout, p.stdout
    assert (run / "checkpoints.prev" / "step_000002").is_dir()
    assert (run / "checkpoints" / "step_000002" / "COMPLETE").is_file()  # saved anew at the end


@pytest.mark.parametrize(
    "sets,expect",
    [
        (["model.n_layer=0"], "model.n_layer=0 must be >= 1"),
        (["model.n_embd=0"], "model.n_embd=0 must be >= 1"),
        (["model.vocab_size=0"], "model.vocab_size=0 must be >= 1"),
        (["model.n_head=0"], "model.n_head=0 must be >= 1"),
        (["model.vocab_multiple=0"], "model.vocab_multiple=0 must be >= 1"),
        (["model.seq_len=-1"], "model.seq_len=-1"),
        (["model.ffn_mult=0"], "model.ffn_mult=0 must be >= 1"),
        (["train.eval_batches=-1"], "train.eval_batches=-1"),
        (["train.epochs=-1"], "train.epochs=-1.0 must be >= 0"),
        (["parallel.init_timeout_s=0"], "parallel.init_timeout_s=0.0 must be > 0"),
        (["parallel.timeout_s=-1"], "parallel.timeout_s=-1.0 must be > 0"),
        (["train.warmup_steps=-1"], "train.warmup_steps=-1"),
        (["train.grad_clip=-1"], "train.grad_clip=-1.0"),
        (["data.max_tokens=-5"], "data.max_tokens=-5"),
        (["train.nonfinite_max_total=-1"], "train.nonfinite_max_total=-1"),
        (["parallel.dp_bucket_mb=0"], "dp_bucket_mb=0"),
    ],
)
def test_values_checked_before_start(sets: list[str], expect: str) -> None:
    """The checks python -m axo4d.train runs before any process group exists (one ConfigError each)."""
    from axo4d.config import load_config
    from axo4d.config.errors import ConfigError
    from axo4d.facts.grid import Grid
    from axo4d.train import check_run_config

    with pytest.raises(ConfigError) as e:
        check_run_config(load_config("tiny", sets), Grid())
    assert expect in str(e.value) and "\n" not in str(e.value)
