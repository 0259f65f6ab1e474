"""The memorization study's pieces on one process: documents and buckets, the treated documents as
batches, and the report's numbers from per-document records (intervals: test_memorization_stats.py;
the exclusion: test_memorization_exclusion.py)."""

import random
import shutil

import numpy as np
import pytest

from axo4d.config import DataConfig, load_config
from axo4d.config.errors import ConfigError, DataError
from axo4d.memorization.documents import (
    CONTROL,
    DocumentEpochs,
    assign_buckets,
    read_corpus,
)
from axo4d.memorization.results import relation, render, write_run
from axo4d.memorization.stats import cell, measured_epochs, wilson
from axo4d.memorization.study_config import StudyConfig, build_study, check_study, load_study
from axo4d.training.datasets.batches import StepPlan
from axo4d.training.datasets.tokenizer import ByteTokenizer


def _folder(tmp_path, n=30, length=40, seed=0):
    rng = random.Random(seed)
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(n):
        (d / f"{i:03d}.txt").write_text("".join(rng.choice("abcdefgh") for _ in range(length)))
    (d / "short.txt").write_text("abc")
    return d


def test_corpus_cut_pool_and_rest(tmp_path):
    d = _folder(tmp_path, n=30, length=40)
    (d / "zz_dup.txt").write_text("x" + (d / "005.txt").read_text()[1:])  # 39 of 005's 40 letters
    study = StudyConfig(prefix=10, suffix=20, buckets=2, bucket_size=5, split="yes")
    c = read_corpus(DataConfig(source=str(d)), ByteTokenizer(), study)
    assert c.counts == {
        "source_documents": 32,
        "tokens_read": 30 * 40 + 3 + 40,
        "skipped_short": 1,
        "usable": 31,  # one 30-token document per 40-letter file
        "pool_skipped": 1,  # 005 or zz_dup, whichever comes second in the pool's order
        "duplicates": 0,
        "rest_documents": 16,
        "rest_tokens": 16 * 30,
        "occurrences": 10,  # the 10 passages of 20 tokens the two share
        "dropped_inside": 1,  # ... so the skipped one is not pre-trained on either
        "dropped_junction": 0,
        "dropped_tokens": 30,
    }
    assert c.tokens.shape == (15, 30) and len(set(c.sources)) == 15
    assert ("005.txt#0" in c.sources) != ("zz_dup.txt#0" in c.sources)
    assert len(c.rest) == 15 * 30  # every other usable document
    again = read_corpus(DataConfig(source=str(d)), ByteTokenizer(), study)
    assert np.array_equal(again.tokens, c.tokens) and again.sources == c.sources
    twice = tmp_path / "twice"  # ten files twice: the rest keeps one of each
    shutil.copytree(d, twice)
    for f in sorted(d.glob("0*.txt"))[:10]:
        (twice / f"copy_{f.name}").write_text(f.read_text())
    dup = read_corpus(DataConfig(source=str(twice)), ByteTokenizer(), study)
    suffixes = [bytes(doc[-20:]) for doc in np.asarray(dup.rest).reshape(-1, 30)]
    assert len(set(suffixes)) == len(suffixes)  # no repeated document is pre-trained on twice
    assert dup.counts["usable"] == 41 and dup.counts["duplicates"] + dup.counts["pool_skipped"] >= 10
    split = read_corpus(
        DataConfig(source=str(d)),
        ByteTokenizer(),
        StudyConfig(prefix=5, suffix=10, buckets=1, bucket_size=4, split="yes"),
    )
    assert split.counts["usable"] == 31 * 2  # two 15-token documents per file
    with pytest.raises(DataError, match=r"too few documents: 31 usable .* 30 of them sharing no 20-token .* = 33"):
        read_corpus(
            DataConfig(source=str(d)), ByteTokenizer(), StudyConfig(prefix=10, suffix=20, bucket_size=11, split="yes")
        )


