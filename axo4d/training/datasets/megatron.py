"""Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) read and written, memory-mapped.

The format (what ``megatron-core``'s ``IndexedDatasetBuilder`` writes; the reader here is our own):

* ``PREFIX.bin``: every sequence's tokens, end to end, in the index's dtype.
* ``PREFIX.idx``, little-endian: the 9-byte magic ``MMIDIDX\\0\\0``; the version (uint64, 1); the
  dtype code (uint8, :data:`DTYPE_CODES`); the sequence count ``S`` and the document count ``D``
  (uint64 each; ``D`` counts the entries of the document index, one more than the documents);
  then ``S`` int32 sequence lengths (tokens), ``S`` int64 sequence pointers (byte offsets into the
  ``.bin``), ``D`` int64 document indices (document ``i`` is sequences ``doc[i]..doc[i+1]-1``;
  ``doc[0] = 0``, ``doc[-1] = S``), and, in a multimodal index only, ``S`` int8 sequence modes.

A document here is the concatenation of its sequences' tokens (``preprocess_data.py`` without
sentence splitting writes one sequence per document). Packing puts no separator between the
documents of a Megatron dataset: Megatron's own convention is that the end-of-document token is
part of each document (``preprocess_data.py --append-eod``), and :func:`write_megatron` writes it so.

:func:`open_megatron` checks the index against itself and the ``.bin`` (header, version, dtype
code, file sizes, pointers, document index; a mismatch is one line naming the file) and returns
:class:`~axo4d.training.datasets.prepared.Documents`: the ``.bin`` memory-mapped, the documents'
token offsets computed in chunks into an unlinked temporary file and memory-mapped, so resident
memory does not grow with the dataset.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from axo4d.config.errors import DataError
from axo4d.training.datasets.prepared import _CHUNK, Documents, _scan, check_vocab, separator_of
from axo4d.training.datasets.prepared_writer import (
    _check_not_empty,
    _cut,
    _encoded,
    _keep,
    _move_into_place,
    _text_batches,
)
from axo4d.training.datasets.sources import named_documents, source_files
from axo4d.training.datasets.tokenizer import load_tokenizer

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
#: megatron-core's dtype codes (its ``DType`` enum)
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, S, D
DEFAULT_PREFIX = "text_document"


@dataclass(frozen=True)
class MegatronIndex:
    """A checked ``.idx`` header with its arrays memory-mapped."""

    path: Path
    dtype: np.dtype
    lengths: np.ndarray
    """``(S,)`` int32 tokens per sequence."""
    pointers: np.ndarray
    """``(S,)`` int64 byte offset of each sequence in the ``.bin``."""
    doc_index: np.ndarray
    """``(D,)`` int64: document ``i`` is sequences ``doc_index[i]..doc_index[i+1]-1``."""

    @property
    def n_sequences(self) -> int:
        return len(self.lengths)

    @property
    def n_documents(self) -> int:
        return len(self.doc_index) - 1


def megatron_prefix(source: str | Path) -> Path | None:
    """The prefix of the Megatron dataset ``source`` names -- ``PREFIX`` or ``PREFIX.bin`` or
    ``PREFIX.idx`` with both files present, or a folder holding just one such pair -- else None."""
    p = Path(source).expanduser()
    for prefix in ((p.with_suffix(""),) if p.suffix in (".bin", ".idx") else ()) + (p,):
        if Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file():
            return prefix
    lone = {p.with_suffix(".bin"): p} if p.suffix == ".idx" and p.is_file() else {}
    if not p.exists():  # a prefix with one of its two files
        lone.update({Path(f"{p}.idx"): Path(f"{p}.bin"), Path(f"{p}.bin"): Path(f"{p}.idx")})
    for missing, present in lone.items():
        if present.is_file():
            raise DataError(
                f"Megatron dataset {str(present)!r} has no {str(missing)!r}: a dataset is PREFIX.bin + PREFIX.idx"
            )
    if p.is_dir():
        entries = sorted(e for e in os.listdir(p) if not e.startswith("."))
        if len(entries) == 2 and entries[0].endswith(".bin") and entries[1] == entries[0][:-4] + ".idx":
            return p / entries[0][:-4]
    return None


def read_index(path: Path) -> MegatronIndex:
    """The header of the ``.idx`` file ``path`` checked (magic, version, dtype code, size) and its
    arrays memory-mapped; a mismatch is a :class:`DataError` naming the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise DataError(f"cannot read Megatron index {str(path)!r}: {e.strerror}") from None
    where = f"Megatron index {str(path)!r}"
    if len(head) < HEADER_BYTES:
        raise DataError(f"{where} is truncated: {size} bytes, shorter than its {HEADER_BYTES}-byte header")
    if head[:9] != MAGIC:
        raise DataError(f"{where} does not start with the magic {MAGIC!r} (found {head[:9]!r}): not a Megatron index")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != VERSION:
        raise DataError(f"{where} has version {version}; readable: {VERSION}")
    if code not in DTYPE_CODES:
        valid = ", ".join(f"{c} ({d.name})" for c, d in DTYPE_CODES.items())
        raise DataError(f"{where} has dtype code {code}; valid codes: {valid}")
    expect = HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
    if size == expect + n_seq and n_seq:
        raise DataError(f"{where} holds sequence modes (a multimodal dataset); axo4d reads text datasets only")
    if size != expect:
        raise DataError(
            f"{where} has {size} bytes; its header ({n_seq} sequences, {n_doc} document index entries) "
            f"needs {expect}: the file is truncated or corrupt"
        )
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    lengths = mm[HEADER_BYTES : HEADER_BYTES + 4 * n_seq].view(np.int32)
    pointers = mm[HEADER_BYTES + 4 * n_seq : HEADER_BYTES + 12 * n_seq].view(np.int64)
    doc_index = mm[HEADER_BYTES + 12 * n_seq : expect].view(np.int64)
    return MegatronIndex(path, DTYPE_CODES[code], lengths, pointers, doc_index)


