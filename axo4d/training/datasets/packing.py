"""Samples: fixed-length training sequences, packed from documents or given as rows.

:class:`PackedSamples` lays a set of documents end to end, each followed by its dataset's
separator (the end-of-text token), as one *stream*, and cuts the stream into samples of
``seq_len + 1`` tokens with stride ``seq_len``: sample ``j`` is ``stream[j*T : j*T + T + 1]``, its
input the first ``T``, its targets the last ``T``. Every token of the stream but the opening one is
a target of exactly one sample, so every document token is trained exactly once per epoch; a
document longer than what is left of a sample continues in the next; the last sample is padded,
its padding masked out of the loss.

:func:`split_documents` holds documents out for validation: a fixed pseudo-random set of
``round(val_fraction * n)`` documents, chosen by a hash of the document index that does not
depend on the training seed or the grid. A source with too few documents for that (one text
file, one token file) holds out the tail ``val_fraction`` of its stream instead.

Each sample set reads samples by index as ``(tokens (n, T+1) int64, documents (n, T+1) int32,
valid (n, T) bool)``: the document of every token, numbered from 0 inside the sample (a padding
token gets a number of its own), and which targets count. A sample index of -1 is an empty
sample (all padding). Memory: the stream's index (:func:`stream_index`, 16 bytes per document)
is memory-mapped from the cache for a prepared folder, so nothing but the pages a sample touches
is resident; tokens are read with ``pread``.
"""

from __future__ import annotations

import numpy as np

from axo4d.config.errors import DataError
from axo4d.training.datasets.order import hash64, key_of
from axo4d.training.datasets.prepared import Documents

#: the key of the hash that picks held-out documents (fixed: the same validation set for any seed)
SPLIT_KEY = key_of(0x5A11D)


def held_out_count(n_docs: int, val_fraction: float) -> int | None:
    """Documents held out of ``n_docs``: ``round(val_fraction * n_docs)``, or None when that is 0 or
    all of them (the source holds out the tail of its stream instead)."""
    n_val = int(round(val_fraction * n_docs))
    return n_val if 1 <= n_val < n_docs else None


def split_documents(n_docs: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray] | None:
    """``(train ids, val ids)`` (sorted int64) holding out :func:`held_out_count` documents, or None."""
    n_val = held_out_count(n_docs, val_fraction)
    if n_val is None:
        return None
    h = hash64(np.arange(n_docs, dtype=np.int64), SPLIT_KEY)
    val = np.sort(np.argpartition(h, n_val - 1)[:n_val]).astype(np.int64)
    is_val = np.zeros(n_docs, bool)
    is_val[val] = True
    return np.flatnonzero(~is_val).astype(np.int64), val


def stream_index(docs: Documents, ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, starts)`` of the stream of documents ``ids`` of ``docs`` (all when None): entry 0 is an
    empty document (id -1) -- the stream opens with a separator, so that every document token, the
    first one's too, is some sample's target after an end-of-text token -- and ``starts`` (n + 2,)
    the stream position of each entry, then the stream's length (int64)."""
    off = docs.offsets
    if ids is None:
        lengths = np.diff(np.asarray(off))
        ids = np.arange(len(docs), dtype=np.int64)
    else:
        ids = np.asarray(ids, np.int64)
        lengths = np.asarray(off[1:])[ids] - np.asarray(off[:-1])[ids]
    full = np.concatenate([[-1], ids]).astype(np.int64)
    starts = np.concatenate([[0, len(docs.separator)], np.cumsum(lengths + len(docs.separator))])
    starts[2:] += len(docs.separator)
    return full, starts.astype(np.int64)


