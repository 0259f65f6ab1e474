"""Rates with 95% intervals that respect the study's design, from per-document records.

A *record* is one document under one seed and arm (a line of ``per_document.jsonl``): its bucket
and, at every measured epoch, whether it was an exact match and its token match rate. A cell of
the report pools the records of one (arm, bucket, epoch) over every seed: ``n`` document-seed
pairs from ``docs`` distinct documents.

**Why not Wilson over the n pairs.** The seeds re-draw which documents are treated, but they share
one starting model and one pool of documents: a document that is hard to reproduce is hard under
every seed. The pairs of one document are not independent trials, so a cell holds fewer than ``n``
trials' worth of evidence; a Wilson interval over the ``n`` pairs is too narrow (a unit test
shows it covering ~80% where it claims 95%, with documents whose seeds agree).

**What is used instead: Wilson at the effective sample size.** The documents are the clusters.
The pooled rate ``p = k / n`` has the cluster (linearised) variance
``v = sum_c (k_c - p m_c)**2 / n**2`` over the ``C`` documents (``k_c`` matches in
``m_c`` pairs); the design effect is ``v / (p(1-p)/n)`` and the *effective n* is
``n_eff = p(1-p)/v``, at most ``n`` (Kish's effective sample size): ``n`` when every document
has one pair or its pairs vary as independent trials would, ``C`` when every document's pairs
agree. The interval is Wilson's
score interval with ``n_eff`` trials and ``p n_eff`` successes (Korn & Graubard's use of the
effective sample size for intervals from clustered samples). When ``p`` is 0 or 1 the data say
nothing about how alike a document's seeds are, so the worst case is taken: every document counts
once (``n_eff = C``). Unlike a percentile bootstrap over documents, this keeps Wilson's behaviour
at 0 and 1 (a bootstrap of 0/48 is the empty interval [0, 0]).

* exact match: ``k / n`` with that interval, ``n``, ``C`` and ``n_eff`` beside it;
* per seed: ``k_s / n_s`` with the plain Wilson interval (within one seed, each document is one
  independent trial);
* the epoch-0 baseline of the same records ``k0 / n`` and the difference ``(k - k0) / n``; **new**
  (matched now, not before training; interval as for exact match) and **lost**;
* token match: the mean over the pairs, with the cluster variance of a mean and a normal interval;
* epochs to reach a rate (:func:`epochs_to_reach`): the first measured epoch whose pooled rate is
  at least the threshold, with a 95% percentile interval from a bootstrap over documents (a
  first-passage epoch has no closed-form variance; resampling documents keeps a document's seeds
  together). The resampling is seeded, so the report is a pure function of the records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054
"""Two-sided 95% quantile of the standard normal distribution."""
BOOTSTRAP = 2000
"""Resamples of :func:`epochs_to_reach`."""


def wilson(k: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of ``k`` successes in ``n`` trials (``(nan, nan)`` when ``n == 0``);
    ``k`` and ``n`` may be fractional (an effective sample size)."""
    if n <= 0:
        return math.nan, math.nan
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(0.0, p * (1 - p)) / n + z * z / (4 * n * n)) / denom
    # exactly 0 (k = 0) and 1 (k = n), where rounding would leave 1e-17 and the report would read
    # "0.000 is below [0.000, ...]"
    return 0.0 if k == 0 else max(0.0, centre - half), 1.0 if k == n else min(1.0, centre + half)


def clustered(values: list[float], clusters: list[object]) -> tuple[float, float, int]:
    """``(mean, cluster variance of the mean, clusters)`` of ``values`` grouped by ``clusters``
    (module docstring; variance ``nan`` with fewer than 2 clusters)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(values) / n
    sums: dict[object, list[float]] = {}
    for v, c in zip(values, clusters):
        s = sums.setdefault(c, [0.0, 0])
        s[0] += v
        s[1] += 1
    n_c = len(sums)
    if n_c < 2:
        return mean, math.nan, n_c
    var = sum((s - mean * m) ** 2 for s, m in sums.values()) / (n * n)
    return mean, var, n_c


def effective_n(hits: list[bool], clusters: list[object]) -> float:
    """Kish's effective sample size of a clustered proportion (module docstring)."""
    p, var, n_c = clustered([float(h) for h in hits], clusters)
    n = len(hits)
    if n == 0:
        return 0.0
    if p in (0.0, 1.0) or not var > 0:
        return float(n_c)
    return min(float(n), p * (1 - p) / var)


def clustered_rate(hits: list[bool], clusters: list[object]) -> tuple[float, tuple[float, float], float]:
    """``(rate, Wilson interval at the effective n, effective n)``."""
    n = len(hits)
    if n == 0:
        return math.nan, (math.nan, math.nan), 0.0
    p = sum(hits) / n
    n_eff = effective_n(hits, clusters)
    k = sum(hits)
    return p, wilson(0 if k == 0 else (n_eff if k == n else p * n_eff), n_eff), n_eff


def mean_interval(values: list[float], clusters: list[object], z: float = Z95) -> tuple[float, float, float]:
    """Mean and its normal 95% interval from the cluster variance, clipped to [0, 1] (the whole
    [0, 1] with fewer than two clusters)."""
    m, var, _ = clustered(values, clusters)
    if math.isnan(m):
        return math.nan, math.nan, math.nan
    if math.isnan(var):
        return m, 0.0, 1.0
    half = z * math.sqrt(var)
    return m, max(0.0, m - half), min(1.0, m + half)


