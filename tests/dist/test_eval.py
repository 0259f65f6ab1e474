"""``axo4d.eval`` and evaluation during training against lm-evaluation-harness's own Hugging Face
model (``lm_eval`` ``--model hf``, run in-process through ``simple_evaluate``), on the small local
tasks of ``tests/eval_tasks`` (multiple choice, rolling log-likelihood, greedy generation; nothing
downloaded): a tiny Llama trained two steps by ``axo4d.train`` and exported with ``export-hf``;
the exported folder scored by ``--model hf`` and the checkpoint it came from scored by
``axo4d.eval`` on one rank and on a 4-rank grid ``x=2,y=2`` agree (accuracy identical, every
per-example log-likelihood within 1e-4 in fp32, every generated string identical). Training with
``eval.tasks`` every step writes the scores to metrics.jsonl with losses bit-identical to a run
without them. The one-rank evaluation also takes the validation loss on the training runs'
``data.val_source``: it equals the training run's last validation.

Cost (the CI budget): two 2-step trainings, one export, two evaluations (one rank, four ranks) and
one bad-input run, each a process of its own; the unknown-task check runs in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from tests import hf_models as H  # noqa: E402
from tests.dist.harness import ROOT  # noqa: E402

TASKS = "axo4d_mc,axo4d_roll,axo4d_gen"
INCLUDE = "tests/eval_tasks"
TOL = 1e-4
ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**ENV, "PYTHONPATH": str(ROOT) + os.pathsep + ENV.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _train(src: Path, data: Path, out: Path, *extra: str) -> list[dict]:
    sets = ["model.seq_len=64", "train.steps=2", "train.global_batch=4", "train.eval_interval=0"]
    sets += ["parallel.tuner=false", "train.eval_batches=1", f"data.source={data}", *extra]
    sets += [f"data.val_source={data.with_name('val.jsonl')}"]  # written beside data by the fixture
    r = _run(
        ["-m", "axo4d.train", "--config", "llama-tiny", "--init-from", str(src), "--out", str(out)]
        + [a for s in sets for a in ("--set", s)]
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    base = tmp_path_factory.mktemp("eval")
    H.build("llama", base / "src", H.tokenizer_json(), seed=5)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:48]
    doc = lambda f: json.dumps({"text": f.read_text()[:2000]}) + "\n"  # noqa: E731
    (base / "docs.jsonl").write_text("".join(doc(f) for f in files[:40]))
    (base / "val.jsonl").write_text("".join(doc(f) for f in files[40:]))
    plain = _train(base / "src", base / "docs.jsonl", base / "plain")
    with_eval = _train(
        base / "src",
        base / "docs.jsonl",
        base / "with_eval",
        "eval.tasks=[axo4d_mc]",
        f"eval.include_path={INCLUDE}",
        "eval.interval=1",
        "eval.limit=4",
    )
    r = _run(["-m", "axo4d.checkpoint", "export-hf", str(base / "plain"), str(base / "hf")])
    assert r.returncode == 0, r.stderr[-3000:]
    return base, plain, with_eval


@pytest.fixture(scope="module")
def reference(made):
    """The harness's Hugging Face model on the exported folder (fp32, in-process)."""
    from lm_eval.tasks import TaskManager

    base = made[0]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        res = lm_eval.simple_evaluate(
            model="hf",
            model_args=f"pretrained={base / 'hf'},dtype=float32",
            tasks=TASKS.split(","),
            task_manager=TaskManager(include_path=INCLUDE, include_defaults=False),
            batch_size=4,
            device="cpu",
            log_samples=True,
            bootstrap_iters=0,
        )
    finally:
        os.chdir(cwd)
    return json.loads(json.dumps(res, default=str))


def _floats(x) -> list[float]:
    if isinstance(x, bool):
        return []
    if isinstance(x, (int, float)):
        return [float(x)]
    if isinstance(x, (list, tuple)):
        return [v for e in x for v in _floats(e)]
    return []


