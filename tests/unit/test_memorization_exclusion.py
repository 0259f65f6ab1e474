"""The study's documents kept out of pre-training, by substring: planted copies of study documents
(whole, suffix only, shifted by one token either way, spanning two source files) never reach the
rest, and the pieces (hashes of every window, the pool, the window count) against brute force."""

import random

import numpy as np
import pytest

from axo4d.config import DataConfig
from axo4d.memorization.documents import read_corpus
from axo4d.memorization.exclusion import Passages, choose_pool, exclude, window_hashes, windows_containing
from axo4d.memorization.study_config import StudyConfig
from axo4d.training.datasets.tokenizer import ByteTokenizer

W = 50  # study.suffix: the passage length
STUDY = StudyConfig(prefix=50, suffix=W, buckets=2, bucket_size=3, split="yes")


def _passages_in(doc: np.ndarray, text: bytes) -> list[int]:
    """Offsets i of the passages doc[i : i + W] found in ``text`` (brute force)."""
    return [i for i in range(len(doc) - W + 1) if bytes(doc[i : i + W].astype(np.uint8)) in text]


def _letters(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnop") for _ in range(n))


def test_planted_copies_of_study_documents_never_reach_pretraining(tmp_path):
    rng = random.Random(4)
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(40):
        (d / f"f{i:03d}.txt").write_text(_letters(rng, 200))  # two 100-token documents each
    clean = read_corpus(DataConfig(source=str(d)), ByteTokenizer(), STUDY)
    t = [bytes(x.astype(np.uint8)).decode() for x in clean.tokens[:5]]  # study documents to copy
    plants = {
        "p1_whole.txt": _letters(rng, 37) + t[0] + _letters(rng, 63),  # whole, across two aligned chunks
        "p2_suffix.txt": _letters(rng, 20) + t[1][50:] + _letters(rng, 130),  # the suffix alone
        "p3_late.txt": _letters(rng, 1) + t[2][:99] + _letters(rng, 100),  # shifted right: last token cut
        "p4_early.txt": t[3][1:] + _letters(rng, 101),  # shifted left: the suffix at offset 49
        "p5a_span.txt": _letters(rng, 165) + t[4][40:75],  # 35 tokens at the end of one file ...
        "p5b_span.txt": t[4][75:] + _letters(rng, 175),  # ... 25 at the start of the next
    }
    for name, text in plants.items():
        assert len(text) == 200, name
        (d / name).write_text(text)
    c = read_corpus(DataConfig(source=str(d)), ByteTokenizer(), STUDY)
    pool = {bytes(x.astype(np.uint8)).decode() for x in c.tokens}
    assert set(t) <= pool, "a planted copy took a study document's place: pick another seed"
    rest = bytes(c.rest.astype(np.uint8))
    seen = {s: _passages_in(x, rest) for s, x in zip(c.sources, c.tokens)}
    assert not any(seen.values()), f"passages of study documents in the pre-training data: {seen}"
    for i, x in enumerate(c.tokens):  # nor in one another (a treated document must not teach a control's answer)
        others = b"|".join(bytes(y.astype(np.uint8)) for j, y in enumerate(c.tokens) if j != i)
        assert not _passages_in(x, others)
    n = c.counts
    assert n["usable"] == 92 and n["rest_documents"] == 83 and n["rest_tokens"] == 8300
    # inside: p1's first chunk, p2, p3, p4; across a junction: p1's second chunk (the whole copy
    # continues into it), p5a's last and p5b's first
    assert n["dropped_inside"] == 4 and n["dropped_junction"] == 3, n
    assert n["dropped_tokens"] == 700 and len(c.rest) == 7600 and n["occurrences"] > 5
    kept, total = c.windows_dropped(W + 1)
    assert total == 8300 - W and 0 < kept < 6 * 100


def test_window_hashes_and_passages_against_brute_force():
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 7, 5000)
    h = window_hashes(stream, 6)
    assert len(h) == 5000 - 6 + 1
    first = {}
    for i in range(len(h)):  # equal windows hash equal; distinct windows (in this stream) do not
        key = stream[i : i + 6].tobytes()
        assert first.setdefault(key, int(h[i])) == int(h[i])
    assert len(set(first.values())) == len(first)
    docs = [rng.integers(0, 7, 20) for _ in range(3)]
    p = Passages(6)
    for i, doc in enumerate(docs):
        p.add(i, doc)
    planted = stream.copy()
    planted[100:120], planted[3000:3010] = docs[0], docs[2][5:15]
    want = [i for i in range(len(planted) - 5) if any(planted[i : i + 6].tobytes() in _windows(doc, 6) for doc in docs)]
    assert want and p.find(planted).tolist() == want
    assert window_hashes(stream[:3], 6).shape == (0,) and p.find(stream[:5]).shape == (0,)


def _windows(doc: np.ndarray, w: int) -> set[bytes]:
    return {doc[i : i + w].tobytes() for i in range(len(doc) - w + 1)}


def test_pool_skips_documents_sharing_a_passage_and_exclusion_rescans_junctions():
    a = np.arange(100, 130)
    docs = [a, np.concatenate([[1, 2], a[:28]]), np.arange(200, 230), np.arange(300, 330)]
    chosen, skipped, passages = choose_pool(docs, [0, 1, 2, 3], 3, 10)
    assert chosen == [0, 2, 3] and skipped == 1  # docs[1] holds 28 of a's tokens
    rest = [np.arange(500, 530), a[5:12], a[12:20], np.arange(600, 620), a[:3]]  # a[5:20] across 1|2
    ex = exclude(rest, passages)
    assert ex.kept == [0, 3, 4] and (ex.inside, ex.junction, ex.tokens) == (0, 2, 15)
    assert passages.find(np.concatenate([rest[i] for i in ex.kept])).size == 0


@pytest.mark.parametrize("span", [5, 8, 30])
def test_windows_containing_counts_windows_like_brute_force(span):
    rng = np.random.default_rng(span)
    length, w = 200, 5
    hits = np.sort(rng.choice(length - w + 1, 9, replace=False))
    brute = sum(any(o <= p and p + w <= o + span for p in hits) for o in range(length - span + 1))
    assert windows_containing(hits, length, w, span) == (brute, length - span + 1)
    assert windows_containing(np.zeros(0, np.int64), length, w, span) == (0, length - span + 1)
