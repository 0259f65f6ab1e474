"""Rates with 95% intervals over documents, from per-document records.

A *record* is one document under one seed and arm (a line of ``per_document.jsonl``): its bucket
and, for every epoch ``0..E``, whether it was an exact match and its token match rate. A cell of
the report pools the records of one (arm, bucket, epoch) over every seed: ``n`` = documents x
seeds.

* exact match ``k / n`` with the Wilson score interval (95%);
* the epoch-0 baseline of the same records, ``k0 / n``, and the difference ``(k - k0) / n``;
* per-document overlap with epoch 0: **new** (matched now, not before training; Wilson interval of
  ``new / n``) and **lost** (matched before training, not now);
* token match: mean over the records, with a normal-approximation 95% interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z95 = 1.959963984540054
"""Two-sided 95% quantile of the standard normal distribution."""


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of ``k`` successes in ``n`` trials (``(nan, nan)`` when ``n == 0``)."""
    if n == 0:
        return math.nan, math.nan
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # exactly 0 (k = 0) and 1 (k = n), where rounding would leave 1e-17 and the report would read
    # "0.000 is below [0.000, ...]"
    return 0.0 if k == 0 else max(0.0, centre - half), 1.0 if k == n else min(1.0, centre + half)


def mean_interval(values: list[float], z: float = Z95) -> tuple[float, float, float]:
    """Mean and its normal-approximation interval, clipped to [0, 1]."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    m = sum(values) / n
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    half = z * sd / math.sqrt(n)
    return m, max(0.0, m - half), min(1.0, m + half)


@dataclass(frozen=True)
class Cell:
    """One (arm, bucket, epoch), pooled over seeds."""

    n: int
    k: int
    k0: int
    new: int
    lost: int
    per_seed: tuple[float, ...]
    token: tuple[float, float, float]

    @property
    def rate(self) -> float:
        return self.k / self.n if self.n else math.nan

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.k, self.n)

    @property
    def base(self) -> float:
        return self.k0 / self.n if self.n else math.nan

    @property
    def delta(self) -> float:
        return (self.k - self.k0) / self.n if self.n else math.nan

    @property
    def new_interval(self) -> tuple[float, float]:
        return wilson(self.new, self.n)


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


def cell(records: list[dict], arm: str, bucket: str, epoch: int) -> Cell:
    """Pool the records of ``arm`` in ``bucket`` (``'treated'``: every treated bucket) at ``epoch``."""
    rows = [
        r
        for r in records
        if r["arm"] == arm and (r["bucket"] == bucket or (bucket == "treated" and r["bucket"] != "control"))
    ]
    now = [bool(r["exact"][_at(r, epoch)]) for r in rows]
    before = [bool(r["exact"][0]) for r in rows]
    seeds = sorted({r["seed"] for r in rows})
    per_seed = tuple(
        sum(bool(r["exact"][_at(r, epoch)]) for r in rows if r["seed"] == s)
        / max(1, sum(1 for r in rows if r["seed"] == s))
        for s in seeds
    )
    return Cell(
        n=len(rows),
        k=sum(now),
        k0=sum(before),
        new=sum(a and not b for a, b in zip(now, before)),
        lost=sum(b and not a for a, b in zip(now, before)),
        per_seed=per_seed,
        token=mean_interval([float(r["token_match"][_at(r, epoch)]) for r in rows]),
    )


def fmt_rate(rate: float, interval: tuple[float, float]) -> str:
    return f"{rate:.3f} [{interval[0]:.3f}, {interval[1]:.3f}]"