def _compare(ours: dict, ref: dict) -> list[str]:
    bad = []
    for task, m in ref["results"].items():
        for key in ("acc,none", "exact_match,none"):
            if key in m and ours["results"][task][key] != m[key]:
                bad.append(f"{task} {key}: axo4d {ours['results'][task][key]} vs hf {m[key]}")
    for task, samples in ref["samples"].items():
        mine = {s["doc_id"]: s for s in ours["samples"][task]}
        assert len(mine) == len(samples), task
        for s in samples:
            a, b = mine[s["doc_id"]]["resps"], s["resps"]
            if task == "axo4d_gen":
                if a != b:
                    bad.append(f"{task} doc {s['doc_id']}: generated {a} vs hf {b}")
                continue
            fa, fb = _floats(a), _floats(b)
            assert len(fa) == len(fb) > 0, (task, a, b)
            err = max(abs(x - y) for x, y in zip(fa, fb))
            if err > TOL:
                bad.append(f"{task} doc {s['doc_id']}: log-likelihoods differ by {err:.2e} > {TOL}")
    return bad


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_eval_agrees_with_hf_on_one_and_four_ranks(made, reference, tmp_path):
    base = made[0]
    args = [str(base / "plain"), "--tasks", TASKS, "--include-path", INCLUDE, "--log-samples", "--batch-size", "4"]
    val = ["--val-source", str(base / "val.jsonl"), "--val-samples", "4"]
    r1 = _run(["-m", "axo4d.eval", *args, *val, "--out", str(tmp_path / "one.json")])
    assert r1.returncode == 0, r1.stdout[-2000:] + r1.stderr[-3000:]
    r4 = _run(
        [
            "-m",
            "launch.local",
            "-n",
            "4",
            "--",
            "axo4d.eval",
            *args,
            "--grid",
            "x=2,y=2",
            "--out",
            str(tmp_path / "four.json"),
        ],
        timeout=600,
    )
    assert r4.returncode == 0, r4.stdout[-2000:] + r4.stderr[-3000:]
    for name in ("one", "four"):
        ours = json.loads((tmp_path / f"{name}.json").read_text())
        bad = _compare(ours, reference)
        assert not bad, f"{name} rank(s):\n" + "\n".join(bad[:20])
    print({t: reference["results"][t] for t in reference["results"]})
    # the checkpoint's validation loss on data.val_source: the same samples and mean as the
    # training run's last validation (after the same 2 steps)
    trained = [rec["val_loss"] for rec in made[1] if "val_loss" in rec][-1]
    got = json.loads((tmp_path / "one.json").read_text())["val_loss"]
    assert abs(got - trained) <= 1e-6 * abs(trained), (got, trained)


@pytest.mark.dist
def test_eval_during_training_leaves_losses_bit_identical(made):
    _, plain, with_eval = made
    losses = lambda recs: [(r["step"], r["loss"]) for r in recs if "loss" in r]  # noqa: E731
    assert losses(with_eval) == losses(plain) and len(losses(plain)) == 2
    evals = [r for r in with_eval if "eval" in r]
    assert [r["step"] for r in evals] == [0, 1], evals
    assert set(evals[0]["eval"]) == {"axo4d_mc/acc"} and 0.0 <= evals[0]["eval"]["axo4d_mc/acc"] <= 1.0
    assert not any("eval" in r for r in plain)


@pytest.mark.dist
def test_eval_bad_input_is_one_line(tmp_path, monkeypatch):
    """A missing folder is one line and exit 2 (in a process of its own: the command's exit path);
    an unknown task is refused by the check the command runs before any process group exists."""
    import functools

    import lm_eval.tasks

    from axo4d.config.errors import ConfigError
    from axo4d.training.lm_harness import check_tasks, task_manager

    # the harness's own 14,686 task files are left out of the index (17 s of CPU to read them):
    # the check then looks among the local tasks only, by the same code path
    local_only = functools.partial(lm_eval.tasks.TaskManager, include_defaults=False)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", local_only)
    task_manager.cache_clear()
    with pytest.raises(ConfigError, match="no_such_task_xyz") as e:
        check_tasks(["axo4d_mc", "no_such_task_xyz"], str(ROOT / INCLUDE))
    task_manager.cache_clear()
    assert "\n" not in str(e.value) and "axo4d_mc," not in str(e.value)
    r = _run(["-m", "axo4d.eval", str(tmp_path / "nowhere")])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "does not exist" in lines[0], (r.returncode, r.stderr[-2000:])
