"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) against ``megatron-core`` itself:
files its ``IndexedDatasetBuilder`` writes are read by axo4d token for token and document for
document (several dtypes, empty documents, documents of several sequences, a blend as a mixture);
files ``axo4d.data prepare --format megatron`` writes are read back by its ``IndexedDataset``
identically; the pipeline over a Megatron source is the pipeline over a prepared folder of the same
documents; a corrupt index is one line naming the file."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from axo4d import data as cli
from axo4d.config import DataConfig, SourceConfig
from axo4d.config.errors import DataError
from axo4d.training.datasets import dataset as D
from axo4d.training.datasets.megatron import megatron_prefix, open_megatron, write_index, write_megatron
from axo4d.training.datasets.tokenizer import load_tokenizer


def _mc():
    """megatron-core's indexed dataset module (the test extra), or a skip saying why."""
    return pytest.importorskip(
        "megatron.core.datasets.indexed_dataset", reason="megatron-core (the test extra) is not installed"
    )


def _documents(rng: np.random.Generator, n: int, high: int) -> list[list[np.ndarray]]:
    """``n`` documents, each a list of 0..3 sequences of 0..40 random tokens below ``high``; some empty."""
    docs = []
    for i in range(n):
        k = 0 if i % 9 == 4 else int(rng.integers(1, 4))
        docs.append([rng.integers(0, high, size=int(rng.integers(0, 41))) for _ in range(k)])
    docs[0] = [rng.integers(0, high, size=5)]
    docs[1] = [np.zeros(0, np.int64)]  # an empty document of one empty sequence
    return docs


def _build(mc, prefix: Path, docs: list[list[np.ndarray]], dtype) -> None:
    """``docs`` written by megatron-core's own builder (whole documents and item by item)."""
    import torch

    b = mc.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for i, seqs in enumerate(docs):
        if i % 2 and seqs:
            flat = np.concatenate(seqs)
            b.add_document(flat.astype(np.int64), [len(s) for s in seqs])
        else:
            for s in seqs:
                b.add_item(torch.from_numpy(s.astype(np.int64)))
            b.end_document()
    b.finalize(f"{prefix}.idx")


def _doc_tokens(docs, i: int) -> np.ndarray:
    return np.asarray(docs.tokens[int(docs.offsets[i]) : int(docs.offsets[i + 1])])


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64, np.float32])
def test_megatron_builder_files_read_token_for_token(tmp_path, dtype):
    mc = _mc()
    docs = _documents(np.random.default_rng(3), 60, 250)
    _build(mc, tmp_path / "c", docs, dtype)
    got = open_megatron(tmp_path / "c", vocab_size=250)
    ref = mc.IndexedDataset(str(tmp_path / "c"))
    assert len(got) == len(docs) == len(ref.document_indices) - 1 and got.info["sequences"] == len(ref)
    assert got.tokens.dtype == np.dtype(dtype) and got.separator.size == 0
    for i, seqs in enumerate(docs):
        expect = np.concatenate(seqs) if seqs else np.zeros(0)
        lo, hi = ref.document_indices[i], ref.document_indices[i + 1]
        theirs = np.concatenate([ref[j] for j in range(lo, hi)]) if hi > lo else np.zeros(0)
        assert _doc_tokens(got, i).tolist() == expect.tolist() == theirs.tolist(), i
        assert got.read(int(got.offsets[i]), len(expect)).tolist() == expect.tolist()
    assert sum(len(s) for d in docs for s in d) == got.n_tokens
    for p in (tmp_path / "c", tmp_path / "c.bin", tmp_path / "c.idx"):
        assert megatron_prefix(p) == tmp_path / "c"


def test_axo4d_written_files_read_by_megatron_core(tmp_path, capsys):
    mc = _mc()
    texts = [f"document {i} " * (i % 5) for i in range(40)]  # every fifth is empty: skipped
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "meg"
    argv = ["prepare", str(tmp_path / "d.jsonl"), "--tokenizer", "byte", "--out", str(out), "--format", "megatron"]
    assert cli.run([*argv, "--workers", "1"]) == 0
    assert f"data.source={out / 'text_document'}" in capsys.readouterr().out
    tok = load_tokenizer("byte")
    sep = list(tok.encode("\n\n"))  # the byte tokenizer has no end-of-text token
    expect = [tok.encode(t) + sep for t in texts if t]
    ref = mc.IndexedDataset(str(out / "text_document"))
    assert ref.index.dtype == np.uint16 and len(ref) == len(expect) == 32
    assert ref.document_indices.tolist() == list(range(33))
    assert [ref[i].tolist() for i in range(len(ref))] == expect
    ours = open_megatron(megatron_prefix(out))
    assert [_doc_tokens(ours, i).tolist() for i in range(len(ours))] == expect
    assert cli.run(["info", str(out)]) == 0 and "32 documents" in capsys.readouterr().out


