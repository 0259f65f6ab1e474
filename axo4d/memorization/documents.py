"""The study's documents: read, cut to ``prefix + suffix`` tokens, the pool drawn and kept apart
from everything else the model sees, and assigned to buckets.

* **Reading.** The source is ``data.source`` (``stdlib``, a folder, a text file or a ``.jsonl`` with
  ``data.text_field``): a text file is one source document, a JSONL line is one. At most
  ``data.max_tokens`` tokens are read (0 = all), files in sorted order. Each document is tokenised
  on its own, framed as the tokenizer frames a prompt (a Llama tokenizer's begin-of-text first).
* **Cutting.** With ``study.split`` a source document gives consecutive documents of exactly
  ``L = prefix + suffix`` tokens (the tail shorter than ``L`` is left out); without, it gives its
  first ``L`` tokens. A source document shorter than ``L`` is skipped and counted.
* **The pool.** Usable documents are ordered by a hash of their tokens (a content order that
  does not depend on file order); the pool is the first ``(buckets + 1) * bucket_size`` of them
  that share no *passage* (``suffix`` consecutive tokens, at any offset;
  :mod:`axo4d.memorization.exclusion`) with a document taken before, so that no document's answer
  is in another's tokens (a candidate that does is skipped and counted).
* **The rest** (what ``study.pretrain_steps`` trains on): every other usable document, in file
  order, concatenated, de-duplicated (a document whose last ``suffix`` tokens equal an earlier
  document's is dropped and counted: repeated boilerplate is not pre-trained on many times), except
  each one that holds a passage of a pool document or part of one across its junction with the
  next (dropped and counted): no study document's suffix, nor any
  other stretch of ``suffix`` of its tokens, is seen outside its bucket's treatment.
* **Buckets.** Seed ``s`` permutes the pool (``numpy.random.default_rng([s, 1])``): buckets
  ``treated-1 .. treated-B`` take consecutive runs of ``bucket_size`` and the last run is the
  ``control``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from axo4d.config import DataConfig
from axo4d.config.errors import DataError
from axo4d.memorization.exclusion import Exclusion, choose_pool, exclude, windows_containing
from axo4d.memorization.study_config import StudyConfig
from axo4d.training.datasets.dataset import Dataset, named_documents, source_files
from axo4d.training.datasets.order import EpochOrder
from axo4d.training.datasets.packing import RowSamples
from axo4d.training.datasets.tokenizer import Tokenizer

CONTROL = "control"


@dataclass
class Corpus:
    """The pool of study documents and the rest of the usable corpus."""

    tokens: np.ndarray
    """``(M, L)`` int64: the pool's documents, in content-hash order (document id = row)."""
    sources: list[str]
    """Where each pool document comes from: ``file#chunk`` or ``file:line``."""
    rest: np.ndarray
    """The usable documents outside the pool that hold no passage of it, concatenated (uint16, or
    uint32 for vocabularies over 65536), for pre-training."""
    counts: dict = field(default_factory=dict)
    """source documents read, tokens read, documents skipped as shorter than L, usable documents,
    pool candidates skipped, and what the exclusion dropped from the rest (:func:`read_corpus`)."""
    exclusion: Exclusion | None = None
    """The exclusion's record (None when the rest was not kept)."""

    def windows_dropped(self, span: int) -> tuple[int, int]:
        """``(windows of span tokens of the rest as it was that showed a passage, all of them)``:
        the pre-training windows (``span = seq_len + 1``) the exclusion took away."""
        ex = self.exclusion
        return (0, 0) if ex is None else windows_containing(ex.hits, ex.length, ex.w, span)


