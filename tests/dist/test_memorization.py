"""The memorization study end to end on 2 ranks (a smoke version of docs/memorization/): a tiny
model trained on a few random-letter documents memorizes them with the standard loss (exact match
1.0 after the last epoch, 0 before training), never the control bucket; every report file is
written and its numbers follow from the per-document records."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.dist.harness import ROOT, run_on_ranks
from tests.dist.test_parity import TOL

EPOCHS = 32
SETS = [
    "model.n_layer=2",
    "model.n_embd=64",
    "model.n_head=4",
    "model.seq_len=72",
    "model.vocab_multiple=8",
    "train.global_batch=2",
    "train.lr=3e-3",
    "train.warmup_steps=0",
    "train.weight_decay=0",
    "study.prefix=16",
    "study.buckets=2",
    "study.bucket_size=2",
    f"study.epochs={EPOCHS}",
    "study.seeds=1",
    "study.goldfish_k=2",
    "study.goldfish_h=4",
    "study.pretrain_steps=0",
    "study.measure_every=1",
    "parallel.timeout_s=120",
    "parallel.tuner=false",
]
MEASURED = [0, 1, 8, 16, 24, 32]  # study.measure_every=8


def _documents(folder: Path) -> None:
    """12 random-letter documents of 70 letters (nothing to generalise from), 2 too short, 1 near copy."""
    rng = random.Random(7)
    folder.mkdir()
    docs = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(70)) for _ in range(12)]
    for i, d in enumerate(docs):
        (folder / f"doc{i:02d}.txt").write_text(d)
    (folder / "short1.txt").write_text("too short")
    (folder / "short2.txt").write_text("x" * 65)
    (folder / "dup.txt").write_text("zz" + docs[3][2:])  # 68 of doc03's 70 letters


def _run(tmp: Path, *extra: str, ranks: int = 2, timeout: int = 400) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "launch.local",
        "-n",
        str(ranks),
        "--",
        "axo4d.memorization",
        "--config",
        "tiny",
        "--set",
        f"data.source={tmp / 'docs'}",
        "--set",
        f"data.cache_dir={tmp / 'cache'}",
        *[a for s in SETS for a in ("--set", s)],
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.dist
def test_memorization_protocol_two_ranks(tmp_path):
    _documents(tmp_path / "docs")
    out = tmp_path / "report"
    r = _run(tmp_path, "--grid", "data=2", "--out", str(out), "--set", "study.measure_every=8")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("report.md", "exact_match.png", "per_document.jsonl", "config.yaml", "meta.json"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    made = {n: (out / n).read_bytes() for n in ("report.md", "exact_match.png")}
    for n in made:
        (out / n).unlink()
    again = subprocess.run(
        [sys.executable, "-m", "axo4d.memorization", "render", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert {n: (out / n).read_bytes() for n in made} == made  # byte for byte from meta.json + per_document.jsonl
    recs = [json.loads(line) for line in (out / "per_document.jsonl").read_text().splitlines()]
    assert len(recs) == 2 * 6  # 2 arms x (2 treated + 1 control buckets of 2)
    assert {r["arm"] for r in recs} == {"standard", "goldfish-k2"}
    assert all(r["epochs"] == MEASURED and len(r["exact"]) == len(r["token_match"]) == len(MEASURED) for r in recs)
    std = [r for r in recs if r["arm"] == "standard"]
    treated = [r for r in std if r["bucket"] != "control"]
    control = [r for r in std if r["bucket"] == "control"]
    assert len(treated) == 4 and len(control) == 2
    assert all(r["exact"][0] == 0 for r in recs)  # random letters: nothing matches before training
    assert all(r["exact"][-1] == 1 and r["token_match"][-1] == 1.0 for r in treated), treated
    assert all(max(r["exact"]) == 0 for r in control)  # never trained, never memorized
    # Goldfish: about half of each random suffix never had a gradient in its context; no guessing that
    assert all(r["exact"][-1] == 0 for r in recs if r["arm"] == "goldfish-k2")
    # the same starting model for every arm: identical epoch-0 results
    by = {(r["arm"], r["doc"]): r for r in recs}
    assert all(by[("standard", d)]["token_match"][0] == by[("goldfish-k2", d)]["token_match"][0] for d in range(6))
    report = (out / "report.md").read_text()
    assert f"| {EPOCHS} | **all treated** | 1.000 [0.510, 1.000] |" in report  # Wilson interval of 4/4
    assert "skipped 2 shorter than 66 tokens; 13 usable" in report  # dup.txt: skipped from the pool if doc03 is in
    assert f"`python -m axo4d.memorization --config tiny --set data.source={tmp_path / 'docs'}" in report
    assert "greedy" in report and "16 tokens" in report
    assert "after epochs 1, 8, 16, 24, 32 (study.measure_every=8)" in report
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["study"]["epochs"] == EPOCHS and cfg["run"]["model"]["seq_len"] == 72


@pytest.mark.dist
def test_size_sweep_two_ranks(tmp_path):
    """--sizes: one study per model (configs of 2 widths), a size table with each model's parameter
    count and exact match after 1 and after E epochs, and sizes.png."""
    _documents(tmp_path / "docs")
    names = []
    for width in (32, 64):
        p = tmp_path / f"w{width}.yaml"
        p.write_text(
            f"model: {{n_layer: 2, n_embd: {width}, n_head: 4, vocab_size: 256, seq_len: 72, vocab_multiple: 8}}\n"
        )
        names.append(str(p))
    out = tmp_path / "report"
    cmd = [
        sys.executable,
        "-m",
        "launch.local",
        "-n",
        "2",
        "--",
        "axo4d.memorization",
        "--config",
        "tiny",
        "--set",
        f"data.source={tmp_path / 'docs'}",
        "--set",
        f"data.cache_dir={tmp_path / 'cache'}",
        *[a for s in SETS if not s.startswith(("model.", "study.epochs", "study.goldfish_k")) for a in ("--set", s)],
        "--set",
        "study.epochs=2",
        "--set",
        "study.goldfish_k=",
        "--sizes",
        ",".join(names),
        "--grid",
        "data=2",
        "--out",
        str(out),
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [json.loads(line) for line in (out / "per_document.jsonl").read_text().splitlines()]
    params = {rec["size"]: rec["params"] for rec in recs}
    assert list(params) == names and params[names[0]] < params[names[1]]
    assert len(recs) == 2 * 6 and {rec["arm"] for rec in recs} == {"standard"}
    report = (out / "report.md").read_text()
    assert "## Size sweep" in report and (out / "sizes.png").stat().st_size > 10000
    for name in names:
        assert f"| {name} | {params[name]:,} | standard |" in report
    assert report.count("| > 2 [> 2, > 2] |") == 4  # epochs to half (each summary, the size table): 2 are too few


@pytest.mark.parametrize(
    "sets,message",
    [
        (["study.goldfish_k=1"], "goldfish_k=1 would drop every token"),
        (["study.goldfish_h=0"], "goldfish_h=0 must be >= 1"),
        (["study.bucket_size=5"], "too few documents: 13 usable documents"),
        (["model.seq_len=60"], "context of model.seq_len=60 tokens, shorter than study.prefix + study.suffix = 66"),
        (["study.pretrain_steps=5"], "study.pretrain_steps=5: dataset 'the rest of the corpus' has 396 tokens"),
        (
            ["study.buckets=1", "study.bucket_size=3"],
            "3 treated documents (study.buckets x study.bucket_size) do not divide into batches",
        ),
    ],
)
def test_bad_input_is_one_line_and_nothing_runs(tmp_path, sets, message):
    _documents(tmp_path / "docs")
    out = tmp_path / "report"
    r = _run(
        tmp_path, "--grid", "data=1", "--out", str(out), *[a for s in sets for a in ("--set", s)], ranks=1, timeout=120
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and message in err[0], r.stderr
    assert not out.exists()


@pytest.mark.dist
def test_study_arms_on_grids_equal_one_process():
    """Both arms' training (every step's loss) and every document's greedy continuation after each
    epoch, on grids splitting the batch (data, z), the features (x) and the vocabulary and heads
    (y), equal the one-process study."""
    sets = [s for s in SETS if not s.startswith(("study.epochs", "parallel"))] + [
        "study.epochs=2",
        "parallel.tuner=false",
    ]
    res = run_on_ranks(4, "tests.dist.cases_memorization:run", 400, ["data=2,y=2", "x=2,z=2"], sets)
    for r in res[0]:
        print(
            f"grid {r['grid']:10s} max rel loss diff {r['max_rel_loss']:.2e}, continuations equal in "
            f"{100 * r['token_runs_equal']:.0f}% of runs, dropped {r['dropped']}"
        )
        assert r["max_rel_loss"] <= TOL, r
        assert r["token_runs_equal"] == 1.0 and r["exact_equal"], r
        assert r["dropped"] == r["ref_dropped"] and r["dropped"][0] == 0 and r["dropped"][1] > 0.2
