"""The study's intervals: Wilson (per seed), Wilson at the effective n with documents as clusters
(pooled over seeds), the clustered mean, and the bootstrap of the epochs to reach a rate; their
coverage checked by simulation on documents whose seeds agree, where Wilson over the pairs fails."""

import math

import numpy as np
import pytest

from axo4d.memorization.documents import CONTROL
from axo4d.memorization.results import relation
from axo4d.memorization.stats import cell, clustered_rate, effective_n, epochs_to_reach, mean_interval, wilson


@pytest.mark.parametrize(
    "k,n,lo,hi",
    [
        (0, 10, 0.0, 0.2775),
        (10, 10, 0.7225, 1.0),
        (5, 10, 0.2366, 0.7634),
        (1, 48, 0.0037, 0.1090),
        (40, 200, 0.1505, 0.2609),
    ],
)
def test_wilson_interval_known_values(k, n, lo, hi):
    a, b = wilson(k, n)
    assert a == pytest.approx(lo, abs=1e-4) and b == pytest.approx(hi, abs=1e-4)


def test_wilson_ends_are_exact_and_zero_is_within_a_zero_control():
    assert wilson(0, 24)[0] == 0.0 and wilson(24, 24)[1] == 1.0 and wilson(0, 48)[0] == 0.0
    assert wilson(7.5, 7.5) == (wilson(7.5, 7.5)[0], 1.0) and math.isnan(wilson(0, 0)[0])
    zero = [
        {"arm": "a", "bucket": b, "seed": 1, "doc": i, "exact": [0, 0], "token_match": [0.1, 0.1]}
        for i, b in enumerate(["treated-1"] * 48 + [CONTROL] * 24)
    ]
    t, c = cell(zero, "a", "treated", 1), cell(zero, "a", CONTROL, 1)
    assert relation(t, c) == "within the control's interval"


def test_wilson_covers_the_truth_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    hits = sum(lo <= 0.1 <= hi for lo, hi in (wilson(int(k), 60) for k in rng.binomial(60, 0.1, 4000)))
    assert 0.93 < hits / 4000 < 0.975


def test_effective_n_between_the_documents_and_the_pairs():
    docs = [d for d in range(12) for _ in range(3)]  # 12 documents, 3 seeds each
    agree = [d % 3 == 0 for d in docs]  # every document's seeds agree: one trial per document
    assert effective_n(agree, docs) == pytest.approx(12.0)
    one_each = [i % 3 == 0 for i in range(36)]  # one pair per document: the pairs are the trials
    assert effective_n(one_each, list(range(36))) == pytest.approx(36.0)
    mixed = [(d + s) % 2 == 0 for d in range(12) for s in range(3)]  # seeds disagree within documents
    assert 12 < effective_n(mixed, docs) <= 36
    assert effective_n([False] * 36, docs) == 12.0 and effective_n([True] * 36, docs) == 12.0  # p = 0, 1
    rate, (lo, hi), n_eff = clustered_rate(agree, docs)
    assert rate == pytest.approx(1 / 3) and (lo, hi) == pytest.approx(wilson(4, 12)) and n_eff == pytest.approx(12)


@pytest.mark.parametrize("docs,seeds,a,b", [(24, 3, 0.15, 0.35), (8, 3, 0.3, 0.7), (24, 2, 3.0, 7.0)])
def test_coverage_with_documents_whose_seeds_agree(docs, seeds, a, b):
    """Documents with their own match probability (Beta(a, b): a strong document effect for small
    a + b), each measured under every seed: Wilson at the effective n covers the mean probability
    about 95% of the time; Wilson over the pairs does not when the document effect is strong."""
    rng = np.random.default_rng(docs * 10 + seeds)
    truth, reps = a / (a + b), 1500
    clusters = np.repeat(np.arange(docs), seeds).tolist()
    new = naive = 0
    for _ in range(reps):
        hits = (rng.random((docs, seeds)) < rng.beta(a, b, docs)[:, None]).ravel().tolist()
        lo, hi = clustered_rate(hits, clusters)[1]
        new += lo <= truth <= hi
        lo, hi = wilson(sum(hits), len(hits))
        naive += lo <= truth <= hi
    assert 0.92 <= new / reps <= 0.975, new / reps
    if a + b < 2:  # intra-document correlation 1 / (a + b + 1) >= 1/3
        assert naive / reps < 0.9, naive / reps


def test_clustered_mean_interval():
    m, lo, hi = mean_interval([0.0, 1.0, 0.5, 0.5], [0, 1, 2, 3])
    se = math.sqrt(sum((v - 0.5) ** 2 for v in [0.0, 1.0, 0.5, 0.5])) / 4  # one value per cluster
    assert m == 0.5 and lo == pytest.approx(0.5 - 1.959964 * se) and hi == pytest.approx(0.5 + 1.959964 * se)
    m2, lo2, hi2 = mean_interval([0.4, 0.4, 0.6, 0.6], [0, 0, 1, 1])  # two clusters of two equal values
    se2 = math.sqrt(((0.8 - 1.0) ** 2 + (1.2 - 1.0) ** 2) / 16)  # sum_c (s_c - m n_c)^2 / n^2
    assert m2 == pytest.approx(0.5) and hi2 - lo2 == pytest.approx(2 * 1.959964 * se2)
    _, lo4, hi4 = mean_interval([0.4, 0.4, 0.6, 0.6], [0, 1, 2, 3])  # the same values as 4 documents
    assert hi2 - lo2 > hi4 - lo4
    assert mean_interval([0.3, 0.4], [7, 7]) == (pytest.approx(0.35), 0.0, 1.0)  # one cluster: unknown


def _curve(first: dict[int, int | None], epochs: list[int], seeds=(1, 2, 3)) -> list[dict]:
    """Treated records: document d matches from epoch first[d] on (None: never)."""
    return [
        {
            "arm": "standard",
            "bucket": "treated-1",
            "seed": s,
            "doc": d,
            "epochs": epochs,
            "exact": [int(f is not None and e >= f) for e in epochs],
            "token_match": [0.0] * len(epochs),
        }
        for s in seeds
        for d, f in first.items()
    ]


def test_epochs_to_reach_half_and_its_bootstrap():
    epochs = [0, 1, 5, 10, 15, 20]
    every = _curve({d: 10 for d in range(10)}, epochs)  # all documents at epoch 10: no doubt
    r = epochs_to_reach(every, "standard")
    assert (r.epoch, r.low, r.high, r.reached) == (10, 10, 10, 1.0) and r.text(20) == "10 [10, 10]"
    spread = _curve({d: [5, 10, 15, 20][d % 4] for d in range(20)}, epochs)  # 5/10/15/20 for 5 each
    r = epochs_to_reach(spread, "standard")
    assert r.epoch == 10 and r.low in (5, 10) and r.high in (10, 15) and r.low < r.high
    assert epochs_to_reach(spread, "standard") == r  # seeded: the report is a function of the records
    never = _curve({d: (None if d % 2 else 20) for d in range(10)}, epochs)  # half at the last epoch
    r = epochs_to_reach(never, "standard")
    assert r.epoch == 20 and r.high is None and 0.3 < r.reached < 0.8 and r.text(20) == "20 [20, > 20]"
    assert epochs_to_reach(_curve({0: None, 1: None}, epochs), "standard").text(20) == "> 20 [> 20, > 20]"
