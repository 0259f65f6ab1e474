"""Prepared datasets: a memory-mapped token file and a document index, written once, opened cheaply.

A prepared folder holds::

    tokens.u16 | tokens.u32   every document's tokens, end to end (uint32 for vocabularies > 65536)
    documents.npy             int64 offsets (documents + 1,): document i is tokens[off[i]:off[i+1]]
    dataset.json              format, counts, the tokenizer, the separator packing puts after each
                              document (its end-of-text token, else the tokens of "\\n\\n"), the source

:func:`write_prepared` makes one from a text source (:mod:`axo4d.training.datasets.sources`), tokenising
batches of documents in worker processes, in order, with a progress line; the folder appears
atomically (written beside it, then renamed) and an error leaves the destination untouched.
:func:`open_documents` opens a prepared folder, or a bare token file as one document, as
:class:`Documents`: memory maps, checked against each other, nothing read into memory but the
metadata.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from axo4d.config.errors import DataError
from axo4d.training.datasets.sources import TOKEN_SUFFIXES, named_documents, source_files
from axo4d.training.datasets.tokenizer import Tokenizer, load_tokenizer

FORMAT = "axo4d-tokens/1"
DOC_SEP = "\n\n"
"""Text placed between documents when the tokenizer has no end-of-text token."""
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_BATCH_BYTES = 4 << 20  # text per worker task
_CHUNK = 1 << 22  # elements per chunk of a scan


@dataclass
class Documents:
    """Documents as token ranges of one token array (memory maps)."""

    tokens: np.ndarray
    """1-D integer token ids."""
    offsets: np.ndarray
    """``(n + 1,)`` int64: document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``."""
    separator: np.ndarray
    """int64 tokens packing puts after every document (may be empty)."""
    name: str
    info: dict = field(default_factory=dict)
    _fd: int | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def read(self, start: int, n: int) -> np.ndarray:
        """``tokens[start:start + n]``; from a file with ``pread`` (into the page cache, not into
        this process's memory: a run's resident memory does not grow with the samples it visits)."""
        t = self.tokens
        if not isinstance(t, np.memmap) or not t.filename:
            return np.asarray(t[start : start + n])
        if self._fd is None:
            self._fd = os.open(t.filename, os.O_RDONLY)
        raw = os.pread(self._fd, n * t.itemsize, t.offset + start * t.itemsize)  # (t maps its file from t.offset)
        return np.frombuffer(raw, dtype=t.dtype)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None}  # a file descriptor is this process's

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])


def separator_of(tok: Tokenizer) -> list[int]:
    return [int(tok.eos_id)] if tok.eos_id is not None else [int(t) for t in tok.encode(DOC_SEP)]


def is_prepared(path: Path) -> bool:
    return path.is_dir() and (path / "dataset.json").is_file()


# ---- opening ---------------------------------------------------------------------------------
def _raw_dtype(path: Path, token_dtype: str, vocab_size: int | None) -> np.dtype:
    if token_dtype != "auto":
        return np.dtype(TOKEN_DTYPES[token_dtype])
    if path.suffix == ".u32" or (path.suffix == ".bin" and vocab_size is not None and vocab_size > 1 << 16):
        return np.dtype(np.uint32)
    return np.dtype(np.uint16)


def open_tokens(
    path: str | Path, token_dtype: str = "auto", vocab_size: int | None = None, max_tokens: int = 0
) -> np.ndarray:
    """Memory-map a token file as a 1-D integer array (first ``max_tokens`` tokens; 0 = all).

    With ``vocab_size``, token ids outside ``0..vocab_size-1`` are a :class:`DataError`.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token file {str(path)!r} does not exist")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read token file {str(path)!r} as .npy: {e}") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise DataError(
                f"token file {str(path)!r} holds a {arr.ndim}-D {arr.dtype} array; expected a 1-D integer array"
            )
        if token_dtype != "auto" and arr.dtype != np.dtype(TOKEN_DTYPES[token_dtype]):
            raise DataError(
                f"token file {str(path)!r} holds {arr.dtype} but data.token_dtype is "
                f"{token_dtype!r}; use 'auto' or {arr.dtype.name!r}"
            )
    else:
        dt = _raw_dtype(path, token_dtype, vocab_size)
        size = path.stat().st_size
        if size % dt.itemsize:
            raise DataError(
                f"token file {str(path)!r} has {size} bytes, not a multiple of {dt.itemsize} "
                f"({dt.name}); check data.token_dtype (valid: auto, {', '.join(TOKEN_DTYPES)})"
            )
        arr = np.memmap(path, dtype=dt, mode="r") if size else np.zeros(0, dt)
    if max_tokens > 0:
        arr = arr[:max_tokens]
    if len(arr) == 0:
        raise DataError(f"token file {str(path)!r} holds 0 tokens: the dataset is empty")
    if vocab_size is not None:
        check_vocab(arr, vocab_size, path)
    return arr


