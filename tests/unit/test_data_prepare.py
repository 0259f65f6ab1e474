"""``python -m axo4d.data prepare``: a prepared folder from JSONL, text, Arrow and Parquet sources,
in parallel, deduplicated; training opens it with no tokenisation; bad input is one line, exit 2,
``--out`` untouched. Hugging Face ``datasets`` folders are read with pyarrow (checked against folders
the ``datasets`` package itself wrote, when it is installed)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from axo4d import data as cli
from axo4d.config import DataConfig
from axo4d.config.errors import DataError
from axo4d.training.datasets import dataset as D
from axo4d.training.datasets.prepared import open_prepared
from axo4d.training.datasets.prepared_writer import Progress, write_prepared
from axo4d.training.datasets.tokenizer import load_tokenizer
from tests.data_fixtures import unique_jsonl, unique_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "axo4d.data", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_prepare_jsonl_in_parallel_with_dedup_then_train_without_tokenising(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tokenizers")
    words = unique_jsonl(tmp_path / "docs.jsonl", 300)
    with open(tmp_path / "docs.jsonl", "a") as f:  # two duplicates and an empty document
        f.write(json.dumps({"text": " ".join(words[3])}) + "\n" + json.dumps({"text": " ".join(words[7])}) + "\n")
        f.write('{"text": ""}\n')
    tok = unique_tokenizer(tmp_path / "tokenizer.json", words)
    out = tmp_path / "prepared"
    argv = ["prepare", str(tmp_path / "docs.jsonl"), "--tokenizer", str(tok), "--out", str(out)]
    assert cli.run([*argv, "--workers", "2", "--dedup"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    assert "300 documents" in summary and "1 empty documents skipped" in summary and "2 duplicates dropped" in summary
    docs = open_prepared(out)
    t = load_tokenizer(str(tok))
    expect = [t.encode(" ".join(w)) for w in words]
    assert len(docs) == 300 and docs.n_tokens == sum(map(len, expect))
    for i in (0, 1, 150, 299):
        assert docs.tokens[docs.offsets[i] : docs.offsets[i + 1]].tolist() == expect[i]
    assert docs.separator.tolist() == [1] and docs.info["duplicates"] == 2  # the end-of-text token
    # the same folder in one process
    assert cli.run([*argv[:-1], str(tmp_path / "one"), "--dedup", "--workers", "1"]) == 0
    one = open_prepared(tmp_path / "one")
    assert np.array_equal(np.asarray(one.tokens), np.asarray(docs.tokens))
    assert np.array_equal(np.asarray(one.offsets), np.asarray(docs.offsets))

    def boom(*a, **k):
        raise AssertionError("tokenised again")

    monkeypatch.setattr(D, "write_prepared", boom)
    ds = D.open_dataset(DataConfig(source=str(out)), 16, seed=1, vocab_size=t.vocab_size)
    assert ds.train.n_documents + ds.val.n_documents == 300
    assert cli.run(["info", str(out)]) == 0 and "300 documents" in capsys.readouterr().out


def test_prepare_errors_are_one_line_and_leave_out_untouched(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    p = _cli("prepare", str(tmp_path / "bad.jsonl"), "--tokenizer", "byte", "--out", str(tmp_path / "o"))
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "documents |" not in ln]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith("axo4d.data: error: ") and "Traceback" not in p.stderr
    assert "bad.jsonl' line 2 has no string field 'text'" in lines[0]
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.partial*"))
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep").write_text("mine")
    with pytest.raises(DataError, match="already exists; choose another --out or pass --force"):
        cli.run(["prepare", "stdlib", "--tokenizer", "byte", "--out", str(tmp_path / "o")])
    assert (tmp_path / "o" / "keep").read_text() == "mine"
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="the dataset is empty"):
        cli.run(["prepare", str(tmp_path / "empty.jsonl"), "--tokenizer", "byte", "--out", str(tmp_path / "e")])
    assert not (tmp_path / "e").exists()
    with pytest.raises(DataError, match="'nope.json' is neither 'byte' nor"):
        cli.run(["prepare", "stdlib", "--tokenizer", "nope.json", "--out", str(tmp_path / "t")])


def test_force_replaces_only_when_complete(tmp_path):
    (tmp_path / "a.txt").write_text("hello " * 100)
    out = tmp_path / "o"
    write_prepared(str(tmp_path / "a.txt"), "byte", out)
    first = (out / "tokens.u16").stat().st_mtime_ns
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n{"nope": 1}\n')
    with pytest.raises(DataError, match="line 2"):
        write_prepared(str(tmp_path / "b.jsonl"), "byte", out, force=True)
    assert (out / "tokens.u16").stat().st_mtime_ns == first  # the failed replacement left it as it was
    write_prepared(str(tmp_path / "a.txt"), "byte", out, force=True, max_tokens=7)
    assert open_prepared(out).n_tokens == 7 and not list(tmp_path.glob(".o.*"))


def test_progress_line_shows_rate_and_eta():
    buf = io.StringIO()
    bar = Progress(1000, stream=buf, every_s=0.0)
    bar.update(250, 10, 5000, False)
    bar.update(1000, 40, 20000, True)
    first, last = buf.getvalue().splitlines()
    assert "25.0%" in first and "tokens/s" in first and "ETA" in first and "10 documents" in first
    assert "100.0%" in last and "20,000 tokens" in last


# ---- Arrow and Parquet (pyarrow) ------------------------------------------------------------------
def _texts(n: int = 50) -> list[str]:
    return [f"row {i} " * (i % 7 + 1) for i in range(n)]


def _save_to_disk_layout(folder: Path, texts: list[str], dict_split: str | None = None) -> Path:
    """A folder laid out as datasets' save_to_disk writes one (Arrow IPC stream + state.json)."""
    pa = pytest.importorskip("pyarrow")
    d = folder / dict_split if dict_split else folder
    d.mkdir(parents=True)
    table = pa.table({"text": texts, "n": list(range(len(texts)))})
    half = len(texts) // 2
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for name, part in zip(names, (table.slice(0, half), table.slice(half))):
        with pa.OSFile(str(d / name), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as w:
            w.write_table(part)
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_split": None}))
    (d / "dataset_info.json").write_text("{}")
    if dict_split:
        (folder / "dataset_dict.json").write_text(json.dumps({"splits": [dict_split, "test"]}))
    return folder


def _prepared_texts(src: Path, tmp_path: Path, name: str, **kw) -> list[str]:
    out = tmp_path / name
    write_prepared(str(src), "byte", out, **kw)
    docs = open_prepared(out)
    return [
        bytes(np.asarray(docs.tokens[docs.offsets[i] : docs.offsets[i + 1]], np.uint8)).decode()
        for i in range(len(docs))
    ]


def test_arrow_and_parquet_sources(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = _texts()
    assert _prepared_texts(_save_to_disk_layout(tmp_path / "ds", texts), tmp_path, "p1") == texts
    assert _prepared_texts(_save_to_disk_layout(tmp_path / "dd", texts, "train"), tmp_path, "p2") == texts
    pq.write_table(pa.table({"content": texts}), tmp_path / "t.parquet", row_group_size=7)
    assert _prepared_texts(tmp_path / "t.parquet", tmp_path, "p3", text_field="content") == texts
    with pytest.raises(DataError, match=r"no column 'text' \(columns: content\)"):
        write_prepared(str(tmp_path / "t.parquet"), "byte", tmp_path / "p4")
    _save_to_disk_layout(tmp_path / "nt", texts, "validation")
    with pytest.raises(DataError, match="has no 'train' split"):
        write_prepared(str(tmp_path / "nt"), "byte", tmp_path / "p5")


def test_datasets_save_to_disk_folders(tmp_path):
    """Folders written by the datasets package itself (when installed) read as the rows it holds."""
    datasets = pytest.importorskip("datasets")
    from datasets.table import InMemoryTable

    texts = _texts(200)
    # a given fingerprint: datasets' own hashing of a new table (dill) fails on some pyarrow versions
    ds = datasets.Dataset(
        InMemoryTable.from_pydict({"text": texts, "label": [i % 3 for i in range(200)]}), fingerprint="t"
    )
    ds.save_to_disk(str(tmp_path / "one"), max_shard_size="2KB")
    assert len(list((tmp_path / "one").glob("*.arrow"))) > 1
    assert _prepared_texts(tmp_path / "one", tmp_path, "p1") == texts
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dict"))
    assert _prepared_texts(tmp_path / "dict", tmp_path, "p2") == texts


def test_data_memory_bench_smoke(tmp_path):
    """bench/data_memory.py at a tiny size (the 2 GiB measurement is a documented command)."""
    from bench.data_memory import measure, write_folder

    info = write_folder(tmp_path / "f", 300_000)
    assert open_prepared(tmp_path / "f").n_tokens == info["tokens"] == 300_000
    got = measure(str(tmp_path / "f"), 2)
    assert got["tokens"] > 300_000 and got["after_last_step"] >= got["before_open"] > 0


def test_invalid_utf8_is_replaced_counted_and_said(tmp_path, capsys):
    """Issue 33 item 7: bytes of invalid UTF-8 in a text source are replaced by U+FFFD as before,
    and now counted: in ``dataset.json``, in the prepare summary and in training's tokenising line.
    The text equals Python's ``errors='replace'`` decoding, so the tokens do not change."""
    src = tmp_path / "src"
    src.mkdir()
    raw = "héllo ".encode() + b"\xff\xfe" + "wörld ".encode() + b"\xe2\x82" + b" end\n"  # 2 + 2 bytes invalid
    (src / "a.txt").write_text("all good\n")
    (src / "b.txt").write_bytes(raw)
    out = tmp_path / "o"
    assert cli.run(["prepare", str(src), "--tokenizer", "byte", "--out", str(out)]) == 0
    note = "4 bytes of invalid UTF-8 in 1 file(s) replaced by U+FFFD (first: b.txt)"
    assert note in capsys.readouterr().out.splitlines()[-1]
    docs = open_prepared(out)
    assert docs.info["replaced_bytes"] == 4 and docs.info["replaced_files"] == 1
    want = list(raw.decode("utf-8", errors="replace").encode())  # the byte tokenizer: UTF-8 bytes
    assert docs.tokens[docs.offsets[1] : docs.offsets[2]].tolist() == want
    D.prepare_source(str(src), DataConfig(source=str(src), cache_dir=str(tmp_path / "cache")))
    assert f"data: warning: {src}: {note}" in capsys.readouterr().err


def test_out_under_a_file_is_one_line(tmp_path):
    """Issue 33 item 7: ``--out`` below an existing file was a NotADirectoryError traceback."""
    (tmp_path / "f").write_text("a file")
    with pytest.raises(DataError, match="is under '.*f', which is a file, not a folder; choose another --out"):
        cli.run(["prepare", "stdlib", "--tokenizer", "byte", "--out", str(tmp_path / "f" / "sub")])
    assert (tmp_path / "f").read_text() == "a file"
