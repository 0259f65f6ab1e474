"""Statistics of :mod:`bench.validate_perfmodel` (pure functions): ranks, Pearson and Spearman
correlation, pairwise ordering, the median step time of a run's ``metrics.jsonl``, and the
bootstrap confidence intervals of Spearman's rho and of rho - rho_baseline (:func:`bootstrap_rho`:
each replicate draws the configurations with replacement and keeps the distinct ones -- a
configuration drawn twice adds nothing to an ordering and, kept, would tie with itself and pull
rho down -- and re-takes each one's median from its own steps resampled with replacement: the
spread of which grids were measured and of each measurement on a noisy host)."""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties get the average of their positions."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def pearson(a: list[float], b: list[float]) -> float:
    """Pearson correlation of two equal-length lists (nan when either is constant)."""
    n = len(a)
    if n < 2 or n != len(b):
        raise ValueError("pearson: need two lists of equal length >= 2")
    ma, mb = sum(a) / n, sum(b) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else float("nan")


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (Pearson on tie-averaged ranks)."""
    return pearson(ranks(a), ranks(b))


def median_step_time(metrics: Path, warmup: int) -> tuple[float, list[float]]:
    """Median ``step_time_s`` of a ``metrics.jsonl``, leaving out warm-up steps: records
    flagged ``warmup`` (interleaved sweeps), else the first ``warmup`` steps (axo4d.train)."""
    times = []
    for line in metrics.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "step_time_s" not in rec:
            continue
        skip = rec["warmup"] if "warmup" in rec else rec.get("step", 0) < warmup
        if not skip:
            times.append(float(rec["step_time_s"]))
    if not times:
        raise ValueError(f"{metrics}: no step times after the warm-up steps")
    return statistics.median(times), times


def misordered(p: list[float], m: list[float]) -> list[tuple[float, bool]]:
    """For every pair of configurations: (predicted ratio slow/fast >= 1, measured order agrees)."""
    out = []
    for i in range(len(p)):
        for j in range(i + 1, len(p)):
            if p[i] == p[j]:
                continue
            fast, slow = (i, j) if p[i] < p[j] else (j, i)
            out.append((p[slow] / p[fast], m[fast] <= m[slow]))
    return out


def _rho(a: list[float], b: list[float]) -> float:
    r = spearman(a, b)
    return 0.0 if math.isnan(r) else r  # a resample with one distinct value orders nothing


def bootstrap_rho(
    pred: list[float], base: list[float], steps: list[list[float]], reps: int = 10000, seed: int = 26
) -> dict[str, tuple[float, float, float]]:
    """``{'model': (rho, lo, hi), 'baseline': ..., 'delta': ...}``: Spearman's rho of the predicted
    (``pred``) and the baseline's (``base``) step times against the measured medians of ``steps``
    (each configuration's step times), with the 2.5 and 97.5 percentiles over ``reps`` bootstrap
    replicates (module docstring; ``seed`` fixes them); ``delta`` = rho - rho_baseline."""
    n = len(pred)
    if n < 3 or len(base) != n or len(steps) != n:
        raise ValueError("bootstrap_rho: need three or more configurations, each with predictions and steps")
    med = [statistics.median(s) for s in steps]
    point = {"model": _rho(pred, med), "baseline": _rho(base, med)}
    point["delta"] = point["model"] - point["baseline"]
    rng = random.Random(seed)
    draws: dict[str, list[float]] = {k: [] for k in point}
    for _ in range(reps):
        rm, rb = _replicate(rng, pred, base, steps)
        draws["model"].append(rm)
        draws["baseline"].append(rb)
        draws["delta"].append(rm - rb)
    return {k: (point[k], *percentiles(draws[k])) for k in point}


def _replicate(rng: random.Random, pred: list[float], base: list[float], steps: list[list[float]]) -> tuple:
    """One bootstrap replicate's (rho, rho_baseline) (module docstring)."""
    n = len(pred)
    idx: list[int] = []
    while len(idx) < 3:
        idx = sorted({rng.randrange(n) for _ in range(n)})
    m = [statistics.median(rng.choices(steps[i], k=len(steps[i]))) for i in idx]
    return _rho([pred[i] for i in idx], m), _rho([base[i] for i in idx], m)


def percentiles(xs: list[float], lo: float = 2.5, hi: float = 97.5) -> tuple[float, float]:
    """The ``lo`` and ``hi`` percentiles of ``xs`` (nearest rank)."""
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]  # noqa: E731
    return pick(lo), pick(hi)


def pooled_delta(sets: list[tuple[list[float], list[float], list[list[float]]]], reps: int = 10000, seed: int = 26):
    """The mean over configuration sets of rho - rho_baseline, ``(point, lo, hi)``: each replicate
    resamples every set as :func:`bootstrap_rho` does and averages their deltas."""
    rng = random.Random(seed)
    point = statistics.mean(bootstrap_rho(p, b, s, reps=1)["delta"][0] for p, b, s in sets)
    means = []
    for _ in range(reps):
        means.append(statistics.mean(a - b for a, b in (_replicate(rng, p, b, s) for p, b, s in sets)))
    return (point, *percentiles(means))


__all__ = [
    "ranks",
    "pearson",
    "spearman",
    "misordered",
    "median_step_time",
    "bootstrap_rho",
    "pooled_delta",
    "percentiles",
]