def _document_offsets(ix: MegatronIndex, bin_path: Path) -> np.ndarray:
    """Token offsets ``(n_documents + 1,)`` int64 of the documents, checking the index in chunks
    against itself and the ``.bin``; memory-mapped from an unlinked temporary file."""

    def bad(what: str) -> DataError:
        return DataError(f"Megatron index {str(ix.path)!r} does not match its data {str(bin_path)!r}: {what}")

    item, n_seq = ix.dtype.itemsize, ix.n_sequences
    total = 0
    for s in range(0, n_seq, _CHUNK):
        lens = np.asarray(ix.lengths[s : s + _CHUNK], np.int64)
        ptr = np.asarray(ix.pointers[s : s + _CHUNK])
        if (lens < 0).any():
            raise bad(f"sequence {s + int(np.argmax(lens < 0))} has a negative length")
        expect = total * item + np.concatenate([[0], np.cumsum(lens[:-1])]) * item
        if (ptr != expect).any():
            i = int(np.argmax(ptr != expect))
            raise bad(
                f"sequence {s + i} starts at byte {int(ptr[i])}, not at byte {int(expect[i])} where "
                + (
                    f"sequence {s + i - 1} ({int(ix.lengths[s + i - 1])} {ix.dtype.name} tokens) ends"
                    if s + i
                    else "the file begins"
                )
            )
        total += int(lens.sum())
    size = bin_path.stat().st_size
    if size != total * item:
        raise bad(f"the index's {total} {ix.dtype.name} tokens are {total * item} bytes, the file has {size}")
    d = ix.doc_index
    if len(d) == 0 or int(d[0]) != 0 or int(d[-1]) != n_seq:
        first, last = (int(d[0]), int(d[-1])) if len(d) else (None, None)
        raise bad(f"the document index runs from {first} to {last}, not from 0 to the {n_seq} sequences")
    f = tempfile.TemporaryFile(prefix="axo4d-megatron-offsets-")
    for s in range(0, len(d), _CHUNK):
        seq = np.asarray(d[s : s + _CHUNK + 1])
        if (np.diff(seq) < 0).any():
            raise bad(f"the document index decreases at document {s + int(np.argmax(np.diff(seq) < 0))}")
        seq = seq[:_CHUNK]
        inside = seq < n_seq
        off = np.full(len(seq), total, np.int64)
        off[inside] = np.asarray(ix.pointers[seq[inside]]) // item
        f.write(off.tobytes())
    f.flush()
    return np.memmap(f, dtype=np.int64, mode="r", shape=(len(d),))


