"""Tokenizers, data sources, prepared folders and the cache, packing and held-out documents
(the order of samples, the step plan and the pipeline's done-when checks: test_data_pipeline.py)."""

from __future__ import annotations

import os
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from axo4d.config import DataConfig, load_config
from axo4d.config.errors import ConfigError
from axo4d.facts.grid import Grid
from axo4d.training.datasets import dataset as D
from axo4d.training.datasets.batches import StepPlan
from axo4d.training.datasets.dataset import DataError, TokenDataset, open_dataset, open_tokens, prepare_tokens, shard_of
from axo4d.training.datasets.prepared import open_documents
from axo4d.training.datasets.sources import source_files
from axo4d.training.datasets.tokenizer import load_tokenizer


def _cfg(tmp_path: Path, source: str, **kw) -> DataConfig:
    return DataConfig(source=source, cache_dir=str(tmp_path / "cache"), **kw)


def _text_dir(tmp_path: Path, n: int = 3) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.md").write_text("# héllo wörld\n" * 40)
    (root / "a.txt").write_text("the quick brown fox. " * 50)
    (root / "sub" / "c.py").write_text("def f(x):\n    return x + 1\n" * 30)
    (root / "blob.bin.dat").write_bytes(b"\x00\x01\x02binary")  # NUL byte: skipped
    (root / ".hidden").write_text("not me")
    return root


