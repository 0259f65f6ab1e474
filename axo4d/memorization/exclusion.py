"""Keeping the study's documents out of everything else the model sees, found by substring.

A *passage* of a study document is any run of ``w = study.suffix`` consecutive tokens of it
(``L - w + 1`` per document: its suffix, and every stretch of the same length before it). A copy
of a document shifted by one token, cut short by one, or split across two source files does not
repeat any aligned chunk, but it does repeat passages; so the study looks for passages, at every
offset:

* :class:`Passages` hashes every passage of the pool (a polynomial hash mod 2**64 of the token
  ids, computed for every window of a stream at once) and confirms each hash hit by comparing the
  tokens, so a hit is an exact occurrence and a collision can neither drop nor keep anything;
* :func:`choose_pool` takes the pool's documents in their content-hash order and skips a candidate
  that shares a passage with one already taken, so no study document's tokens are another's (a
  treated document cannot teach a control document's answer);
* :func:`exclude` drops every document of the *rest* (what pre-training reads, concatenated in
  file order) that holds a passage, or part of one that spans the junction of two consecutive
  documents, and scans the concatenation again until no passage is left in it; the occurrences
  found in the first scan say how many pre-training windows would have shown one
  (:func:`windows_containing`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplication by it is a bijection mod 2**64
_CHUNK = 1 << 22  # tokens hashed at a time


def _hash_chunks(stream: np.ndarray, w: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(a, hashes of the windows starting at a, a + 1, ...)``, a chunk of windows at a time."""
    n = len(stream) - w + 1
    for a in range(0, max(0, n), _CHUNK):
        b = min(n, a + _CHUNK)
        part = np.asarray(stream[a : b + w - 1]).astype(np.uint64) + np.uint64(1)  # (b - a + w - 1,)
        h = np.zeros(b - a, np.uint64)
        for j in range(w):  # Horner over the window: sum_j t[i + j] * BASE**(w - 1 - j) mod 2**64
            h = h * _BASE + part[j : j + b - a]
        yield a, h


def window_hashes(stream: np.ndarray, w: int) -> np.ndarray:
    """``(len(stream) - w + 1,)`` uint64: the hash of ``stream[i : i + w]`` at every ``i``
    (empty when the stream is shorter than ``w``)."""
    parts = [h for _, h in _hash_chunks(stream, w)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint64)


class Passages:
    """Every passage (``w`` consecutive tokens) of some documents; :meth:`find` locates them."""

    def __init__(self, w: int) -> None:
        self.w = w
        self.by_hash: dict[int, list[tuple[int, np.ndarray]]] = {}

    def add(self, doc_id: int, doc: np.ndarray) -> None:
        for i, h in enumerate(window_hashes(doc, self.w).tolist()):
            self.by_hash.setdefault(h, []).append((doc_id, doc[i : i + self.w]))

    def owners(self, piece: np.ndarray, h: int) -> set[int]:
        """Documents one of whose passages is exactly ``piece`` (whose hash is ``h``)."""
        return {d for d, p in self.by_hash.get(h, ()) if np.array_equal(p, piece)}

    def shared_with(self, doc: np.ndarray) -> set[int]:
        """Documents that share a passage with ``doc``."""
        out: set[int] = set()
        for i, h in enumerate(window_hashes(doc, self.w).tolist()):
            if h in self.by_hash:
                out |= self.owners(doc[i : i + self.w], h)
        return out

    def find(self, stream: np.ndarray) -> np.ndarray:
        """Start offsets of every occurrence of a passage in ``stream``, ascending: ``(hits,)`` int64."""
        if not self.by_hash or len(stream) < self.w:
            return np.zeros(0, np.int64)
        keys = np.fromiter(self.by_hash, np.uint64, len(self.by_hash))
        hits = []
        for a, hashes in _hash_chunks(stream, self.w):
            for i in np.flatnonzero(np.isin(hashes, keys)).tolist():
                if self.owners(np.asarray(stream[a + i : a + i + self.w]), int(hashes[i])):
                    hits.append(a + i)
        return np.asarray(hits, np.int64)


def choose_pool(docs: list[np.ndarray], order: list[int], size: int, w: int) -> tuple[list[int], int, Passages]:
    """The first ``size`` documents of ``order`` that share no passage with an earlier chosen one:
    ``(chosen ids, candidates skipped, the chosen documents' passages)``; fewer than ``size`` when
    ``order`` runs out."""
    passages, chosen, skipped = Passages(w), [], 0
    for i in order:
        if len(chosen) == size:
            break
        if passages.shared_with(docs[i]):
            skipped += 1
            continue
        passages.add(i, docs[i])
        chosen.append(i)
    return chosen, skipped, passages


@dataclass
class Exclusion:
    """What :func:`exclude` dropped from the rest."""

    kept: list[int]
    """Indices (into the rest's documents) that pre-training reads, in order."""
    occurrences: int
    """Passages found in the rest as it was (first scan)."""
    inside: int
    """Documents dropped because they hold a whole passage."""
    junction: int
    """Documents dropped because a passage spans their junction with a neighbour (any scan)."""
    tokens: int
    """Tokens of the dropped documents."""
    hits: np.ndarray
    """First scan: the start offset of every occurrence in the rest as it was."""
    length: int
    """Tokens of the rest as it was."""
    w: int
    """Tokens of a passage."""


def _concat(docs: list[np.ndarray], keep: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The kept documents concatenated, and the end offset of each."""
    parts = [docs[i] for i in keep]
    ends = np.cumsum([len(p) for p in parts]) if parts else np.zeros(0, np.int64)
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), ends


def exclude(rest: list[np.ndarray], passages: Passages) -> Exclusion:
    """Drop every document of ``rest`` that holds a passage or part of one across a junction
    (module docstring), until the concatenation of the kept documents holds none."""
    keep, inside, junction, first = list(range(len(rest))), 0, 0, None
    while True:
        stream, ends = _concat(rest, keep)
        hits = passages.find(stream)
        first = hits if first is None else first
        if not len(hits):
            break
        whole, spans = set(), set()
        for p in hits.tolist():
            a, b = (int(np.searchsorted(ends, q, "right")) for q in (p, p + passages.w - 1))
            (whole if a == b else spans).update(keep[j] for j in range(a, b + 1))
        inside, junction = inside + len(whole), junction + len(spans - whole)
        keep = [i for i in keep if i not in whole | spans]
    length = sum(len(d) for d in rest)
    dropped = length - sum(len(rest[i]) for i in keep)
    return Exclusion(keep, len(first), inside, junction, dropped, first, length, passages.w)


def windows_containing(hits: np.ndarray, length: int, w: int, span: int) -> tuple[int, int]:
    """``(windows that contain an occurrence, all windows)`` among the ``length - span + 1`` windows
    of ``span`` tokens of a stream of ``length`` whose passages (``w`` tokens) start at ``hits``."""
    total = max(0, length - span + 1)
    if total == 0 or not len(hits):
        return 0, total
    lo = np.clip(hits + w - span, 0, total)  # window o contains [p, p + w) iff p + w - span <= o <= p
    hi = np.clip(hits + 1, 0, total)  # exclusive
    covered, end = 0, 0
    for a, b in zip(lo.tolist(), hi.tolist()):  # hits ascending: so are lo and hi
        a = max(a, end)
        if b > a:
            covered += b - a
            end = b
    return covered, total
