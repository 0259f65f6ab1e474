"""The machine a performance model prices on (:class:`Machine`: node shape, memory, GEMM rate,
the bandwidth table and slowdowns; its lookups) and :func:`group_link`. The YAML format, reading,
checking and writing: :mod:`perfmodel.machine`."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from axo4d.facts.grid import Grid

from .compute import GemmModel, GemmPoint

MACHINE_DIR = Path(__file__).parent / "machines"
GIB = 2**30
_REQUIRED = ("name", "gpus_per_node", "device_memory_gb", "gemm_tflops", "latency_us", "bandwidth")
_NUMBERS = (
    "gemm_efficiency",
    "inter_node_gbps",
    "reserved_memory_gb",
    "op_overhead_us",
    "memory_gbps",
    "overlap_efficiency",
    "gemm_half_dim",
    "attention_tflops",
    "fp8_gemm_ratio",
    "compute_slowdown",
    "comm_slowdown",
    "uncertainty",
    "fs_write_gbps",
    "vendor_tflops",
)
_BY_LINK = ("compute_slowdown_by_link", "comm_slowdown_by_link")
_OPTIONAL = _NUMBERS + ("description", "source", "gemm_table", "concurrent_slowdown") + _BY_LINK
_ZERO_OK = (
    "reserved_memory_gb",
    "op_overhead_us",
    "overlap_efficiency",
    "gemm_half_dim",
    "fp8_gemm_ratio",
    "vendor_tflops",
)
LINK_CLASSES = ("intra", "inter", "mixed")
DEFAULT_UNCERTAINTY = 0.1
_COVER_MAX = 64  # coverage is checked for strides 1.._COVER_MAX and sizes 2.._COVER_MAX


class MachineError(ValueError):
    """A machine name, file or table that cannot be used."""


Range = tuple[int, "int | None"]


@dataclass(frozen=True)
class BandwidthEntry:
    """One row of the bandwidth table: ranges of stride and group size -> GB/s."""

    stride: Range
    size: Range
    gbps: float
    latency_us: float | None = None
    by_kind: tuple[tuple[str, float, float | None], ...] = ()
    """Per-collective overrides ``(kind, gbps, latency_us)`` (a profiled library
    whose reduce-scatter is not a ring, for example)."""

    def matches(self, stride: int, size: int) -> bool:
        return _in(stride, self.stride) and _in(size, self.size)

    def for_kind(self, kind: str | None) -> tuple[float, float | None]:
        """``(gbps, latency_us)`` of collective ``kind`` (the entry's own without an override)."""
        for k, g, lat in self.by_kind:
            if k == kind:
                return g, lat
        return self.gbps, self.latency_us


def _in(v: int, r: Range) -> bool:
    return v >= r[0] and (r[1] is None or v <= r[1])


@dataclass(frozen=True)
class Machine:
    """A machine: :mod:`perfmodel.machine`'s docstring gives the fields' meaning and units."""

    name: str
    gpus_per_node: int
    device_memory_gb: float
    gemm_tflops: float
    latency_us: float
    table: tuple[BandwidthEntry, ...]
    gemm_efficiency: float = 0.7
    inter_node_gbps: float | None = None
    reserved_memory_gb: float = 0.0
    op_overhead_us: float = 0.0
    memory_gbps: float | None = None
    overlap_efficiency: float = 1.0
    description: str = ""
    source: str = ""
    gemm_half_dim: float = 0.0
    gemm_table: tuple[GemmPoint, ...] = ()
    attention_tflops: float | None = None
    fp8_gemm_ratio: float = 0.0
    compute_slowdown: float | None = None
    comm_slowdown: float | None = None
    concurrent_slowdown: tuple[tuple[str, float], ...] = ()
    uncertainty: float = DEFAULT_UNCERTAINTY
    fs_write_gbps: float | None = None
    compute_slowdown_by_link: tuple[tuple[str, float], ...] = ()
    comm_slowdown_by_link: tuple[tuple[str, float], ...] = ()
    vendor_tflops: float = 0.0
    """The vendor's dense bf16 peak per GPU (data sheet; MI250X per GCD): what MFU and HFU are
    against. 0: unknown (MFU and HFU not reported)."""
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- lookups ----------------------------------------------------------
    def entry(self, stride: int, size: int) -> BandwidthEntry:
        """The first table entry matching ``stride`` and ``size``."""
        key = (stride, size)
        e = self._cache.get(key)
        if e is None:
            for cand in self.table:
                if cand.matches(stride, size):
                    e = cand
                    break
            else:
                raise MachineError(f"machine {self.name!r}: no bandwidth entry for stride {stride}, group size {size}")
            self._cache[key] = e
        return e

    def bandwidth(self, stride: int, size: int, gpus_per_node: int | None = None, kind: str | None = None) -> float:
        """GB/s of a group of ``size`` ranks at ``stride``.

        The table describes jobs that fill the machine's nodes. When a job
        places fewer ranks on a node (``gpus_per_node`` below the machine's),
        a group spanning several of the job's nodes (``stride*size >
        gpus_per_node``) gets at most ``inter_node_gbps``. ``kind`` selects a
        per-collective override of the entry, if any.
        """
        bw = self.entry(stride, size).for_kind(kind)[0]
        gpn = self.gpus_per_node if gpus_per_node is None else gpus_per_node
        if gpn < self.gpus_per_node and stride * size > gpn:
            bw = min(bw, self.inter_gbps)
        return bw

    def latency_s(self, stride: int, size: int, kind: str | None = None) -> float:
        """Latency per ring step in seconds (entry's per-kind or own override, else ``latency_us``)."""
        lat = self.entry(stride, size).for_kind(kind)[1]
        return (self.latency_us if lat is None else lat) * 1e-6

    @property
    def inter_gbps(self) -> float:
        """Inter-node bandwidth: ``inter_node_gbps``, else the table's minimum."""
        return self.inter_node_gbps if self.inter_node_gbps is not None else min(e.gbps for e in self.table)

    @property
    def usable_memory_bytes(self) -> float:
        return (self.device_memory_gb - self.reserved_memory_gb) * GIB

    @property
    def gemm_flops_per_s(self) -> float:
        """Achieved GEMM rate (FLOP/s): peak times efficiency."""
        return self.gemm_tflops * 1e12 * self.gemm_efficiency

    @property
    def has_fp8(self) -> bool:
        """Whether FP8 GEMMs can be priced: a stated ``fp8_gemm_ratio`` or measured ``float8`` rows."""
        return self.fp8_gemm_ratio > 0 or any(p.dtype == "float8" for p in self.gemm_table)

    @property
    def gemm_model(self) -> GemmModel:
        """GEMM rates: the shape curve and the measured table (:mod:`perfmodel.compute`)."""
        g = self._cache.get("gemm_model")
        if g is None:
            g = self._cache["gemm_model"] = GemmModel(
                self.gemm_flops_per_s, self.gemm_half_dim, self.gemm_table, self.fp8_gemm_ratio
            )
        return g

    def slowdowns(self) -> tuple[float, float, dict[str, float]]:
        """``(compute_slowdown, comm_slowdown, {link class: concurrent slowdown})`` (module
        docstring; derived from ``overlap_efficiency`` where the file does not give them)."""
        legacy = 2.0 - self.overlap_efficiency
        conc = dict(self.concurrent_slowdown)
        only_legacy = self.compute_slowdown is None and self.comm_slowdown is None and not conc
        return (
            self.compute_slowdown if self.compute_slowdown is not None else legacy,
            self.comm_slowdown if self.comm_slowdown is not None else legacy,
            {c: conc.get(c, legacy if only_legacy else 1.0) for c in LINK_CLASSES},
        )

    def link_slowdowns(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """:meth:`slowdowns` with the compute and collective slowdowns per link class of the
        collective in flight ('intra', 'inter'; ``*_by_link``, else the one number for both)."""
        g, c, conc = self.slowdowns()
        gl, cl = dict(self.compute_slowdown_by_link), dict(self.comm_slowdown_by_link)
        return {k: gl.get(k, g) for k in ("intra", "inter")}, {k: cl.get(k, c) for k in ("intra", "inter")}, conc

    def check_gpus_per_node(self, gpus_per_node: int | None, gpus: int | None = None) -> int:
        """Validate a job's GPUs per node against the machine, and against the job's ``gpus`` (whole
        nodes: a multiple of it when it spans more than one); returns it (default: machine's)."""
        gpn = self.gpus_per_node if gpus_per_node is None else gpus_per_node
        if not 1 <= gpn <= self.gpus_per_node:
            raise MachineError(
                f"--gpus-per-node {gpus_per_node} is not possible on {self.name!r}, "
                f"which has {self.gpus_per_node} GPUs per node (use 1..{self.gpus_per_node})"
            )
        if gpus is not None and gpus > gpn and gpus % gpn:
            fits = [d for d in range(gpn, 0, -1) if gpus % d == 0][0]
            raise MachineError(
                f"--gpus {gpus} is not a multiple of the {gpn} GPUs per node "
                f"{'of --gpus-per-node' if gpus_per_node is not None else f'of {self.name}'}: the nodes would "
                f"not be used alike; use --gpus {gpus - gpus % gpn} or {gpus + gpn - gpus % gpn}, or "
                f"--gpus-per-node {fits}"
            )
        return gpn

    def to_dict(self) -> dict:
        """The YAML mapping of this machine (inverse of :func:`machine_from_dict`)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in _REQUIRED if k != "bandwidth"}
        for k in _OPTIONAL:
            v = getattr(self, k)
            if k == "gemm_table":
                v = [p.to_dict() for p in v] or None
            elif k == "concurrent_slowdown" or k in _BY_LINK:
                v = dict(v) or None
            elif k == "uncertainty" and v == DEFAULT_UNCERTAINTY:
                v = None
            if v not in (None, ""):
                out[k] = v
        rows = []
        for e in self.table:
            row = {"stride": list(e.stride), "size": list(e.size), "gbps": e.gbps}
            if e.latency_us is not None:
                row["latency_us"] = e.latency_us
            if e.by_kind:
                row["by_kind"] = {
                    k: {"gbps": g, **({} if lat is None else {"latency_us": lat})} for k, g, lat in e.by_kind
                }
            rows.append(row)
        out["bandwidth"] = rows
        return out


def group_link(grid: Grid, axes: Iterable[str]) -> tuple[int, int]:
    """``(stride, size)`` of the group over ``axes``: the stride of its fastest
    axis in the grid's order and the product of the axes' sizes (memoised: a pure function of the
    frozen grid and the axes, asked for again by every estimate of a ranking)."""
    return _group_link(grid, tuple(axes))


@functools.lru_cache(maxsize=65536)
def group_span(grid: Grid, axes: tuple[str, ...]) -> int:
    """Ranks from the first to the last of a group over ``axes`` (memoised as :func:`group_link`):
    its link class is 'inter' when that exceeds the GPUs per node."""
    return 1 + sum(grid.stride(a) * (grid.size(a) - 1) for a in axes)


@functools.lru_cache(maxsize=65536)
def _group_link(grid: Grid, axes: tuple[str, ...]) -> tuple[int, int]:
    fastest = min(axes, key=grid.stride)  # (the expert sub-axes of data have strides, no place in the order)
    return grid.stride(fastest), grid.size(*axes)


__all__ = [
    "Machine",
    "MachineError",
    "BandwidthEntry",
    "group_link",
    "group_span",
    "GIB",
    "LINK_CLASSES",
    "MACHINE_DIR",
]
