"""Fitting measured collective timings into a machine file (``perfmodel profile``,
:mod:`perfmodel.startup_profile`): the ring alpha-beta fit of one collective, the bandwidth table
covering every (stride, size) from the measured ones, and the validated :class:`Machine`."""

from __future__ import annotations

import datetime
import statistics

import numpy as np

from .collectives import latency_steps, volume_factor
from .machine import BandwidthEntry, Machine, machine_from_dict


def fit_alpha_beta(kind: str, p: int, nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit ``t = steps*alpha + factor*n/BW`` through the smallest and the largest message
    (robust on noisy, shared hosts: both end points are reproduced, so neither the latency
    nor the bandwidth can collapse); returns ``(alpha_s, gbps)``, alpha clamped at 0."""
    n = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    lo, hi = int(np.argmin(n)), int(np.argmax(n))
    slope = (t[hi] - t[lo]) / (n[hi] - n[lo]) if n[hi] > n[lo] else 0.0
    icpt = t[lo] - slope * n[lo]
    if slope <= 0 or icpt < 0:  # noise: all of the largest message's time is bandwidth
        slope, icpt = float(t[hi] / n[hi]), (max(0.0, float(t[lo])) if slope <= 0 else 0.0)
    gbps = volume_factor(kind, p) / slope / 1e9
    return max(0.0, float(icpt)) / latency_steps(kind, p), float(gbps)


CPU_SLOWDOWNS = {
    "compute_slowdown": 2.0,
    "comm_slowdown": 2.0,
    "concurrent_slowdown": {"intra": 2.0, "inter": 2.0, "mixed": 2.0},
}
"""CPU ranks without an overlap measurement (``--no-overlap``, or one rank): processor sharing --
gloo moves and reduces data on the cores that compute, so nothing hides. A rule, not a
measurement, and wrong for a collective that waits for a wire: over a link between nodes most of
a collective's time takes no processor, and charging it as shared over-priced every grid whose
collectives run behind compute (the z prefetch and background reduce-scatters: grids with z > 1,
docs/perfmodel_validation.md). So CPU ranks are measured like GPUs, per link class
(:func:`perfmodel.measure.measure_overlap_fields`)."""


def _sig(v: float, digits: int = 4) -> float:
    """``v`` rounded to ``digits`` significant digits (CPU rates are far below 1 TFLOP/s)."""
    return float(f"{v:.{digits}g}")


def coverage_table(points: dict[tuple[int, int], tuple]) -> tuple[BandwidthEntry, ...]:
    """Bandwidth entries from measured ``(stride, size) -> (gbps, alpha_s[, {kind: (gbps, alpha_s)}])``:
    each measured key covers the keys between it and the next smaller one;
    the largest stride and size extend without bound."""
    strides = sorted({s for s, _ in points})
    out = []
    lo_s = 1
    for i, s in enumerate(strides):
        hi_s = None if i == len(strides) - 1 else s
        sizes = sorted(p for ss, p in points if ss == s)
        lo_p = 2
        for j, p in enumerate(sizes):
            gbps, alpha, *rest = points[(s, p)]
            kinds = tuple((k, _sig(g), _sig(a * 1e6)) for k, (g, a) in (rest[0] if rest else {}).items())
            hi_p = None if j == len(sizes) - 1 else p
            out.append(BandwidthEntry((lo_s, hi_s), (lo_p, hi_p), _sig(gbps), _sig(alpha * 1e6), kinds))
            lo_p = p + 1
        lo_s = s + 1
    return tuple(out)


def build_machine(
    points: dict[tuple[int, int], tuple],
    *,
    name: str,
    gpus_per_node: int,
    device_memory_gb: float,
    gemm_tflops: float,
    gemm_efficiency: float = 0.7,
    host: dict[str, float] | None = None,
    extra: dict | None = None,
) -> Machine:
    """A validated :class:`Machine` from measurements (``host``: the CPU-host fields
    ``op_overhead_us``, ``memory_gbps``, ``overlap_efficiency``; ``extra``: further machine-file
    keys as measured -- ``gemm_table``, ``gemm_half_dim``, ``attention_tflops``, the slowdowns)."""
    inter = [v[0] for (s, _), v in points.items() if s >= gpus_per_node]
    data = {
        "name": name,
        "description": f"measured by perfmodel profile on {datetime.date.today()}",
        "source": "perfmodel profile"
        + ("" if points else " (one rank: no collectives measured; the link table is a placeholder)"),
        "gpus_per_node": gpus_per_node,
        "device_memory_gb": round(device_memory_gb, 2),
        "gemm_tflops": _sig(gemm_tflops),
        "gemm_efficiency": gemm_efficiency,
        "latency_us": _sig(statistics.median(v[1] for v in points.values()) * 1e6) if points else 0.0,
        "bandwidth": [],
    }
    if inter:
        data["inter_node_gbps"] = _sig(min(inter))
    data.update({k: _sig(v) for k, v in (host or {}).items()})
    data.update(extra or {})
    data["bandwidth"] = [
        {
            "stride": list(e.stride),
            "size": list(e.size),
            "gbps": e.gbps,
            "latency_us": e.latency_us,
            **({"by_kind": {k: {"gbps": g, "latency_us": a} for k, g, a in e.by_kind}} if e.by_kind else {}),
        }
        for e in coverage_table(points)
    ] or [{"stride": [1, None], "size": [2, None], "gbps": 1e6}]
    return machine_from_dict(data, "<profile>")


__all__ = ["fit_alpha_beta", "coverage_table", "build_machine", "CPU_SLOWDOWNS"]