def _scan(arr: np.ndarray, max_scan: int = 1 << 28) -> Iterator[np.ndarray]:
    """Copies of chunks covering ``arr`` (64 evenly spaced chunks when longer than ``max_scan``),
    read as private copies so that a scan of a memory map does not stay resident."""
    n = len(arr)
    starts = range(0, n, _CHUNK) if n <= max_scan else np.linspace(0, n - _CHUNK, 64).astype(np.int64)
    base = arr.filename if isinstance(arr, np.memmap) else None  # (arr maps its file from arr.offset on)
    for s in starts:
        s = int(s)
        if base is not None:
            with open(base, "rb") as f:
                f.seek(arr.offset + s * arr.itemsize)
                yield np.fromfile(f, dtype=arr.dtype, count=min(_CHUNK, n - s))
        else:
            yield np.array(arr[s : s + _CHUNK])


def check_vocab(arr: np.ndarray, vocab_size: int, where: object) -> None:
    """:class:`DataError` when a token id of ``arr`` is outside ``0..vocab_size-1``."""
    lo, hi = 0, 0
    for c in _scan(arr):
        if len(c):
            lo, hi = min(lo, int(c.min())), max(hi, int(c.max()))
    if lo < 0:
        raise DataError(
            f"token id {lo} in {str(where)!r} is negative: token ids are 0..{vocab_size - 1}; the file does "
            f"not hold token ids as read (a signed array of other values, or the wrong data.token_dtype)"
        )
    if hi >= vocab_size:
        raise DataError(
            f"token id {hi} in {str(where)!r} is outside the model vocabulary 0..{vocab_size - 1}; "
            f"set model.vocab_size >= {hi + 1} or use the matching tokenizer"
        )


def _read_info(folder: Path) -> dict:
    path = folder / "dataset.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {str(path)!r}: {e}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise DataError(f"{str(path)!r} is not an axo4d prepared dataset (format {FORMAT!r})")
    return info


def _check_index(off: np.ndarray, n_docs: int, n_tokens: int, index: Path, tokens: Path) -> None:
    """The document index against its token file: one line naming both and what does not match."""

    def bad(what: str) -> DataError:
        return DataError(f"document index {str(index)!r} does not match its token file {str(tokens)!r}: {what}")

    if off.ndim != 1 or off.dtype.kind not in "iu":
        raise bad(f"it holds a {off.ndim}-D {off.dtype} array, not 1-D integer offsets")
    if len(off) != n_docs + 1:
        raise bad(f"{len(off) - 1} documents, but dataset.json says {n_docs}")
    if len(off) == 0 or int(off[0]) != 0:
        raise bad("the first offset is not 0")
    if int(off[-1]) != n_tokens:
        raise bad(f"the last document ends at token {int(off[-1])}, but the token file holds {n_tokens} tokens")
    for s in range(0, len(off) - 1, _CHUNK):
        d = np.diff(np.asarray(off[s : s + _CHUNK + 1]))
        if (d < 0).any():
            raise bad(f"offsets decrease at document {s + int(np.argmax(d < 0))}")


