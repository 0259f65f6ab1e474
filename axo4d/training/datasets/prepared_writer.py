"""Writing a prepared folder (:mod:`axo4d.training.datasets.prepared` describes it and opens it):
:func:`write_prepared` tokenises a text source (:mod:`axo4d.training.datasets.sources`) in batches
of documents in worker processes, in order, with a progress line (:class:`Progress`); the folder
appears atomically (written beside it, then renamed) and an error leaves the destination untouched.
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
from pathlib import Path

import numpy as np

from axo4d.config.errors import DataError
from axo4d.training.datasets.prepared import FORMAT, separator_of
from axo4d.training.datasets.sources import named_documents, source_files
from axo4d.training.datasets.tokenizer import Tokenizer, load_tokenizer

_BATCH_BYTES = 4 << 20  # text per worker task

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


def check_out(out: Path, force: bool) -> None:
    """DataError unless ``out`` can become a prepared folder: it does not exist (or ``force``) and
    no existing folder above it is a file."""
    if out.exists() and not force:
        raise DataError(f"output {str(out)!r} already exists; choose another --out or pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise DataError(f"output {str(out)!r} is a file, not a folder; choose another --out")
    up = next((p for p in out.absolute().parents if p.exists()), None)
    if up is not None and not up.is_dir():
        raise DataError(
            f"output {str(out)!r} is under {str(up)!r}, which is a file, not a folder; choose another --out"
        )


def replaced_note(info: dict) -> str:
    """'' or a sentence: how many bytes of invalid UTF-8 the source held (replaced by U+FFFD)."""
    n = info.get("replaced_bytes") or 0
    if not n:
        return ""
    return (
        f"{n:,} bytes of invalid UTF-8 in {info.get('replaced_files', 0):,} file(s) replaced by U+FFFD "
        f"(first: {info.get('first_replaced')})"
    )


def _cut(lens: np.ndarray, ids: np.ndarray, room: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``room`` tokens of a batch (``ids``) and its document lengths cut to match (the
    last document kept shortened, empty ones dropped)."""
    c = np.cumsum(lens)
    k = int(np.searchsorted(c, room, side="left"))
    lens = np.append(lens[:k], room - (c[k - 1] if k else 0))
    return lens[lens > 0], ids[:room]


def _dataset_info(
    counts: dict, dtype: type, tok, source: str, n_files: int, text_field: str, max_tokens: int, dedup: bool
) -> dict:
    """``dataset.json`` of a prepared folder, but its ``seconds`` (:func:`write_prepared` adds them)."""
    return {
        "format": FORMAT,
        "tokens_file": f"tokens.{'u16' if dtype == np.uint16 else 'u32'}",
        "dtype": np.dtype(dtype).name,
        "documents": counts["documents"],
        "tokens": counts["tokens"],
        "skipped_empty": counts["skipped_empty"],
        "duplicates": counts["duplicates"] if dedup else None,
        "replaced_bytes": counts["replaced_bytes"],
        "replaced_files": counts.get("replaced_files", 0),
        "first_replaced": counts.get("first_replaced"),
        "separator": separator_of(tok),
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "source": source,
        "files": n_files,
        "text_field": text_field,
        "max_tokens": max_tokens,
    }


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
    equals an earlier one's is dropped (counted); bytes of invalid UTF-8 are replaced by U+FFFD
    (counted: ``replaced_bytes``, :func:`replaced_note`). ``max_tokens``: stop after this many (0 = all)."""
    out = Path(out)
    check_out(out, force)
    tok = load_tokenizer(tokenizer)
    root, files = source_files(source)
    total = sum(p.stat().st_size for p in files)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.time()
    counts = {"documents": 0, "tokens": 0, "skipped_empty": 0, "duplicates": 0, "read_bytes": 0, "replaced_bytes": 0}
    lengths: list[np.ndarray] = []
    seen: set[bytes] = set()
    try:
        with open(tmp / f"tokens.{'u16' if dtype == np.uint16 else 'u32'}", "wb") as f:
            batches = _text_batches(named_documents(files, text_field, root, counts))
            for size, (lens, ids, hashes) in _encoded(batches, tokenizer, tok, workers, dedup):
                counts["read_bytes"] += size
                lens, ids = _keep(lens, ids, hashes, seen, counts)
                if 0 < max_tokens < counts["tokens"] + len(ids):  # cut at max_tokens
                    lens, ids = _cut(lens, ids, max_tokens - counts["tokens"])
                ids.astype(dtype).tofile(f)
                lengths.append(lens)
                counts["documents"] += len(lens)
                counts["tokens"] += len(ids)
                if progress is not None:
                    progress(min(counts["read_bytes"], total), counts["documents"], counts["tokens"], False)
                if 0 < max_tokens <= counts["tokens"]:
                    break
        _check_not_empty(source, files, counts)
        off = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
        np.save(tmp / "documents.npy", off)
        info = _dataset_info(counts, dtype, tok, source, len(files), text_field, max_tokens, dedup)
        info["seconds"] = round(time.time() - t0, 3)
        (tmp / "dataset.json").write_text(json.dumps(info, indent=1) + "\n")
        if progress is not None:
            progress(total, counts["documents"], counts["tokens"], True)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _check_not_empty(source: str, files: list[Path], counts: dict) -> None:
    """Raise DataError when no document of ``source`` gave a token."""
    if counts["documents"] == 0:
        raise DataError(
            f"data source {source!r} gives 0 tokens ({len(files)} files, {counts['skipped_empty']} empty "
            f"documents): the dataset is empty"
        )


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