def _check_floats(tokens: np.ndarray, where: Path) -> None:
    """Float tokens (dtype codes 6, 7) must hold whole numbers to be token ids."""
    for c in _scan(tokens):
        if len(c) and (c != np.floor(c)).any():
            bad = c[c != np.floor(c)][0]
            raise DataError(f"Megatron data {str(where)!r} holds {tokens.dtype} token {bad}, not a whole number")


def open_megatron(prefix: Path, vocab_size: int | None = None) -> Documents:
    """The Megatron dataset ``prefix`` as :class:`Documents` (module docstring). Token ids outside
    ``0..vocab_size-1`` (when given) are a :class:`DataError`."""
    ix = read_index(Path(f"{prefix}.idx"))
    bin_path = Path(f"{prefix}.bin")
    offsets = _document_offsets(ix, bin_path)
    if ix.n_documents == 0:
        raise DataError(f"Megatron dataset {str(prefix)!r} holds 0 documents: the dataset is empty")
    n = int(offsets[-1])
    tokens = np.memmap(bin_path, dtype=ix.dtype, mode="r", shape=(n,)) if n else np.zeros(0, ix.dtype)
    if ix.dtype.kind == "f":
        _check_floats(tokens, bin_path)
    if vocab_size is not None:
        check_vocab(tokens, vocab_size, bin_path)
    st = ix.path.stat()
    info = {
        "format": "megatron",
        "index": [str(ix.path.resolve()), st.st_size, st.st_mtime_ns],  # (keys the cached stream index)
        "dtype": ix.dtype.name,
        "documents": ix.n_documents,
        "sequences": ix.n_sequences,
        "tokens": n,
    }
    return Documents(tokens, offsets, np.zeros(0, np.int64), str(prefix), info)


# ---- writing ---------------------------------------------------------------------------------
def write_index(path: Path, dtype: np.dtype, lengths: np.ndarray) -> None:
    """A version-1 ``.idx`` of one sequence per document with ``lengths`` tokens each."""
    code = {d: c for c, d in DTYPE_CODES.items()}[np.dtype(dtype)]
    lengths = np.asarray(lengths, np.int64)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64) * np.dtype(dtype).itemsize
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", VERSION, code, len(lengths), len(lengths) + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers[: len(lengths)].tobytes())
        f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())