def _hf_tokenizer(tmp_path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tok.train_from_iterator(["the quick brown fox", "jumps over the lazy dog", "the end"], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


# ---- tokenizers --------------------------------------------------------------
def test_byte_tokenizer_round_trip():
    tok = load_tokenizer("byte")
    text = "héllo, wörld ✓\n\tdef f(): pass"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and tok.name == "byte"
    assert max(ids) < 256 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.encode_docs(["ab", "c"], sep="\n\n").tolist() == list(b"ab\n\nc")
    with pytest.raises(DataError, match="300"):
        tok.decode([65, 300])


def test_hf_tokenizer_json(tmp_path):
    path = _hf_tokenizer(tmp_path)
    tok = load_tokenizer(str(path))
    assert tok.vocab_size == 10  # 9 words + [UNK]
    assert tok.name.startswith("hf:tokenizer.json:")
    ids = tok.encode("the lazy fox")
    assert len(ids) == 3 and tok.decode(ids) == "the lazy fox"
    assert load_tokenizer(str(tmp_path)).name == tok.name  # a directory holding tokenizer.json
    # a text corpus through the HF tokenizer: one id per word
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("the quick brown fox " * 100)
    cfg = _cfg(tmp_path, str(tmp_path / "c"), tokenizer=str(path))
    docs = open_documents(prepare_tokens(cfg)[0])
    assert docs.n_tokens == 400 and docs.tokens[:4].tolist() == tok.encode("the quick brown fox")
    assert docs.separator.tolist() == []  # no end-of-text token, and "\n\n" is no word


def test_corrupt_and_missing_tokenizer(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "Nonsense"')
    with pytest.raises(DataError, match="tokenizer.json.*not a valid"):
        load_tokenizer(str(bad))
    with pytest.raises(DataError, match="nope.json"):
        load_tokenizer(str(tmp_path / "nope.json"))


def test_hf_tokenizer_without_package(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails
    with pytest.raises(DataError, match="pip install tokenizers"):
        load_tokenizer(str(path))


# ---- sources -------------------------------------------------------------------
def test_directory_source(tmp_path):
    root = _text_dir(tmp_path)
    _, files = source_files(str(root))
    assert [p.relative_to(root).as_posix() for p in files] == ["a.txt", "b.md", "sub/c.py"]
    docs = open_documents(prepare_tokens(_cfg(tmp_path, str(root)))[0])
    texts = [p.read_bytes() for p in files]
    assert docs.tokens.dtype == np.uint16 and len(docs) == 3
    assert np.asarray(docs.offsets).tolist() == np.cumsum([0] + [len(t) for t in texts]).tolist()
    assert bytes(np.asarray(docs.tokens, np.uint8)) == b"".join(texts)
    assert docs.separator.tolist() == list(D.DOC_SEP.encode())  # no end-of-text token in 'byte'
    # packed: the stream opens with the separator, documents follow each with one
    ds = open_dataset(_cfg(tmp_path, str(root), val_fraction=0.3), seq_len=16, seed=0)
    assert ds.split == "1 held-out documents" and ds.train.n_documents == 2
    tr = ds.train
    stream = np.concatenate([tr.read([j])[0][0][:-1] for j in range(tr.n_samples)])
    kept = [t for i, t in enumerate(texts) if i in tr.ids]
    expect = D.DOC_SEP.encode() + b"".join(t + D.DOC_SEP.encode() for t in kept)
    assert bytes(stream[: len(expect) - 1].astype(np.uint8)) == expect[:-1]
    # max_tokens keeps the head of the corpus
    head = open_documents(prepare_tokens(_cfg(tmp_path, str(root), max_tokens=100))[0])
    assert head.n_tokens == 100 and bytes(np.asarray(head.tokens, np.uint8)) == b"".join(texts)[:100]


def test_stdlib_source(tmp_path):
    cfg = _cfg(tmp_path, "stdlib", max_tokens=50_000)
    ds = open_dataset(cfg, seq_len=32, seed=0, vocab_size=256)
    assert len(ds) > 50_000  # the tokens, the separators and the stream's opening one
    root, files = D.source_files("stdlib")
    assert root == Path(sysconfig.get_paths()["stdlib"]) and len(files) > 100
    assert not any("site-packages" in p.parts for p in files)
    docs = open_documents(prepare_tokens(cfg)[0])
    assert docs.n_tokens == 50_000
    assert bytes(np.asarray(docs.tokens[:200], np.uint8)) == files[0].read_bytes()[:200]


@pytest.mark.parametrize(
    "suffix,dtype,token_dtype,vocab",
    [
        (".u16", np.uint16, "auto", 60_000),
        (".bin", np.uint16, "auto", 60_000),
        (".u32", np.uint32, "auto", 70_000),
        (".bin", np.uint32, "uint32", 60_000),
        (".bin", np.uint32, "auto", 70_000),  # .bin is uint32 when the vocabulary needs it
        (".npy", np.uint32, "auto", 70_000),
        (".npy", np.int64, "auto", 70_000),
    ],
)
def test_token_file_source(tmp_path, suffix, dtype, token_dtype, vocab):
    arr = (np.arange(5000) * 7 % vocab).astype(dtype)
    path = tmp_path / f"toks{suffix}"
    np.save(path, arr) if suffix == ".npy" else arr.tofile(path)
    cfg = _cfg(tmp_path, str(path), token_dtype=token_dtype)
    assert prepare_tokens(cfg) == [path]  # used in place, not cached
    ds = open_dataset(cfg, seq_len=16, seed=3, vocab_size=vocab)
    assert ds.split == "the tail of the stream" and len(ds) == 5000  # one document, no separator
    np.testing.assert_array_equal(np.asarray(ds.train.docs.tokens), arr)
    b = ds.batch("train", [0, 1, 5, 2])
    assert b.x.dtype == torch.int64 and b.x.shape == (4, 16) and b.mask is None and b.documents is None
    torch.testing.assert_close(b.x[:, 1:], b.y[:, :-1])
    assert b.x[2].tolist() == arr[80:96].tolist()  # sample j starts at token 16 j
    assert (
        len(open_dataset(DataConfig(source=str(path), token_dtype=token_dtype, max_tokens=1000), 16, 3, vocab)) == 1000
    )
    assert not (tmp_path / "cache").exists()


def test_token_file_errors(tmp_path):
    path = tmp_path / "t.u16"
    np.arange(1001, dtype=np.uint8).tofile(path)  # 1001 bytes: odd
    with pytest.raises(DataError, match="1001 bytes"):
        open_tokens(path)
    with pytest.raises(ConfigError, match="data.token_dtype='int8'; valid: auto, uint16, uint32"):
        load_config("tiny", ["data.token_dtype=int8"])  # choices: checked by the config loader
    npy = tmp_path / "t.npy"
    np.save(npy, np.zeros((4, 4), np.int32))
    with pytest.raises(DataError, match="2-D"):
        open_tokens(npy)


# ---- cache -------------------------------------------------------------------
def test_cache_reuse_and_atomicity(tmp_path, monkeypatch):
    root = _text_dir(tmp_path)
    cfg = _cfg(tmp_path, str(root))
    (p1,) = prepare_tokens(cfg)
    mtime = (p1 / "dataset.json").stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("re-tokenised despite the cache")

    monkeypatch.setattr(D, "write_prepared", boom)
    assert prepare_tokens(cfg) == [p1] and (p1 / "dataset.json").stat().st_mtime_ns == mtime
    names = [p.name for p in p1.parent.iterdir()]
    assert not [n for n in names if "partial" in n], names
    # a changed file (size/mtime) gives another cache entry
    monkeypatch.undo()
    (root / "a.txt").write_text("changed " * 60)
    assert prepare_tokens(cfg) != [p1]


def test_concurrent_prepare_tokenises_once(tmp_path, monkeypatch):
    root = _text_dir(tmp_path)
    calls = []
    real = D.write_prepared

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(D, "write_prepared", counting)
    cfg = _cfg(tmp_path, str(root))
    with ThreadPoolExecutor(8) as ex:
        paths = [p for (p,) in ex.map(lambda _: prepare_tokens(cfg), range(8))]
    assert len(set(paths)) == 1 and len(calls) == 1
    assert not [p for p in paths[0].parent.iterdir() if "partial" in p.name]


# ---- batches -----------------------------------------------------------------
def _ds(n: int = 20_000, seq_len: int = 16, seed: int = 7) -> TokenDataset:
    toks = (np.arange(n) % 251).astype(np.uint16)
    return TokenDataset(toks, seq_len, val_fraction=0.1, seed=seed)


def test_shards_concatenate_to_unsharded():
    ds = _ds()
    whole = StepPlan(ds, 32, 2)
    idx = whole.samples(5)[1]
    full = whole.read(idx, 1)
    assert full.x.shape == (16, 16)
    for n in (2, 4, 8, 16):
        parts = [StepPlan(ds, 32, 2, s, n).read(idx, 1) for s in range(n)]
        assert parts[0].x.shape == (16 // n, 16)
        torch.testing.assert_close(torch.cat([p.x for p in parts]), full.x)
        torch.testing.assert_close(torch.cat([p.y for p in parts]), full.y)


def test_grid_shards_are_grid_independent():
    ds = _ds()
    idx = StepPlan(ds, 8, 1).samples(3)[1]
    full = ds.batch("train", idx).x
    for grid in (Grid(data=2, z=2, x=2), Grid(data=4, y=2), Grid(z=8)):
        got: dict[int, torch.Tensor] = {}
        for r in range(grid.world_size):
            shard, n = shard_of(grid, r)
            x = StepPlan(ds, 8, 1, shard, n).read(idx, 0).x
            if shard in got:  # ranks of one (x, y) group share the batch
                torch.testing.assert_close(got[shard], x)
            got[shard] = x
        torch.testing.assert_close(torch.cat([got[s] for s in sorted(got)]), full)


def test_batches_deterministic_and_distinct():
    a, b = _ds(), _ds()
    pa, pb = StepPlan(a, 8, 1), StepPlan(b, 8, 1)
    assert np.array_equal(pa.samples(2)[1], pb.samples(2)[1])
    xa = a.batch("train", pa.samples(2)[1])
    torch.testing.assert_close(xa.x[:, 1:], xa.y[:, :-1])
    assert not np.array_equal(pa.samples(2)[1], pa.samples(3)[1])
    assert not np.array_equal(pa.samples(2)[1], StepPlan(_ds(seed=8), 8, 1).samples(2)[1])
    # train and validation are disjoint parts of the stream
    assert a.train.hi == a.val.lo and a.val.hi == len(a)
    assert np.array_equal(a.eval_ids(8), b.eval_ids(8)) and len(set(a.eval_ids(0))) == a.val.n_samples


def test_unigram_entropy_and_state():
    ds = TokenDataset(np.tile(np.arange(4, dtype=np.uint16), 1000), 8, 0.25, seed=1)
    nats, bits = ds.unigram_entropy("train")
    assert bits == pytest.approx(2.0, abs=1e-3) and nats == pytest.approx(2 * np.log(2), abs=1e-3)
    st = ds.state
    assert st["seed"] == 1 and st["seq_len"] == 8 and st["epoch_size"] == ds.train.n_samples


# ---- errors ------------------------------------------------------------------
def test_missing_and_empty_sources(tmp_path):
    with pytest.raises(DataError, match="does-not-exist"):
        prepare_tokens(_cfg(tmp_path, str(tmp_path / "does-not-exist")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty.*holds no text files"):
        prepare_tokens(_cfg(tmp_path, str(tmp_path / "empty")))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    with pytest.raises(DataError, match="0 tokens"):
        prepare_tokens(_cfg(tmp_path, str(tmp_path / "blank")))


def test_too_few_tokens(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("x" * 100)  # one document: validation is the stream's tail
    with pytest.raises(DataError, match=r"104 tokens.*val=5.*seq_len\+1=65"):  # with the two separators
        open_dataset(_cfg(tmp_path, str(tmp_path / "c")), seq_len=64, seed=0)
    ds = open_dataset(_cfg(tmp_path, str(tmp_path / "c"), val_fraction=0.3), seq_len=16, seed=0)
    assert ds.split == "the tail of the stream" and ds.val.n_tokens == 31 and ds.val.n_samples == 2
    assert ds.batch("val", [1]).mask.sum() == ds.val.targets([1]) == 31 - 16 - 1  # short: its padding masked
    with pytest.raises(DataError, match="val_fraction=0.0"):
        TokenDataset(np.zeros(1000, np.uint16), 8, 0.0)
    # documents held out: a split of any size that gives one sample will do
    (tmp_path / "d").mkdir()
    for i in range(20):
        (tmp_path / "d" / f"{i:02d}.txt").write_text("y" * 5)
    ds = open_dataset(_cfg(tmp_path, str(tmp_path / "d")), seq_len=64, seed=0)
    assert ds.split == "1 held-out documents" and ds.val.n_samples == 1 and ds.val.n_tokens < 65


def test_token_out_of_vocab(tmp_path):
    path = tmp_path / "t.u16"
    arr = np.zeros(1000, np.uint16)
    arr[500] = 300
    arr.tofile(path)
    with pytest.raises(DataError, match="token id 300.*0..255"):
        open_dataset(_cfg(tmp_path, str(path)), seq_len=8, seed=0, vocab_size=256)
    # a text corpus with non-ASCII bytes against a too-small vocabulary
    root = _text_dir(tmp_path)
    with pytest.raises(DataError, match=r"token id \d+.*0..99"):
        open_dataset(_cfg(tmp_path, str(root)), seq_len=8, seed=0, vocab_size=100)


def test_divisibility_error():
    with pytest.raises(DataError, match="global batch 12 does not cut into 1 micro-batches of a multiple of 8"):
        StepPlan(_ds(), 12, 1, 0, 8)
    with pytest.raises(DataError, match="unknown split 'test'"):
        _ds().batch("test", [0])


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("AXO4D_CACHE", str(tmp_path / "env"))
    assert D.default_cache_dir(DataConfig()) == tmp_path / "env"
    assert D.default_cache_dir(DataConfig(cache_dir=str(tmp_path / "c"))) == tmp_path / "c"
    monkeypatch.delenv("AXO4D_CACHE")
    assert D.default_cache_dir(DataConfig()) == Path(os.path.expanduser("~")) / ".cache" / "axo4d"