def _as_prepared(docs, folder: Path) -> None:
    """The same documents as an axo4d prepared folder with no separator."""
    folder.mkdir()
    np.asarray(docs.tokens, np.uint16).tofile(folder / "tokens.u16")
    np.save(folder / "documents.npy", np.asarray(docs.offsets, np.int64))
    info = {"format": "axo4d-tokens/1", "tokens_file": "tokens.u16", "dtype": "uint16", "separator": []}
    info.update(documents=len(docs), tokens=docs.n_tokens, vocab_size=256)
    (folder / "dataset.json").write_text(json.dumps(info))


def _samples(ds) -> list:
    out = []
    for split, s in (("train", ds.train), ("val", ds.val)):
        b = ds.batch(split, np.arange(s.n_samples))
        out.append((b.x.tolist(), b.y.tolist(), b.documents.tolist(), None if b.mask is None else b.mask.tolist()))
    return out


def test_megatron_blend_trains_as_a_mixture_like_prepared_folders(tmp_path):
    """A blend of two files megatron-core wrote, as ``data.sources``: held-out documents, packing,
    document masks and the mixture order are those of prepared folders of the same documents."""
    mc = _mc()
    rng = np.random.default_rng(5)
    for name, dtype in (("a", np.uint16), ("b", np.int32)):
        _build(mc, tmp_path / name, _documents(rng, 80, 256), dtype)
        _as_prepared(open_megatron(tmp_path / name), tmp_path / f"p{name}")
    kw = dict(cache_dir=str(tmp_path / "cache"), val_fraction=0.1, document_mask=True)

    def mixture(a: str, b: str) -> DataConfig:
        return DataConfig(sources=(SourceConfig(a, 3.0), SourceConfig(b, 1.0)), **kw)

    meg = D.open_dataset(mixture(str(tmp_path / "a.idx"), str(tmp_path / "b")), 16, seed=2, vocab_size=256)
    ref = D.open_dataset(mixture(str(tmp_path / "pa"), str(tmp_path / "pb")), 16, seed=2, vocab_size=256)
    assert meg.epoch_size == ref.epoch_size and meg.train.n_samples == ref.train.n_samples > 0
    pos = np.arange(2 * meg.epoch_size)
    assert all(np.array_equal(m, r) for m, r in zip(meg.order.at(pos), ref.order.at(pos)))
    assert _samples(meg) == _samples(ref)
    with pytest.raises(DataError, match=r"token id \d+ in '.*a.bin' is outside the model vocabulary 0..199"):
        D.open_dataset(DataConfig(source=str(tmp_path / "a"), **kw), 16, seed=2, vocab_size=200)


def _index(tmp_path: Path) -> Path:
    write_index(tmp_path / "x.idx", np.dtype(np.uint16), np.array([3, 0, 4]))
    np.arange(7, dtype=np.uint16).tofile(tmp_path / "x.bin")
    assert open_megatron(tmp_path / "x").offsets.tolist() == [0, 3, 3, 7]
    return tmp_path / "x.idx"