def _source_documents(cfg: DataConfig) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of every source document, files in sorted order."""
    root, files = source_files(cfg.source)
    return named_documents(files, cfg.text_field, root)


def _encode(tok: Tokenizer, text: str) -> np.ndarray:
    ids = np.asarray(tok.encode_docs([text]), dtype=np.int64)
    if tok.bos_id is not None:
        ids = np.concatenate([[tok.bos_id], ids])
    return ids


def _cut(cfg: DataConfig, tok: Tokenizer, length: int, split: bool, counts: dict) -> tuple[list, list]:
    """Every usable document (``L`` tokens) and its name, in file order."""
    docs, names = [], []
    for name, text in _source_documents(cfg):
        ids = _encode(tok, text)
        counts["source_documents"] += 1
        counts["tokens_read"] += len(ids)
        if len(ids) < length:
            counts["skipped_short"] += 1
        else:
            for i in range(len(ids) // length) if split else range(1):
                docs.append(ids[i * length : (i + 1) * length])
                names.append(f"{name}#{i}" if split else name)
        if 0 < cfg.max_tokens <= counts["tokens_read"]:
            break
    return docs, names


def read_corpus(cfg: DataConfig, tok: Tokenizer, study: StudyConfig, keep_rest: bool = True) -> Corpus:
    """Read, cut, draw the pool and keep it out of the rest (module docstring; ``keep_rest=False``:
    the rest is left empty); :class:`DataError` when too few documents for the pool."""
    length = study.length
    split = study.split == "yes" or (study.split == "auto" and cfg.source == "stdlib")
    pool_size = (study.buckets + 1) * study.bucket_size
    counts = {"source_documents": 0, "tokens_read": 0, "skipped_short": 0, "usable": 0}
    docs, names = _cut(cfg, tok, length, split, counts)
    counts["usable"] = len(docs)
    order = sorted(range(len(docs)), key=lambda i: hashlib.sha256(docs[i].tobytes()).digest())
    chosen, skipped, passages = choose_pool(docs, order, pool_size, study.suffix)
    counts["pool_skipped"] = skipped
    if len(chosen) < pool_size:
        raise DataError(
            f"too few documents: {len(docs)} usable documents of prefix+suffix={length} tokens in data.source="
            f"{cfg.source!r} ({counts['source_documents']} read, {counts['skipped_short']} shorter than {length} "
            f"skipped), {len(chosen)} of them sharing no {study.suffix}-token passage, for {study.buckets} treated "
            f"bucket(s) + 1 control of study.bucket_size={study.bucket_size} = {pool_size}; use fewer or smaller "
            f"buckets or more data (data.max_tokens, data.source)"
        )
    taken = set(chosen)
    rest_docs, seen = [], set()
    for i, d in enumerate(docs):  # the rest de-duplicated: a document whose suffix an earlier one has is dropped
        key = d[-study.suffix :].tobytes()
        if i not in taken and key not in seen:
            rest_docs.append(d)
        seen.add(key)
    counts["duplicates"] = len(docs) - len(taken) - len(rest_docs)
    small = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32  # the rest can be large: compact ids
    ex, rest = None, np.zeros(0, small)
    if keep_rest:
        ex = exclude(rest_docs, passages)
        counts.update(
            rest_documents=len(rest_docs),
            rest_tokens=ex.length,
            occurrences=ex.occurrences,
            dropped_inside=ex.inside,
            dropped_junction=ex.junction,
            dropped_tokens=ex.tokens,
        )
        if ex.kept:
            rest = np.concatenate([rest_docs[i] for i in ex.kept]).astype(small)
    return Corpus(
        tokens=np.stack([docs[i] for i in chosen]),
        sources=[names[i] for i in chosen],
        rest=rest,
        counts=counts,
        exclusion=ex,
    )


def bucket_names(study: StudyConfig) -> list[str]:
    return [f"treated-{b + 1}" for b in range(study.buckets)] + [CONTROL]


def assign_buckets(study: StudyConfig, seed: int) -> list[str]:
    """The bucket of every pool document under ``seed`` (a list indexed by document id)."""
    perm = np.random.default_rng([int(seed), 1]).permutation(study.bucket_size * (study.buckets + 1))
    out = [""] * len(perm)
    for b, name in enumerate(bucket_names(study)):
        for i in perm[b * study.bucket_size : (b + 1) * study.bucket_size]:
            out[int(i)] = name
    return out


class DocumentEpochs(Dataset):
    """The treated documents as the training pipeline's samples (:mod:`axo4d.training.datasets`), so the
    :class:`~axo4d.training.trainer.Trainer` trains on them as on any dataset.

    A sample is one whole document: input ``doc[:-1]``, target ``doc[1:]`` (``seq_len = L - 1``).
    Epoch ``e`` is the pipeline's seeded permutation of the documents; optimizer step ``s`` takes
    the ``s % steps_per_epoch``-th run of ``global_batch`` documents of epoch ``s // steps_per_epoch``
    (the pipeline's stream, with epochs a whole number of steps), cut into micro-batches and into
    shards like any batch. Every document is seen exactly once per epoch, on any grid.
    """

    def __init__(self, docs: np.ndarray, global_batch: int, grad_accum: int, seed: int) -> None:
        n = len(docs)
        if global_batch < 1 or n % global_batch:
            raise DataError(
                f"{n} treated documents do not divide into batches of train.global_batch={global_batch}: "
                f"choose a divisor of {n} (or change study.buckets / study.bucket_size)"
            )
        rows = RowSamples(docs, "the treated documents")
        super().__init__(rows, None, EpochOrder(n, seed), rows.seq_len, seed, rows.name)
        self.docs, self.batch_size, self.accum = docs, global_batch, grad_accum
        self.steps_per_epoch = n // global_batch

    def rows(self, step: int) -> np.ndarray:
        """Document indices of step ``step``, in the order they are cut: ``(global_batch,)``."""
        pos = step * self.batch_size + np.arange(self.batch_size)
        return self.order.at(pos)[1]