@dataclass(frozen=True)
class Cell:
    """One (arm, bucket, epoch), pooled over seeds."""

    n: int
    """Document-seed pairs."""
    docs: int
    """Distinct documents among them (the clusters)."""
    k: int
    k0: int
    new: int
    lost: int
    interval: tuple[float, float]
    """95% interval of ``k / n`` (Wilson at the effective n)."""
    n_eff: float
    new_interval: tuple[float, float]
    per_seed: tuple[tuple[int, int, int], ...]
    """``(seed, k_s, n_s)`` per seed."""
    token: tuple[float, float, float]

    @property
    def rate(self) -> float:
        return self.k / self.n if self.n else math.nan

    @property
    def base(self) -> float:
        return self.k0 / self.n if self.n else math.nan

    @property
    def delta(self) -> float:
        return (self.k - self.k0) / self.n if self.n else math.nan

    def seed_rate(self, i: int) -> tuple[float, tuple[float, float]]:
        """Seed ``i``'s rate and its Wilson interval."""
        _, k, n = self.per_seed[i]
        return (k / n if n else math.nan), wilson(k, n)


def measured_epochs(records: list[dict], epochs: int) -> list[int]:
    """The epochs the records hold (``study.measure_every``); records without ``epochs``: 0..E."""
    return list(records[0]["epochs"]) if records and "epochs" in records[0] else list(range(epochs + 1))


def _at(r: dict, epoch: int) -> int:
    """Index of ``epoch`` in a record's lists (:class:`KeyError` naming it when it was not measured)."""
    if "epochs" not in r:
        return epoch
    if epoch not in r["epochs"]:
        raise KeyError(f"epoch {epoch} was not measured (measured: {r['epochs']})")
    return r["epochs"].index(epoch)


def _rows(records: list[dict], arm: str, bucket: str) -> list[dict]:
    return [
        r
        for r in records
        if r["arm"] == arm and (r["bucket"] == bucket or (bucket == "treated" and r["bucket"] != "control"))
    ]


def cell(records: list[dict], arm: str, bucket: str, epoch: int) -> Cell:
    """Pool the records of ``arm`` in ``bucket`` (``'treated'``: every treated bucket) at ``epoch``."""
    rows = _rows(records, arm, bucket)
    now = [bool(r["exact"][_at(r, epoch)]) for r in rows]
    before = [bool(r["exact"][0]) for r in rows]
    docs = [r["doc"] for r in rows]
    new = [a and not b for a, b in zip(now, before)]
    _, interval, n_eff = clustered_rate(now, docs)
    seeds = sorted({r["seed"] for r in rows})
    return Cell(
        n=len(rows),
        docs=len(set(docs)),
        k=sum(now),
        k0=sum(before),
        new=sum(new),
        lost=sum(b and not a for a, b in zip(now, before)),
        interval=interval,
        n_eff=n_eff,
        new_interval=clustered_rate(new, docs)[1],
        per_seed=tuple(
            (s, sum(a for a, r in zip(now, rows) if r["seed"] == s), sum(1 for r in rows if r["seed"] == s))
            for s in seeds
        ),
        token=mean_interval([float(r["token_match"][_at(r, epoch)]) for r in rows], docs),
    )


@dataclass(frozen=True)
class Reach:
    """The first measured epoch at which a pooled rate reaches a threshold (None: never)."""

    epoch: int | None
    low: int | None
    """2.5th percentile of the bootstrap (None: never reached)."""
    high: int | None
    """97.5th percentile of the bootstrap (None: beyond the last measured epoch)."""
    reached: float
    """Fraction of the bootstrap resamples that reach it."""

    def text(self, last: int) -> str:
        def one(e: int | None) -> str:
            return f"> {last}" if e is None else str(e)

        return f"{one(self.epoch)} [{one(self.low)}, {one(self.high)}]"


def epochs_to_reach(records: list[dict], arm: str, threshold: float = 0.5, bucket: str = "treated") -> Reach:
    """First measured epoch at which ``arm``'s pooled exact match in ``bucket`` is at least
    ``threshold``, with a 95% percentile interval from a bootstrap over documents (seeded)."""
    rows = _rows(records, arm, bucket)
    epochs = measured_epochs(rows, len(rows[0]["exact"]) - 1 if rows else 0)
    ids = sorted({r["doc"] for r in rows})
    index = {d: i for i, d in enumerate(ids)}
    k = np.zeros((len(ids), len(epochs)))  # (C, E): matches per document and epoch
    m = np.zeros(len(ids))  # (C,): pairs per document
    for r in rows:
        k[index[r["doc"]]] += [r["exact"][_at(r, e)] for e in epochs]
        m[index[r["doc"]]] += 1

    def first(curves: np.ndarray) -> np.ndarray:  # (B, E) -> (B,) index of the first epoch reached, E = never
        hit = curves >= threshold
        return np.where(hit.any(1), hit.argmax(1), len(epochs))

    point = int(first((k.sum(0) / m.sum())[None])[0])
    w = np.random.default_rng(0).multinomial(len(ids), np.full(len(ids), 1 / len(ids)), size=BOOTSTRAP)  # (B, C)
    boot = first((w @ k) / (w @ m)[:, None])
    lo, hi = int(np.quantile(boot, 0.025, method="lower")), int(np.quantile(boot, 0.975, method="higher"))

    def at(i: int) -> int | None:
        return None if i == len(epochs) else epochs[i]

    return Reach(at(point), at(lo), at(hi), float(np.mean(boot < len(epochs))))


def fmt_rate(rate: float, interval: tuple[float, float]) -> str:
    return f"{rate:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"