def _corrupt(idx: Path, at: int, data: bytes) -> None:
    raw = bytearray(idx.read_bytes())
    raw[at : at + len(data)] = data
    idx.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: _corrupt(p, 0, b"NOTMEGAT!"), r"does not start with the magic"),
        (lambda p: _corrupt(p, 9, struct.pack("<Q", 2)), r"has version 2; readable: 1"),
        (lambda p: _corrupt(p, 17, b"\x09"), r"has dtype code 9; valid codes: 1 \(uint8\), .*8 \(uint16\)"),
        (lambda p: p.write_bytes(p.read_bytes()[:20]), r"is truncated: 20 bytes, shorter than its 34-byte header"),
        (
            lambda p: p.write_bytes(p.read_bytes()[:-8]),
            r"has 94 bytes; its header \(3 sequences, 4 document index entries\) needs 102",
        ),
        (lambda p: p.write_bytes(p.read_bytes() + b"\0\0\0"), r"holds sequence modes \(a multimodal dataset\)"),
        (
            lambda p: p.with_suffix(".bin").write_bytes(b"\0" * 16),
            r"x.bin'.*7 uint16 tokens are 14 bytes, the file has 16",
        ),
        (lambda p: _corrupt(p, 34 + 12 + 8, struct.pack("<q", 8)), r"sequence 1 starts at byte 8, not at byte 6"),
        (lambda p: _corrupt(p, 34 + 36 + 8, struct.pack("<q", 3)), r"document index decreases at document 1"),
        (lambda p: _corrupt(p, 17, b"\x05"), r"sequence 1 starts at byte 6, not at byte 24 where sequence 0 \(3 int64"),
    ],
)
def test_corrupt_index_is_one_line_naming_the_file(tmp_path, damage, message):
    idx = _index(tmp_path)
    damage(idx)
    with pytest.raises(DataError, match=message) as e:
        open_megatron(tmp_path / "x")
    assert str(tmp_path / "x.") in str(e.value) and "\n" not in str(e.value)


def test_half_a_dataset_is_one_line(tmp_path):
    _index(tmp_path)
    (tmp_path / "x.bin").unlink()
    for source in ("x", "x.idx"):
        with pytest.raises(DataError, match=r"Megatron dataset '.*x.idx' has no '.*x.bin'"):
            D.prepare_source(str(tmp_path / source), DataConfig(cache_dir=str(tmp_path / "c")))


def test_info_on_a_corrupt_index_is_one_line_and_exit_2(tmp_path):
    # a process of its own: the command's main ends the process it runs in (axo4d.exits), never pytest's
    _corrupt(_index(tmp_path), 0, b"NOTMEGAT!")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run(
        [sys.executable, "-m", "axo4d.data", "info", str(tmp_path / "x.bin")], cwd=root, capture_output=True, text=True
    )
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("axo4d.data: error: Megatron index ") and "x.idx" in err[0], err


def test_writer_cuts_at_max_tokens_and_keeps_out_on_error(tmp_path):
    (tmp_path / "a.txt").write_text("hello " * 100)
    info = write_megatron(str(tmp_path / "a.txt"), "byte", tmp_path / "o", prefix="p", max_tokens=7)
    docs = open_megatron(tmp_path / "o" / "p")
    assert info["tokens"] == docs.n_tokens == 9 and bytes(_doc_tokens(docs, 0).astype(np.uint8)) == b"hello h\n\n"
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n{"nope": 1}\n')
    with pytest.raises(DataError, match="line 2"):
        write_megatron(str(tmp_path / "bad.jsonl"), "byte", tmp_path / "o", prefix="p", force=True)
    assert open_megatron(tmp_path / "o" / "p").n_tokens == 9 and not list(tmp_path.glob(".o.*"))


def test_data_memory_bench_megatron_smoke(tmp_path):
    """bench/data_memory.py --format megatron at a tiny size (the 2 GiB measurement is a documented command)."""
    from bench.data_memory import measure, write_megatron_files

    prefix = write_megatron_files(tmp_path / "m", 300_000)
    docs = open_megatron(prefix)
    assert docs.n_tokens == 300_000 and (tmp_path / "m" / "data.bin").stat().st_size == 600_000
    got = measure(str(prefix), 2)
    assert got["tokens"] == 300_000 and got["after_last_step"] >= got["before_open"] > 0


def test_cached_stream_index_follows_a_rewritten_index(tmp_path):
    """Same .bin, same counts, other document boundaries: the cached stream index is not reused."""
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    idx = _index(tmp_path)
    first = D.stream_indexes(open_megatron(tmp_path / "x"), None, cfg)["all"][1].tolist()
    before = idx.stat().st_mtime_ns
    write_index(idx, np.dtype(np.uint16), np.array([2, 1, 4]))
    os.utime(idx, ns=(before + 10**9, before + 10**9))  # a later write, whatever the clock's granularity
    second = D.stream_indexes(open_megatron(tmp_path / "x"), None, cfg)["all"][1].tolist()
    assert first == [0, 0, 3, 3, 7] and second == [0, 0, 2, 3, 7]