def _with_separator(lens: np.ndarray, ids: np.ndarray, sep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each document of a batch followed by ``sep``: ``(lengths, tokens)``."""
    if not len(sep) or not len(lens):
        return lens, ids
    starts = np.concatenate([[0], np.cumsum(lens)])
    parts = [p for i in range(len(lens)) for p in (ids[starts[i] : starts[i + 1]], sep)]
    return lens + len(sep), np.concatenate(parts)


def _megatron_info(counts: dict, prefix: Path, dtype: np.dtype, tok, n_sep: int, dedup: bool) -> dict:
    """What :func:`write_megatron` returns, but its ``seconds``: the counts, ``tokens`` with the
    ``n_sep`` end-of-text tokens of every document."""
    return {
        "format": "megatron",
        "prefix": str(prefix),
        "dtype": dtype.name,
        "documents": counts["documents"],
        "tokens": counts["tokens"] + counts["documents"] * n_sep,
        "skipped_empty": counts["skipped_empty"],
        "duplicates": counts["duplicates"] if dedup else None,
        "replaced_bytes": counts["replaced_bytes"],
        "replaced_files": counts.get("replaced_files", 0),
        "first_replaced": counts.get("first_replaced"),
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
    }


def _write_tokens(
    f: BinaryIO,
    encoded: Iterable[tuple],
    sep: np.ndarray,
    dtype: np.dtype,
    max_tokens: int,
    total: int,
    counts: dict,
    lengths: list[np.ndarray],
    progress: Callable[[int, int, int, bool], None] | None,
) -> None:
    """Write the encoded batches' documents, each ending in ``sep``, to ``f``, counting them in ``counts``."""
    seen: set[bytes] = set()
    for size, (lens, ids, hashes) in encoded:
        counts["read_bytes"] += size
        lens, ids = _keep(lens, ids, hashes, seen, counts)
        if 0 < max_tokens < counts["tokens"] + len(ids):
            lens, ids = _cut(lens, ids, max_tokens - counts["tokens"])
        counts["tokens"] += len(ids)
        lens, ids = _with_separator(lens, ids, sep)
        ids.astype(dtype).tofile(f)
        lengths.append(lens)
        counts["documents"] += len(lens)
        if progress is not None:
            progress(min(counts["read_bytes"], total), counts["documents"], counts["tokens"], False)
        if 0 < max_tokens <= counts["tokens"]:
            break


def write_megatron(
    source: str,
    tokenizer: str,
    out: Path,
    *,
    prefix: str = DEFAULT_PREFIX,
    text_field: str = "text",
    workers: int = 1,
    dedup: bool = False,
    max_tokens: int = 0,
    force: bool = False,
    progress: Callable[[int, int, int, bool], None] | None = None,
) -> dict:
    """Tokenise ``source`` into ``out/PREFIX.bin`` + ``out/PREFIX.idx``: one sequence per document,
    each ending in the tokenizer's end-of-text token (else the tokens of "\\n\\n"), as Megatron's
    ``preprocess_data.py --append-eod`` writes; uint16 tokens for vocabularies up to 65,536, else
    int32 (Megatron's choice). Empty documents are skipped, ``dedup`` and ``max_tokens`` (tokens
    before the end-of-text tokens) as :func:`~axo4d.training.datasets.prepared.write_prepared`.
    ``out`` appears whole or not at all. Returns the counts."""
    out = Path(out)
    if out.exists() and not force:
        raise DataError(f"output {str(out)!r} already exists; choose another --out or pass --force to replace it")
    tok = load_tokenizer(tokenizer)
    root, files = source_files(source)
    total = sum(p.stat().st_size for p in files)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.int32)
    sep = np.asarray(separator_of(tok), np.int64)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.time()
    counts = {"documents": 0, "tokens": 0, "skipped_empty": 0, "duplicates": 0, "read_bytes": 0, "replaced_bytes": 0}
    lengths: list[np.ndarray] = []
    try:
        with open(tmp / f"{prefix}.bin", "wb") as f:
            batches = _text_batches(named_documents(files, text_field, root, counts))
            encoded = _encoded(batches, tokenizer, tok, workers, dedup)
            _write_tokens(f, encoded, sep, dtype, max_tokens, total, counts, lengths, progress)
        _check_not_empty(source, files, counts)
        write_index(tmp / f"{prefix}.idx", dtype, np.concatenate(lengths))
        if progress is not None:
            progress(total, counts["documents"], counts["tokens"], True)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info = _megatron_info(counts, out / prefix, dtype, tok, len(sep), dedup)
    info["seconds"] = round(time.time() - t0, 3)
    return info