def test_buckets_are_a_seeded_partition():
    study = StudyConfig(buckets=3, bucket_size=7)
    a, b = assign_buckets(study, 1), assign_buckets(study, 2)
    assert a == assign_buckets(study, 1) and a != b
    for x in (a, b):
        assert sorted(set(x)) == sorted(["treated-1", "treated-2", "treated-3", CONTROL])
        assert all(x.count(name) == 7 for name in set(x))


def test_document_epochs_every_document_once_per_epoch_on_any_grid():
    """The study's documents through the training pipeline: each step's samples fixed, then cut into
    micro-batches and shards; every document once per epoch."""
    docs = np.arange(12 * 9).reshape(12, 9)
    ds = DocumentEpochs(docs, global_batch=4, grad_accum=2, seed=3)
    assert ds.seq_len == 8 and ds.steps_per_epoch == 3
    whole = StepPlan(ds, 4, 2)
    for epoch in range(2):
        seen = []
        for step in range(epoch * 3, epoch * 3 + 3):
            idx = whole.samples(step)[1]
            assert np.array_equal(idx, ds.rows(step))
            for micro in range(2):
                b = whole.read(idx, micro)  # the whole micro-batch
                x, y = b.x, b.y
                assert np.array_equal(x[:, 1:], y[:, :-1]) and b.mask is None
                shards = [StepPlan(ds, 4, 2, s, 2).read(idx, micro).x for s in range(2)]
                assert np.array_equal(np.concatenate(shards), x)  # shards concatenate to it
                seen += [int(r[0]) // 9 for r in x]
        assert sorted(seen) == list(range(12))
    with pytest.raises(DataError, match="do not divide into batches of train.global_batch=5"):
        DocumentEpochs(docs, 5, 1, 0)


def test_study_config_errors_and_report_config_roundtrip(tmp_path):
    for bad, msg in [
        ({"goldfish_k": "2,1"}, "goldfish_k=1 would drop every token"),
        ({"epochs": 0}, "epochs=0"),
        ({"seeds": "1,x"}, "study.seeds='1,x' must be comma-separated"),
        ({"split": "maybe"}, "split"),
        ({"goldfish_h": 0}, "goldfish_h=0"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            check_study(build_study(bad))
    with pytest.raises(ConfigError, match="unknown config key 'study.epoch'"):
        build_study({"epoch": 3})
    study, cfg, sizes = load_study("tiny", ["study.epochs=3", "train.lr=0.5"])
    assert study.epochs == 3 and cfg.train.lr == 0.5 and sizes == []
    assert [a for a, _ in StudyConfig(goldfish_k="2,4").arms] == ["standard", "goldfish-k2", "goldfish-k4"]
    import yaml

    from axo4d.config import config_to_dict

    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump({"study": {"epochs": 3}, "run": config_to_dict(load_config("tiny")), "sizes": ["a"]}))
    study2, cfg2, sizes2 = load_study(str(p), ["study.seeds=5", "train.steps=7"])
    assert (study2.epochs, study2.seeds, cfg2.train.steps, sizes2) == (3, "5", 7, ["a"])


def _records(rates_by_arm: dict, n_docs=20, seeds=(1, 2), epochs=3):
    """Synthetic records: treated documents match from epoch rate_epoch on, control never."""
    out = []
    for arm, first in rates_by_arm.items():
        for s in seeds:
            for doc in range(n_docs):
                bucket = CONTROL if doc >= n_docs - 5 else f"treated-{1 + doc % 2}"
                exact = [0] * (epochs + 1)
                if bucket != CONTROL and first is not None and doc % 3 != 0:
                    exact = [int(e >= first) for e in range(epochs + 1)]
                out.append(
                    {
                        "size": "m",
                        "params": 1000,
                        "seed": s,
                        "arm": arm,
                        "goldfish_k": 0,
                        "doc": doc,
                        "source": f"d{doc}",
                        "bucket": bucket,
                        "exact": exact,
                        "token_match": [0.5 * x + 0.1 for x in exact],
                    }
                )
    return out


def _meta(pretrain: dict | None = None) -> dict:
    return {
        "study": {**StudyConfig(epochs=3, seeds="1,2", goldfish_k="4").__dict__},
        "sizes": ["m"],
        "arms": ["standard", "goldfish-k4"],
        "buckets": ["treated-1", "treated-2", CONTROL],
        "command": "python -m axo4d.memorization --out x",
        "run": {},
        "grid": "data=1",
        "world_size": 1,
        "launcher": "single",
        "device": "cpu",
        "seconds": 60.0,
        "counts": {
            "source_documents": 9,
            "tokens_read": 99,
            "skipped_short": 1,
            "usable": 20,
            "pool_skipped": 2,
            "rest_documents": 5,
            "rest_tokens": 500,
            "occurrences": 7,
            "dropped_inside": 1,
            "dropped_junction": 2,
            "dropped_tokens": 300,
        },
        "source": "s",
        "tokenizer": "byte",
        "split": True,
        "decoding": "greedy",
        "batch": 2,
        "steps_per_epoch": 8,
        "lr": 0.1,
        "warmup": 0,
        "weight_decay": 0.0,
        "grad_clip": 1.0,
        "per_size": {
            "m": {
                "start": "random",
                "pretrain": pretrain,
                "params": 1000,
                "seconds_per_run": 1.0,
                "dropped": {"standard": 0.0, "goldfish-k4": 0.25},
            }
        },
    }


def test_cells_and_report_from_records(tmp_path):
    """Synthetic records whose documents behave alike under both seeds (their buckets do not change):
    the effective n of the treated cell is its 15 documents, not its 30 pairs."""
    recs = _records({"standard": 2, "goldfish-k4": None})
    c = cell(recs, "standard", "treated", 3)
    assert (c.n, c.docs, c.k, c.k0, c.new, c.lost) == (30, 15, 20, 0, 20, 0)
    assert c.per_seed == ((1, 10, 15), (2, 10, 15)) and c.seed_rate(0) == (10 / 15, wilson(10, 15))
    assert c.n_eff == pytest.approx(15.0) and c.interval == pytest.approx(wilson(10, 15))
    assert cell(recs, "standard", "treated-1", 3).n == 16 and cell(recs, "standard", CONTROL, 3).k == 0
    g, ctl = cell(recs, "goldfish-k4", "treated", 3), cell(recs, "goldfish-k4", CONTROL, 3)
    assert (g.n_eff, ctl.n_eff, ctl.interval) == (15.0, 5.0, wilson(0, 5))  # 0/n: one trial per document
    assert relation(g, ctl) == "within the control's interval"  # and 10/15 against 0/5 documents:
    assert relation(c, ctl) == "above the control's interval, the two intervals overlapping"
    pre = {"first_loss": 5.0, "last_loss": 2.0, "val_loss": 2.5, "seconds": 3.0}
    write_run(tmp_path, _meta({**pre, "span": 129, "windows_dropped": 12, "windows": 372}), recs)
    text = (tmp_path / "report.md").read_text()
    lo, hi = wilson(10, 15)
    assert (
        f"| standard | 0.667 [{lo:.3f}, {hi:.3f}] (n_eff 15.0) | 0.000 [0.000, {wilson(0, 15)[1]:.3f}] (n_eff 15.0) |"
        in text
    )
    assert "**goldfish-k4**: treated 0.000 (0/30) after 3 epochs is within the control's interval" in text
    assert (
        f"| 2 | **all treated** | 0.667 [{lo:.3f}, {hi:.3f}] | 30 / 15 / 15.0 | 10/15, 10/15 | 0.000 | +0.667 |" in text
    )
    assert f"| standard | 1 | 0.667 [{lo:.3f}, {hi:.3f}] (10/15) |" in text  # per seed: plain Wilson
    assert "| standard | " in text and "| 2 [2, > 3] |" in text  # epochs to half (some resamples never get there)
    assert "| goldfish-k4 | " in text and "| > 3 [> 3, > 3] |" in text
    assert "found 7 occurrences of a study passage; the 1 documents holding one and the 2 with part" in text
    assert "(300 tokens, 60.00% of the rest)" in text and "12 of the 372 windows of 129 tokens" in text
    assert "`python -m axo4d.memorization --out x` on 1 rank (launcher: single), grid data=1" in text
    stored = {n: (tmp_path / n).read_bytes() for n in ("report.md", "exact_match.png")}
    assert stored["exact_match.png"][:4] == b"\x89PNG" and len(stored["exact_match.png"]) > 10000
    for n in stored:
        (tmp_path / n).unlink()
    render(tmp_path)
    assert {n: (tmp_path / n).read_bytes() for n in stored} == stored  # byte for byte from the stored files
    with pytest.raises(ConfigError, match="cannot render .* meta.json and per_document.jsonl"):
        render(tmp_path / "nothing")


def test_measure_every_epochs_and_sparse_records(tmp_path):
    """study.measure_every: epochs 0, 1, every n-th and the last; cells index records by epoch."""
    assert StudyConfig(epochs=5, measure_every=2).measured_epochs == [0, 1, 2, 4, 5]
    assert StudyConfig(epochs=3, measure_every=1).measured_epochs == [0, 1, 2, 3]
    assert StudyConfig(epochs=1, measure_every=4).measured_epochs == [0, 1]
    with pytest.raises(ConfigError, match="study.measure_every=0 must be >= 1"):
        check_study(StudyConfig(measure_every=0))
    recs = [
        {
            "arm": "standard",
            "bucket": "treated-1",
            "seed": 1,
            "doc": 0,
            "epochs": [0, 1, 4, 5],
            "exact": [0, 0, 1, 1],
            "token_match": [0.1, 0.2, 1.0, 1.0],
        },
        {
            "arm": "standard",
            "bucket": "treated-1",
            "seed": 1,
            "doc": 1,
            "epochs": [0, 1, 4, 5],
            "exact": [0, 0, 0, 1],
            "token_match": [0.1, 0.2, 0.5, 1.0],
        },
    ]
    assert measured_epochs(recs, 5) == [0, 1, 4, 5]
    assert (cell(recs, "standard", "treated", 4).k, cell(recs, "standard", "treated", 5).k) == (1, 2)
    assert cell(recs, "standard", "treated", 4).token[0] == pytest.approx(0.75)
    with pytest.raises(KeyError, match="epoch 3 was not measured"):
        cell(recs, "standard", "treated", 3)


def test_size_sweep_configs_span_ten_times_the_parameters():
    """The committed size sweep (docs/memorization/sizes/): memorize-s, memorize, memorize-l differ
    only in the model and span over 10x in parameters."""
    from axo4d.facts.archs import model_spec
    from axo4d.facts.grid import Grid

    cfgs = [load_config(n) for n in ("memorize-s", "memorize", "memorize-l")]
    params = [model_spec(c.model, Grid()).param_count() for c in cfgs]
    assert params == [141_056, 875_264, 3_323_392] and params[-1] / params[0] > 10
    assert all((c.data, c.train, c.parallel) == (cfgs[1].data, cfgs[1].train, cfgs[1].parallel) for c in cfgs)


@pytest.mark.parametrize("folder", ["docs/memorization", "docs/memorization/sizes"])
def test_committed_reports_render_byte_for_byte(folder, tmp_path):
    """The committed report.md is what render makes from the committed meta.json and
    per_document.jsonl (nothing in it edited by hand)."""
    import shutil
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / folder
    if not (src / "meta.json").is_file():
        pytest.skip(f"{folder} holds no meta.json yet: it is written by the run in docs/memorization/settings.md")
    for name in ("meta.json", "per_document.jsonl"):
        shutil.copy(src / name, tmp_path / name)
    render(tmp_path)
    assert (tmp_path / "report.md").read_bytes() == (src / "report.md").read_bytes()