def open_prepared(folder: Path, vocab_size: int | None = None) -> Documents:
    """A prepared folder as :class:`Documents`, its files checked against each other."""
    info = _read_info(folder)
    tokens_path = folder / str(info.get("tokens_file", ""))
    dtype = info.get("dtype")
    if dtype not in TOKEN_DTYPES or not tokens_path.is_file():
        raise DataError(f"{str(folder / 'dataset.json')!r} names no token file of uint16/uint32 in {str(folder)!r}")
    size, item = tokens_path.stat().st_size, np.dtype(dtype).itemsize
    if size % item or size // item != info.get("tokens"):
        raise DataError(
            f"token file {str(tokens_path)!r} has {size} bytes; dataset.json says {info.get('tokens')} {dtype} tokens"
        )
    tokens = np.memmap(tokens_path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
    index = folder / "documents.npy"
    try:
        off = np.load(index, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read document index {str(index)!r}: {e}") from None
    _check_index(off, int(info.get("documents", -1)), size // item, index, tokens_path)
    if len(off) == 1:
        raise DataError(f"prepared dataset {str(folder)!r} holds 0 documents: the dataset is empty")
    if vocab_size is not None and int(info.get("vocab_size", 1 << 62)) > vocab_size:
        check_vocab(tokens, vocab_size, tokens_path)  # made with a larger vocabulary: look at the ids
    sep = np.asarray(info.get("separator", []), dtype=np.int64)
    if vocab_size is not None and len(sep) and (sep.min() < 0 or sep.max() >= vocab_size):
        raise DataError(
            f"separator token {int(sep.max())} of {str(folder)!r} is outside the model vocabulary 0..{vocab_size - 1}"
        )
    return Documents(tokens, off, sep, str(folder), info)


def open_documents(
    path: Path, token_dtype: str = "auto", vocab_size: int | None = None, max_tokens: int = 0
) -> Documents:
    """A prepared folder, or a token file as one document with no separator (its tokens as they are)."""
    if is_prepared(path):
        return open_prepared(path, vocab_size)
    arr = open_tokens(path, token_dtype, vocab_size, max_tokens)
    return Documents(arr, np.array([0, len(arr)], np.int64), np.zeros(0, np.int64), str(path), {"documents": 1})


def is_token_source(path: Path) -> bool:
    return is_prepared(path) or (path.is_file() and path.suffix in TOKEN_SUFFIXES)


# ---- writing ---------------------------------------------------------------------------------
_worker_tok: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _worker_tok
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_tok = load_tokenizer(spec)


def _encode_batch(texts: list[str], tok: Tokenizer | None = None, dedup: bool = False):
    """``(lengths, tokens, hashes)`` of a batch of documents (hashes of the texts, if ``dedup``)."""
    tok = tok or _worker_tok
    ids = [np.asarray(tok.encode_docs([t]), dtype=np.int64) for t in texts]
    lengths = np.array([len(a) for a in ids], np.int64)
    hashes = None
    if dedup:
        import hashlib

        hashes = [hashlib.blake2b(t.encode("utf-8", "replace"), digest_size=8).digest() for t in texts]
    return lengths, np.concatenate(ids) if ids else np.zeros(0, np.int64), hashes


class Progress:
    """A progress line on ``stream``: a bar over the source's bytes, tokens/s and the ETA
    (redrawn in place on a terminal, a line every ``every_s`` seconds otherwise)."""

    def __init__(self, total_bytes: int, stream=None, every_s: float = 10.0) -> None:
        self.total, self.stream, self.t0, self.last = max(1, total_bytes), stream or sys.stderr, time.time(), 0.0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = 0.2 if self.tty else every_s

    def update(self, done_bytes: int, docs: int, tokens: int, final: bool = False) -> None:
        now = time.time()
        if not final and now - self.last < self.every:
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        frac = min(1.0, done_bytes / self.total)
        eta = (dt / frac - dt) if frac > 0 else float("nan")
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        eta_s = time.strftime("%H:%M:%S", time.gmtime(eta)) if eta == eta else "?"
        line = (
            f"[{bar}] {100 * frac:5.1f}% | {docs:,} documents | {tokens:,} tokens | "
            f"{tokens / dt:,.0f} tokens/s | ETA {eta_s}"
        )
        print(("\r" + line) if self.tty else line, end="\n" if final or not self.tty else "", file=self.stream)
        self.stream.flush()


def _text_batches(docs: Iterator[tuple[str, str]]) -> Iterator[tuple[list[str], int]]:
    """Documents in groups of about ``_BATCH_BYTES`` characters, with each group's size."""
    group: list[str] = []
    size = 0
    for _, text in docs:
        group.append(text)
        size += len(text)
        if size >= _BATCH_BYTES:
            yield group, size
            group, size = [], 0
    if group:
        yield group, size


def write_prepared(
    source: str,
    tokenizer: str,
    out: Path,
    *,
    text_field: str = "text",
    workers: int = 1,
    dedup: bool = False,
    max_tokens: int = 0,
    force: bool = False,
    progress: Callable[[int, int, int, bool], None] | None = None,
) -> dict:
    """Tokenise ``source`` into the prepared folder ``out`` (module docstring); returns its
    ``dataset.json``. Empty documents are skipped (counted); with ``dedup``, a document whose text
    equals an earlier one's is dropped (counted). ``max_tokens``: stop after this many (0 = all)."""
    out = Path(out)
    if out.exists() and not force:
        raise DataError(f"output {str(out)!r} already exists; choose another --out or pass --force to replace it")
    tok = load_tokenizer(tokenizer)
    root, files = source_files(source)
    total = sum(p.stat().st_size for p in files)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.time()
    counts = {"documents": 0, "tokens": 0, "skipped_empty": 0, "duplicates": 0, "read_bytes": 0}
    lengths: list[np.ndarray] = []
    seen: set[bytes] = set()
    try:
        with open(tmp / f"tokens.{'u16' if dtype == np.uint16 else 'u32'}", "wb") as f:
            batches = _text_batches(named_documents(files, text_field, root))
            for size, (lens, ids, hashes) in _encoded(batches, tokenizer, tok, workers, dedup):
                counts["read_bytes"] += size
                lens, ids = _keep(lens, ids, hashes, seen, counts)
                if 0 < max_tokens < counts["tokens"] + len(ids):  # cut at max_tokens
                    room = max_tokens - counts["tokens"]
                    c = np.cumsum(lens)
                    k = int(np.searchsorted(c, room, side="left"))
                    lens = np.append(lens[:k], room - (c[k - 1] if k else 0))
                    lens, ids = lens[lens > 0], ids[:room]
                ids.astype(dtype).tofile(f)
                lengths.append(lens)
                counts["documents"] += len(lens)
                counts["tokens"] += len(ids)
                if progress is not None:
                    progress(min(counts["read_bytes"], total), counts["documents"], counts["tokens"], False)
                if 0 < max_tokens <= counts["tokens"]:
                    break
        if counts["documents"] == 0:
            raise DataError(
                f"data source {source!r} gives 0 tokens ({len(files)} files, {counts['skipped_empty']} empty "
                f"documents): the dataset is empty"
            )
        off = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
        np.save(tmp / "documents.npy", off)
        info = {
            "format": FORMAT,
            "tokens_file": f"tokens.{'u16' if dtype == np.uint16 else 'u32'}",
            "dtype": np.dtype(dtype).name,
            "documents": counts["documents"],
            "tokens": counts["tokens"],
            "skipped_empty": counts["skipped_empty"],
            "duplicates": counts["duplicates"] if dedup else None,
            "separator": separator_of(tok),
            "tokenizer": tok.name,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "source": source,
            "files": len(files),
            "text_field": text_field,
            "max_tokens": max_tokens,
            "seconds": round(time.time() - t0, 3),
        }
        (tmp / "dataset.json").write_text(json.dumps(info, indent=1) + "\n")
        if progress is not None:
            progress(total, counts["documents"], counts["tokens"], True)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _keep(lens: np.ndarray, ids: np.ndarray, hashes, seen: set, counts: dict) -> tuple[np.ndarray, np.ndarray]:
    """A batch's documents without the empty ones and (``hashes`` given) the duplicates, counted."""
    keep = lens > 0
    counts["skipped_empty"] += int((~keep).sum())
    if hashes is not None:
        for i, h in enumerate(hashes):
            if keep[i] and h in seen:
                keep[i] = False
                counts["duplicates"] += 1
            seen.add(h)
    if keep.all():
        return lens, ids
    starts = np.concatenate([[0], np.cumsum(lens)])
    parts = [ids[starts[i] : starts[i + 1]] for i in np.flatnonzero(keep)]
    return lens[keep], (np.concatenate(parts) if parts else ids[:0])


def _encoded(batches, spec: str, tok: Tokenizer, workers: int, dedup: bool):
    """``(size, encoded batch)`` in the order of ``batches``: read here (so a bad record stops the
    reader at once), tokenised by ``workers`` processes with a bounded number in flight."""
    if workers <= 1:
        for texts, size in batches:
            yield size, _encode_batch(texts, tok, dedup)
        return
    ctx = mp.get_context("spawn")  # no fork of a process that may hold threads (torch, tokenizers)
    with ctx.Pool(workers, initializer=_init_worker, initargs=(spec,)) as pool:
        pending: deque = deque()
        for texts, size in batches:
            pending.append((size, pool.apply_async(_encode_batch, (texts, None, dedup))))
            while len(pending) > 2 * workers:
                size0, res = pending.popleft()
                yield size0, res.get()
        while pending:
            size0, res = pending.popleft()
            yield size0, res.get()


def _move_into_place(tmp: Path, out: Path) -> None:
    """``tmp`` becomes ``out`` by renames (an existing ``out`` is replaced only once ``tmp`` is complete)."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