class PackedSamples:
    """Samples cut from the stream of documents ``ids`` of ``docs`` (all when None; or a
    precomputed :func:`stream_index` ``index``, e.g. memory-mapped), restricted to stream positions
    ``[lo, hi)`` (module docstring)."""

    def __init__(
        self,
        docs: Documents,
        seq_len: int,
        ids: np.ndarray | None = None,
        lo: int = 0,
        hi: int | None = None,
        index: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len={seq_len} must be >= 1")
        self.docs, self.seq_len, self.sep = docs, seq_len, docs.separator
        self.ids, self.starts = index if index is not None else stream_index(docs, ids)
        self.lo, self.hi = int(lo), int(self.starts[-1] if hi is None else hi)
        self.n_tokens = self.hi - self.lo
        self.n_samples = max(0, -(-(self.n_tokens - 1) // seq_len))  # every sample has >= 1 target
        self.name = docs.name

    def __len__(self) -> int:
        return self.n_samples

    @property
    def n_documents(self) -> int:
        return len(self.ids) - 1

    def targets(self, idx: np.ndarray) -> int:
        """Targets that count in samples ``idx``."""
        idx = np.asarray(idx, np.int64)
        left = self.n_tokens - 1 - idx[idx >= 0] * self.seq_len
        return int(np.clip(left, 0, self.seq_len).sum())

    def read(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        idx = np.asarray(idx, np.int64)
        t = self.seq_len
        tokens = np.zeros((len(idx), t + 1), np.int64)
        documents = np.zeros((len(idx), t + 1), np.int32)
        valid = np.zeros((len(idx), t), bool)
        for r, j in enumerate(idx):
            if j < 0:
                continue
            if j >= self.n_samples:
                raise DataError(f"sample {j} of {self.name!r} outside 0..{self.n_samples - 1}")
            tokens[r], documents[r], valid[r] = self._sample(int(j))
        return tokens, documents, valid

    def _sample(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        t, st = self.seq_len, self.starts
        p0 = self.lo + j * t
        p1 = p0 + min(t + 1, self.hi - p0)  # the stream positions of this sample's real tokens
        out = np.zeros(t + 1, np.int64)
        docs = np.zeros(t + 1, np.int32)
        k = int(np.searchsorted(st, p0, side="right")) - 1  # the stream document holding p0
        pos, label = p0, 0
        while pos < p1:
            s, doc_end = int(st[k]), int(st[k + 1]) - len(self.sep)  # its tokens, then the separator
            first = pos
            if pos < doc_end:
                b = min(doc_end, p1)
                out[pos - p0 : b - p0] = self.docs.read(int(self.docs.offsets[self.ids[k]]) + pos - s, b - pos)
                pos = b
            b = min(int(st[k + 1]), p1)
            if pos < b:
                out[pos - p0 : b - p0] = self.sep[pos - doc_end : b - doc_end]
                pos = b
            if pos > first:
                docs[first - p0 : pos - p0] = label
                label += 1
            k += 1
        docs[p1 - p0 :] = label  # padding: a document of its own
        valid = np.arange(t) < p1 - p0 - 1
        return out, docs, valid


class RowSamples:
    """Samples given as rows of ``seq_len + 1`` tokens (one document each): the study's documents."""

    def __init__(self, rows: np.ndarray, name: str = "rows") -> None:
        self.rows, self.name = np.asarray(rows), name
        self.seq_len = self.rows.shape[1] - 1
        self.n_samples = len(self.rows)
        self.n_tokens = int(self.rows.size)

    def __len__(self) -> int:
        return self.n_samples

    def targets(self, idx: np.ndarray) -> int:
        return int((np.asarray(idx) >= 0).sum()) * self.seq_len

    def read(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        idx = np.asarray(idx, np.int64)
        tokens = np.zeros((len(idx), self.seq_len + 1), np.int64)
        real = idx >= 0
        tokens[real] = self.rows[idx[real]]
        valid = np.repeat(real[:, None], self.seq_len, axis=1)
        return tokens, np.zeros(tokens.shape, np.int32), valid


class ConcatSamples:
    """Several sample sets of one ``seq_len`` as one: global index ``offset_i + j`` is sample ``j``
    of part ``i`` (a mixture's sources, or their validation sets)."""

    def __init__(self, parts: list) -> None:
        if len({p.seq_len for p in parts}) != 1:
            raise ValueError("sample sets of different seq_len")
        self.parts, self.seq_len = parts, parts[0].seq_len
        self.offsets = np.concatenate([[0], np.cumsum([p.n_samples for p in parts])]).astype(np.int64)
        self.n_samples = int(self.offsets[-1])
        self.n_tokens = sum(p.n_tokens for p in parts)
        self.name = " + ".join(p.name for p in parts)

    def __len__(self) -> int:
        return self.n_samples

    def _where(self, idx: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, idx, side="right") - 1

    def targets(self, idx: np.ndarray) -> int:
        idx = np.asarray(idx, np.int64)
        part = self._where(idx)
        return sum(p.targets(idx[(part == i) & (idx >= 0)] - self.offsets[i]) for i, p in enumerate(self.parts))

    def read(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        idx = np.asarray(idx, np.int64)
        t = self.seq_len
        tokens = np.zeros((len(idx), t + 1), np.int64)
        documents = np.zeros((len(idx), t + 1), np.int32)
        valid = np.zeros((len(idx), t), bool)
        part = self._where(idx)
        for i, p in enumerate(self.parts):
            sel = (part == i) & (idx >= 0)
            if sel.any():
                tokens[sel], documents[sel], valid[sel] = p.read(idx[sel] - self.offsets[i])
        return tokens, documents, valid
