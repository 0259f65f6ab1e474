"""A run's dataset: its sources prepared once, split into training and held-out samples, ordered.

``data.source`` (or the mixture ``data.sources``) names text sources
(:mod:`axo4d.training.datasets.sources`), prepared folders, token files or Megatron indexed datasets
(:mod:`axo4d.training.datasets.megatron`). :func:`prepare_tokens` turns
each text source into a prepared folder in the cache (``<cache_dir>/prepared-<key>``, ``key`` a
hash of the files with sizes and mtimes, the tokenizer, ``text_field`` and ``max_tokens``), once,
under a lock, appearing atomically: the trainer calls it on rank 0, then every rank calls
:func:`open_dataset` (memory maps; no tokenisation). ``python -m axo4d.data prepare`` makes the same
folder ahead of a job.

:func:`open_dataset` packs each source's documents into samples (:mod:`~axo4d.training.datasets.packing`)
after holding documents out for validation (``data.val_fraction``, or all of ``data.val_source``),
and orders the training samples by epochs (:mod:`~axo4d.training.datasets.order`), by weight for a
mixture. Which samples a step takes is :mod:`~axo4d.training.datasets.batches`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from axo4d.config import DataConfig, default_cache_dir
from axo4d.config.errors import DataError
from axo4d.facts.grid import Grid
from axo4d.training.datasets.megatron import megatron_prefix, open_megatron
from axo4d.training.datasets.order import STREAM_VAL, EpochOrder, MixtureOrder, key_of, permute
from axo4d.training.datasets.packing import (
    SPLIT_KEY,
    ConcatSamples,
    PackedSamples,
    held_out_count,
    split_documents,
    stream_index,
)
from axo4d.training.datasets.prepared import DOC_SEP, FORMAT, Documents, is_token_source, open_documents, open_tokens
from axo4d.training.datasets.prepared_writer import Progress, replaced_note, write_prepared
from axo4d.training.datasets.sources import named_documents, resolve_source, source_files
from axo4d.training.datasets.tokenizer import load_tokenizer

__all__ = [
    "DataError",
    "Batch",
    "Dataset",
    "TokenDataset",
    "prepare_tokens",
    "open_tokens",
    "open_dataset",
    "shard_of",
    "default_cache_dir",
    "source_files",
    "named_documents",
    "DOC_SEP",
]


@dataclass
class Batch:
    """Samples as a model reads them: ``x``, ``y`` (B, T) int64; ``documents`` (B, T) int32, the
    document of each input token (``data.document_mask``, else None); ``mask`` (B, T) bool, the
    targets that count (None: all of them)."""

    x: torch.Tensor
    y: torch.Tensor
    documents: torch.Tensor | None = None
    mask: torch.Tensor | None = None


def shard_of(grid: Grid, rank: int) -> tuple[int, int]:
    """``(shard, n_shards)`` of ``rank``: its index in its (z, data) group, z fastest."""
    return grid.group_index(rank, ("z", "data")), grid.size("z", "data")


# ---- preparing sources -------------------------------------------------------------------------
def _cache_key(source: str, cfg: DataConfig, tok_name: str) -> str:
    root, files = source_files(source)
    h = hashlib.sha256()
    meta = {"v": FORMAT, "root": str(root.resolve()), "tok": tok_name, "max_tokens": cfg.max_tokens}
    meta["text_field"] = cfg.text_field
    h.update(json.dumps(meta, sort_keys=True).encode())
    for p in files:
        st = p.stat()
        h.update(f"\n{p.relative_to(root).as_posix()}\t{st.st_size}\t{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (no-op where fcntl is unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _sources(cfg: DataConfig) -> list[tuple[str, float]]:
    return [(s.path, s.weight) for s in cfg.sources] if cfg.sources else [(cfg.source, 1.0)]


def prepare_source(source: str, cfg: DataConfig) -> Path:
    """The prepared folder or token file of one source, tokenising a text source into the cache
    if it is not there yet (safe from many processes at once; cheap when cached)."""
    if source != "stdlib" and (megatron_prefix(source) is not None or is_token_source(resolve_source(source))):
        return Path(source).expanduser()
    tok = load_tokenizer(cfg.tokenizer)
    cache = default_cache_dir(cfg)
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"prepared-{_cache_key(source, cfg, tok.name)}"
    if (out / "dataset.json").is_file():
        return out
    with _file_lock(out.with_suffix(".lock")):
        if not (out / "dataset.json").is_file():  # another process finished while we waited
            _, files = source_files(source)
            print(
                f"data: tokenising {len(files)} files of {source} with {tok.name} into {out} "
                f"(python -m axo4d.data prepare does this ahead of a job)",
                file=sys.stderr,
                flush=True,
            )
            bar = Progress(sum(p.stat().st_size for p in files))
            info = write_prepared(
                source, cfg.tokenizer, out, text_field=cfg.text_field, max_tokens=cfg.max_tokens, progress=bar.update
            )
            if replaced_note(info):
                print(f"data: warning: {source}: {replaced_note(info)}", file=sys.stderr, flush=True)
    return out


def prepare_tokens(cfg: DataConfig) -> list[Path]:
    """Every source of ``cfg`` (the training sources, then ``val_source``) prepared, with the
    stream indexes of its splits in the cache (:func:`stream_indexes`)."""
    if cfg.max_tokens < 0:
        raise DataError(f"data.max_tokens={cfg.max_tokens} must be >= 0 (0 = all tokens)")
    paths = [prepare_source(s, cfg) for s, _ in _sources(cfg)]
    for source, _ in _sources(cfg):
        stream_indexes(_open_source(source, cfg, None), None if cfg.val_source else cfg.val_fraction, cfg)
    if cfg.val_source:
        paths.append(prepare_source(cfg.val_source, cfg))
        stream_indexes(_open_source(cfg.val_source, cfg, None), None, cfg)
    return paths


def stream_indexes(docs: Documents, val_fraction: float | None, cfg: DataConfig) -> dict | None:
    """The :func:`~axo4d.training.datasets.packing.stream_index` of each split of ``docs``: ``train`` and
    ``val`` (held-out documents), or ``all`` (``val_fraction`` None), or None when the source holds
    out its stream's tail. For a file-backed source they are computed once, written to the cache
    (``<cache_dir>/index-<key>``, under a lock) and memory-mapped: opening a dataset then reads
    nothing of the index but the pages a sample needs."""
    if val_fraction is not None and held_out_count(len(docs), val_fraction) is None:
        return None
    parts = ("all",) if val_fraction is None else ("train", "val")

    def compute() -> dict:
        if val_fraction is None:
            return {"all": stream_index(docs)}
        train, val = split_documents(len(docs), val_fraction)
        return {"train": stream_index(docs, train), "val": stream_index(docs, val)}

    t = docs.tokens
    if not isinstance(t, np.memmap) or not t.filename:
        return compute()
    st = os.stat(t.filename)
    ident = [FORMAT, str(Path(t.filename).resolve()), st.st_size, st.st_mtime_ns, len(docs), docs.n_tokens]
    ident += [len(docs.separator), val_fraction, SPLIT_KEY] + ([docs.info["index"]] if "index" in docs.info else [])
    folder = default_cache_dir(cfg) / f"index-{hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:20]}"
    files = {p: (folder / f"{p}_ids.npy", folder / f"{p}_starts.npy") for p in parts}
    if not (folder / "COMPLETE").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(folder.with_suffix(".lock")):
            if not (folder / "COMPLETE").is_file():
                tmp = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                for p, (ids, starts) in compute().items():
                    np.save(tmp / files[p][0].name, ids)
                    np.save(tmp / files[p][1].name, starts)
                (tmp / "COMPLETE").write_text(json.dumps(ident) + "\n")
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
    return {p: (np.load(a, mmap_mode="r"), np.load(b, mmap_mode="r")) for p, (a, b) in files.items()}


# ---- the dataset -----------------------------------------------------------------------------
class Dataset:
    """Training samples in epoch order and held-out validation samples, of ``seq_len + 1`` tokens."""

    def __init__(self, train, val, order, seq_len: int, seed: int, name: str, document_mask: bool = False) -> None:
        self.train, self.val, self.order = train, val, order
        self.seq_len, self.seed, self.name, self.document_mask = seq_len, seed, name, document_mask
        self.split = "held-out documents"

    @property
    def epoch_size(self) -> int:
        """Samples per epoch (of a mixture: its epoch)."""
        return self.order.epoch_size

    @property
    def n_train(self) -> int:
        return self.train.n_tokens

    @property
    def n_val(self) -> int:
        return self.val.n_tokens if self.val is not None else 0

    def __len__(self) -> int:
        return self.n_train + self.n_val

    def _set(self, split: str):
        if split not in ("train", "val"):
            raise DataError(f"unknown split {split!r}; valid: train, val")
        s = self.train if split == "train" else self.val
        if s is None:
            raise DataError(f"dataset {self.name!r} has no {split} split")
        return s

    def batch(self, split: str, idx: np.ndarray, device: torch.device | str | None = None) -> Batch:
        """Samples ``idx`` of ``split`` (-1: an empty sample) as a :class:`Batch` on ``device``."""
        tokens, docs, valid = self._set(split).read(np.asarray(idx, np.int64))  # (B, T+1), (B, T+1), (B, T)
        x = torch.from_numpy(np.ascontiguousarray(tokens[:, :-1]))  # (B, T)
        y = torch.from_numpy(np.ascontiguousarray(tokens[:, 1:]))  # (B, T)
        d = torch.from_numpy(np.ascontiguousarray(docs[:, :-1])) if self.document_mask else None
        m = None if valid.all() else torch.from_numpy(valid)
        if device is not None:
            x, y = x.to(device), y.to(device)
            d = None if d is None else d.to(device)
            m = None if m is None else m.to(device)
        return Batch(x, y, d, m)

    def targets(self, split: str, idx: np.ndarray) -> int:
        """Targets that count in samples ``idx`` of ``split``."""
        return self._set(split).targets(np.asarray(idx, np.int64))

    def eval_ids(self, count: int) -> np.ndarray:
        """The validation samples an evaluation reads: ``count`` (all when 0 or more than there are)
        in a fixed pseudo-random order, the same for every seed and grid."""
        n = self._set("val").n_samples
        count = n if count <= 0 or count > n else count
        return permute(np.arange(count), n, key_of(STREAM_VAL))

    def describe(self) -> str:
        v = f"{self.n_val:,} val tokens ({self.split})" if self.val is not None else "no validation"
        return (
            f"{self.name}: {self.n_train:,} train tokens in {self.train.n_samples:,} samples, {v}; "
            f"epoch of {self.epoch_size:,} samples"
        )

    @property
    def state(self) -> dict:
        """What a checkpoint records to tell whether a resume reads the same samples."""
        return {
            "name": self.name,
            "seq_len": self.seq_len,
            "seed": int(self.seed),
            "train_samples": self.train.n_samples,
            "epoch_size": self.epoch_size,
        }

    def unigram_entropy(self, split: str = "train", max_samples: int = 4096) -> tuple[float, float]:
        """``(nats, bits)``: entropy of the split's target-token frequencies (from at most
        ``max_samples`` evenly spaced samples). A model that beats it has learnt more than frequencies."""
        s = self._set(split)
        idx = np.unique(np.linspace(0, s.n_samples - 1, min(max_samples, s.n_samples)).astype(np.int64))
        tokens, _, valid = s.read(idx)
        counts = np.bincount(tokens[:, 1:][valid])
        p = counts[counts > 0] / counts.sum()
        nats = float(-(p * np.log(p)).sum())
        return nats, nats / np.log(2)


def _stream_split(docs: Documents, seq_len: int, val_fraction: float) -> tuple[PackedSamples, PackedSamples]:
    """Train and validation from the head and the tail ``val_fraction`` of one stream."""
    whole = PackedSamples(docs, seq_len)
    n_val = int(whole.n_tokens * val_fraction)
    train = PackedSamples(docs, seq_len, lo=0, hi=whole.n_tokens - n_val)
    val = PackedSamples(docs, seq_len, lo=whole.n_tokens - n_val, hi=whole.n_tokens)
    return train, val


def _check_stream_sizes(name: str, train, val, seq_len: int, val_fraction: float) -> None:
    """A stream cut into head and tail: each needs one whole sample."""
    need = seq_len + 1
    if min(train.n_tokens, val.n_tokens) < need:
        raise DataError(
            f"dataset {name!r} has {train.n_tokens + val.n_tokens} tokens, split into train={train.n_tokens} and "
            f"val={val.n_tokens} (val_fraction={val_fraction}); each split needs at least seq_len+1={need} tokens: "
            f"use more data (data.max_tokens/source), a shorter seq_len or another val_fraction"
        )


def _check_sizes(name: str, train, val, seq_len: int, why: str) -> None:
    for split, s in (("train", train), ("val", val)):
        if s is not None and s.n_samples < 1:
            raise DataError(
                f"dataset {name!r} has {train.n_tokens} train and {0 if val is None else val.n_tokens} val "
                f"tokens ({why}); the {split} split gives no sample of seq_len={seq_len} (it needs at least "
                f"2 tokens): use more data (data.max_tokens/source) or another val_fraction"
            )


class TokenDataset(Dataset):
    """A token stream as one document: train is its head, validation its tail ``val_fraction``."""

    def __init__(
        self, tokens: np.ndarray, seq_len: int, val_fraction: float = 0.05, seed: int = 0, name: str = "tokens"
    ) -> None:
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"data.val_fraction={val_fraction} must be strictly between 0 and 1")
        docs = Documents(tokens, np.array([0, len(tokens)], np.int64), np.zeros(0, np.int64), name)
        train, val = _stream_split(docs, seq_len, val_fraction)
        _check_stream_sizes(name, train, val, seq_len, val_fraction)
        super().__init__(train, val, EpochOrder(train.n_samples, seed), seq_len, seed, name)
        self.split = "the tail of the stream"
        self.tokens = tokens


def _head(docs: Documents, max_tokens: int) -> Documents:
    """The documents of the first ``max_tokens`` tokens (the last one cut); all when 0."""
    if max_tokens <= 0 or docs.n_tokens <= max_tokens:
        return docs
    k = int(np.searchsorted(docs.offsets, max_tokens, side="left"))
    off = np.append(np.asarray(docs.offsets[:k]), max_tokens).astype(np.int64)
    return Documents(docs.tokens, off, docs.separator, docs.name, docs.info)


def _open_source(source: str, cfg: DataConfig, vocab_size: int | None) -> Documents:
    path = prepare_source(source, cfg)
    prefix = megatron_prefix(path)
    if prefix is not None:
        return _head(open_megatron(prefix, vocab_size), cfg.max_tokens)
    raw_file = path.is_file()
    docs = open_documents(path, cfg.token_dtype if raw_file else "auto", vocab_size, cfg.max_tokens if raw_file else 0)
    return _head(docs, cfg.max_tokens) if not raw_file else docs


def open_dataset(cfg: DataConfig, seq_len: int, seed: int, vocab_size: int | None = None) -> Dataset:
    """``cfg``'s sources (prepared or found in the cache), split and ordered (module docstring).
    Token ids outside ``0..vocab_size-1`` (when given) are a :class:`DataError`."""
    if not 0.0 < cfg.val_fraction < 1.0 and not cfg.val_source:
        raise DataError(f"data.val_fraction={cfg.val_fraction} must be strictly between 0 and 1")
    srcs = _sources(cfg)
    trains, vals, how = [], [], set()
    for source, _ in srcs:
        docs = _open_source(source, cfg, vocab_size)
        index = stream_indexes(docs, None if cfg.val_source else cfg.val_fraction, cfg)
        if cfg.val_source:
            trains.append(PackedSamples(docs, seq_len, index=index["all"]))
            continue
        if index is None:
            train, val = _stream_split(docs, seq_len, cfg.val_fraction)
            _check_stream_sizes(source, train, val, seq_len, cfg.val_fraction)
            how.add("the tail of the stream")
        else:
            train, val = (
                PackedSamples(docs, seq_len, index=index["train"]),
                PackedSamples(docs, seq_len, index=index["val"]),
            )
            how.add(f"{val.n_documents:,} held-out documents" if len(srcs) == 1 else "held-out documents")
        _check_sizes(source, train, val, seq_len, f"val_fraction={cfg.val_fraction}")
        trains.append(train)
        vals.append(val)
    if cfg.val_source:
        vdocs = _open_source(cfg.val_source, cfg, vocab_size)
        vals = [PackedSamples(vdocs, seq_len, index=stream_indexes(vdocs, None, cfg)["all"])]
        how = {f"data.val_source={cfg.val_source}"}
        _check_sizes(cfg.val_source, trains[0], vals[0], seq_len, "data.val_source")
    name = cfg.source if not cfg.sources else "mixture of " + ", ".join(s for s, _ in srcs)
    if len(trains) == 1:
        train, order = trains[0], EpochOrder(trains[0].n_samples, seed)
    else:
        train = ConcatSamples(trains)
        order = MixtureOrder([t.n_samples for t in trains], [w for _, w in srcs], seed)
    val = vals[0] if len(vals) == 1 else ConcatSamples(vals)
    ds = Dataset(train, val, order, seq_len, seed, name, cfg.document_mask)
    ds.split = ", ".join(sorted(how))
    return ds
