"""Prepared datasets: a memory-mapped token file and a document index, written once, opened cheaply.

A prepared folder holds::

    tokens.u16 | tokens.u32   every document's tokens, end to end (uint32 for vocabularies > 65536)
    documents.npy             int64 offsets (documents + 1,): document i is tokens[off[i]:off[i+1]]
    dataset.json              format, counts, the tokenizer, the separator packing puts after each
                              document (its end-of-text token, else the tokens of "\\n\\n"), the source

:func:`axo4d.training.datasets.prepared_writer.write_prepared` makes one from a text source.
:func:`open_documents` opens a prepared folder, or a bare token file as one document, as
:class:`Documents`: memory maps, checked against each other, nothing read into memory but the
metadata.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from axo4d.config.errors import DataError
from axo4d.training.datasets.sources import TOKEN_SUFFIXES
from axo4d.training.datasets.tokenizer import Tokenizer

FORMAT = "axo4d-tokens/1"
DOC_SEP = "\n\n"
"""Text placed between documents when the tokenizer has no end-of-text token."""
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
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
