"""Statistics of :mod:`bench.validate_perfmodel` (pure functions): ranks, Pearson and Spearman
correlation, pairwise ordering, and the median step time of a run's ``metrics.jsonl``."""

from __future__ import annotations

import json
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


__all__ = ["ranks", "pearson", "spearman", "misordered", "median_step_time"]
