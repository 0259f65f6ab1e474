"""Machine descriptions (YAML): node shape, memory, GEMM rate, network.

A machine file holds::

    name: perlmutter
    gpus_per_node: 4
    device_memory_gb: 40        # GiB (2**30 bytes) per GPU
    gemm_tflops: 280            # measured bf16 GEMM ceiling (compute time; the 'ceil' share)
    vendor_tflops: 312          # optional, the vendor's dense bf16 peak per GPU (MFU, HFU; absent: n/a;
                                # with device: NAME, axo4d/facts/devices.py's peak of that device)
    gemm_efficiency: 0.7        # optional, fraction of gemm_tflops reached
    latency_us: 5               # per ring step (alpha)
    inter_node_gbps: 20         # optional, see Machine.bandwidth
    reserved_memory_gb: 1       # optional, CUDA context, workspaces
    op_overhead_us: 8           # optional, time per launched op (dispatch, Python); 0 = ignored
    memory_gbps: 5              # optional, elementwise streaming GB/s per rank; absent = ignored
    overlap_efficiency: 0       # optional, legacy: 1 - (slowdowns - 1) below when they are absent
    gemm_half_dim: 128          # optional, GEMM shape curve (perfmodel.compute); 0 = none
    gemm_table:                 # optional, measured GEMMs (perfmodel profile)
      - {m: 4096, n: 4096, k: 1024, layout: nt, dtype: bfloat16, tflops: 201.5}
    attention_tflops: 150       # optional, measured causal attention fwd+bwd rate (axo4d FLOPs)
    fp8_gemm_ratio: 1.6         # optional, FP8 GEMM rate / bf16 rate where the table has no float8 rows (0 = no FP8)
    compute_slowdown: 1.1       # optional, GEMM time x this while a collective moves data
    comm_slowdown: 1.1          # optional, collective time x this while GEMMs run
    concurrent_slowdown: {intra: 1.3, inter: 1.8, mixed: 1.0}   # optional, two collectives of
                                # different groups at once, both in a node, both across, or one each
    compute_slowdown_by_link: {intra: 2.0, inter: 1.05}   # optional, per link class of the collective
    comm_slowdown_by_link: {intra: 2.0, inter: 1.02}      # in flight (else the two numbers above)
    uncertainty: 0.1            # optional, relative step-time error the model claims (ties)
    fs_write_gbps: 2            # optional, checkpoint writes to the file system, GB/s per node
                                # (perfmodel.saves; absent = saves.DEFAULT_FS_WRITE_GBPS)
    bandwidth:                  # GB/s (1e9 B/s); first matching entry wins
      - {stride: 1, size: 2, gbps: 76}
      - {stride: [2, 2], size: [3, null], gbps: 40}   # [min, max], null = no bound

``stride`` is the rank distance between neighbours of a group (the product of
the sizes of the grid axes ordered before its fastest axis, from
:meth:`axo4d.facts.grid.Grid.stride`); ``size`` is the number of ranks in the group.
The table must cover every stride >= 1 and size >= 2. An entry may carry
``by_kind: {reduce_scatter: {gbps: .., latency_us: ..}}`` overrides per
collective (``perfmodel profile`` writes its per-collective fits there).

Compute (:mod:`perfmodel.compute`): GEMMs at ``gemm_tflops * gemm_efficiency`` shaped by
``gemm_half_dim`` and corrected by a measured ``gemm_table``; attention at ``attention_tflops``;
``memory_gbps`` prices the elementwise traffic (norms, softmax, GELU, bias, residual, optimizer)
and ``op_overhead_us`` every operator launch (CPU ranks).

Overlap (:mod:`perfmodel.timeline`): while a collective moves data, GEMMs take
``compute_slowdown`` times longer and the collective ``comm_slowdown`` times longer (1 and 1:
perfect overlap; 2 and 2: both share one resource, nothing hides -- gloo on the cores that
compute), or per link class of the collective (``*_by_link``: a collective inside a node and
one across nodes can cost the processor that computes very differently -- on CPU ranks an
intra-node gloo collective is the cores' own copying, an inter-node one mostly waiting for the
wire); ``k`` collectives of different groups on the same kind of link (both inside a node:
``intra``, both crossing nodes: ``inter``) each take ``1 + (s - 1)(k - 1)`` times longer. Files
without any of these keys derive them all from ``overlap_efficiency`` ``e``: ``2 - e``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import yaml

from axo4d.facts.grid import Grid

from .collectives import KINDS
from .compute import DTYPES, LAYOUTS, GemmModel, GemmPoint

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
    """A machine: see the module docstring for the fields' meaning and units."""

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
    axis in the grid's order and the product of the axes' sizes."""
    axes = tuple(axes)
    fastest = min(axes, key=grid.stride)  # (the expert sub-axes of data have strides, no place in the order)
    return grid.stride(fastest), grid.size(*axes)


# ---- loading ----------------------------------------------------------------
def machine_names() -> list[str]:
    """Names of the bundled machine files."""
    return sorted(p.stem for p in MACHINE_DIR.glob("*.yaml"))


def _range(v: Any, key: str, where: str) -> Range:
    if isinstance(v, bool):
        raise MachineError(f"{where}: {key} must be an integer or [min, max], got {v!r}")
    if isinstance(v, int):
        return (v, v)
    if isinstance(v, (list, tuple)) and len(v) == 2:
        lo, hi = v
        if isinstance(lo, int) and not isinstance(lo, bool) and (hi is None or (isinstance(hi, int) and hi >= lo)):
            return (lo, hi)
    raise MachineError(f"{where}: {key} must be an integer or [min, max] (max null = unbounded), got {v!r}")


def _entry(row: Any, i: int, src: str) -> BandwidthEntry:
    where = f"machine {src}: bandwidth entry {i}"
    if not isinstance(row, dict):
        raise MachineError(f"{where} must be a mapping with keys stride, size, gbps")
    missing = [k for k in ("stride", "size", "gbps") if k not in row]
    if missing:
        raise MachineError(f"{where}: missing key(s) {', '.join(map(repr, missing))}")
    extra = sorted(set(row) - {"stride", "size", "gbps", "latency_us", "by_kind"})
    if extra:
        raise MachineError(f"{where}: unknown key {extra[0]!r}; valid: stride, size, gbps, latency_us, by_kind")
    gbps, lat = _link_numbers(row, where)
    return BandwidthEntry(
        _range(row["stride"], "stride", where),
        _range(row["size"], "size", where),
        gbps,
        lat,
        _by_kind(row.get("by_kind") or {}, where),
    )


def _link_numbers(row: dict, where: str) -> tuple[float, float | None]:
    gbps = row.get("gbps")
    if not isinstance(gbps, (int, float)) or isinstance(gbps, bool) or gbps <= 0:
        raise MachineError(f"{where}: gbps must be a number > 0, got {gbps!r}")
    lat = row.get("latency_us")
    if lat is not None and (not isinstance(lat, (int, float)) or isinstance(lat, bool) or lat < 0):
        raise MachineError(f"{where}: latency_us must be a number >= 0, got {lat!r}")
    return float(gbps), None if lat is None else float(lat)


def _by_kind(v: Any, where: str) -> tuple[tuple[str, float, float | None], ...]:
    if not isinstance(v, dict):
        raise MachineError(f"{where}: by_kind must map a collective to {{gbps, latency_us}}")
    out = []
    for kind, row in v.items():
        if kind not in KINDS or not isinstance(row, dict) or set(row) - {"gbps", "latency_us"}:
            raise MachineError(
                f"{where}: by_kind entry {kind!r} must be one of {', '.join(KINDS)} mapping to {{gbps, latency_us}}"
            )
        out.append((kind, *_link_numbers(row, f"{where}: by_kind {kind}")))
    return tuple(out)


def _number(data: dict, key: str, src: str, positive: bool = True) -> float:
    v = data[key]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or (positive and v <= 0) or v < 0:
        raise MachineError(f"machine {src}: {key} must be a {'positive ' if positive else ''}number, got {v!r}")
    return float(v)


def machine_from_dict(data: dict, src: str = "<dict>") -> Machine:
    """Build and validate a :class:`Machine` from a YAML mapping."""
    if not isinstance(data, dict):
        raise MachineError(f"machine {src}: must hold a mapping at the top level")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise MachineError(f"machine {src}: missing key(s) {', '.join(map(repr, missing))}")
    extra = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if extra:
        raise MachineError(f"machine {src}: unknown key {extra[0]!r}; valid keys: {', '.join(_REQUIRED + _OPTIONAL)}")
    gpn = data["gpus_per_node"]
    if not isinstance(gpn, int) or isinstance(gpn, bool) or gpn < 1:
        raise MachineError(f"machine {src}: gpus_per_node must be an integer >= 1, got {gpn!r}")
    rows = data["bandwidth"]
    if not isinstance(rows, list) or not rows:
        raise MachineError(f"machine {src}: bandwidth must be a non-empty list of entries")
    opt: dict[str, Any] = {
        k: _number(data, k, src, positive=k not in _ZERO_OK) for k in _NUMBERS if data.get(k) is not None
    }
    if data.get("gemm_table") is not None:
        opt["gemm_table"] = _gemm_table(data["gemm_table"], src)
    if data.get("concurrent_slowdown") is not None:
        opt["concurrent_slowdown"] = _concurrency(data["concurrent_slowdown"], src)
    for k in _BY_LINK:
        if data.get(k) is not None:
            opt[k] = _concurrency(data[k], src, k, ("intra", "inter"))
    m = Machine(
        name=str(data["name"]),
        gpus_per_node=gpn,
        device_memory_gb=_number(data, "device_memory_gb", src),
        gemm_tflops=_number(data, "gemm_tflops", src),
        latency_us=_number(data, "latency_us", src, positive=False),
        table=tuple(_entry(r, i, src) for i, r in enumerate(rows)),
        description=str(data.get("description", "")),
        source=str(data.get("source", "")),
        **opt,
    )
    if not 0 < m.gemm_efficiency <= 1:
        raise MachineError(f"machine {src}: gemm_efficiency must be in (0, 1], got {m.gemm_efficiency}")
    if not 0 <= m.overlap_efficiency <= 1:
        raise MachineError(f"machine {src}: overlap_efficiency must be in [0, 1], got {m.overlap_efficiency}")
    for k in ("compute_slowdown", "comm_slowdown"):
        v = getattr(m, k)
        if v is not None and v < 1:
            raise MachineError(f"machine {src}: {k} must be >= 1 (1 = unaffected), got {v}")
    if not 0 < m.uncertainty < 1:
        raise MachineError(f"machine {src}: uncertainty must be in (0, 1) (a relative error), got {m.uncertainty}")
    _check_coverage(m, src)
    return m


def _gemm_table(rows: Any, src: str) -> tuple[GemmPoint, ...]:
    if not isinstance(rows, list):
        raise MachineError(f"machine {src}: gemm_table must be a list of {{m, n, k, layout, dtype, tflops}}")
    out = []
    for i, r in enumerate(rows):
        where = f"machine {src}: gemm_table entry {i}"
        if not isinstance(r, dict) or set(r) != {"m", "n", "k", "layout", "dtype", "tflops"}:
            raise MachineError(f"{where} must have exactly the keys m, n, k, layout, dtype, tflops, got {r!r}")
        dims = [r[k] for k in ("m", "n", "k")]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
            raise MachineError(f"{where}: m, n, k must be integers >= 1, got {dims}")
        if r["layout"] not in LAYOUTS or r["dtype"] not in DTYPES:
            raise MachineError(
                f"{where}: layout must be one of {', '.join(LAYOUTS)} and dtype one of "
                f"{', '.join(DTYPES)}, got {r['layout']!r}, {r['dtype']!r}"
            )
        t = r["tflops"]
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t <= 0:
            raise MachineError(f"{where}: tflops must be a number > 0, got {t!r}")
        out.append(GemmPoint(*dims, r["layout"], r["dtype"], float(t)))
    return tuple(out)


def _concurrency(
    v: Any, src: str, key: str = "concurrent_slowdown", classes: tuple[str, ...] = LINK_CLASSES
) -> tuple[tuple[str, float], ...]:
    ok = (
        isinstance(v, dict)
        and set(v) <= set(classes)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 1 for x in v.values())
    )
    if not ok:
        names = ", ".join(classes[:-1]) + " and/or " + classes[-1]
        raise MachineError(f"machine {src}: {key} must map {names} to a number >= 1, got {v!r}")
    return tuple((k, float(x)) for k, x in v.items())


def _check_coverage(m: Machine, src: str) -> None:
    for stride in range(1, _COVER_MAX + 1):
        for size in range(2, _COVER_MAX + 1):
            if not any(e.matches(stride, size) for e in m.table):
                raise MachineError(
                    f"machine {src}: the bandwidth table must cover every stride >= 1 and size >= 2; "
                    f"no entry matches stride {stride}, size {size}"
                )


def resolve_machine_path(name_or_path: str | os.PathLike) -> Path:
    """A bundled machine name (``perlmutter``) or a YAML path."""
    from axo4d.config import resolve_named_yaml

    return resolve_named_yaml(name_or_path, MACHINE_DIR, "machine", MachineError)


def load_machine(name_or_path: str | os.PathLike) -> Machine:
    """Load a bundled machine by name or a machine YAML file by path."""
    path = resolve_machine_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise MachineError(f"cannot read machine file {str(path)!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise MachineError(f"machine file {str(path)!r} is not valid YAML: {e}") from None
    return machine_from_dict(device_facts(data, repr(str(path))), src=repr(str(path)))


def device_facts(data: Any, src: str) -> Any:
    """A machine file's ``device: NAME`` replaced by ``gemm_tflops``: that accelerator's measured bf16
    GEMM ceiling in :mod:`axo4d.facts.devices` (the one table the trainer and ``launch.job`` read)."""
    if not isinstance(data, dict) or "device" not in data:
        return data
    from axo4d.facts.devices import gemm_ceiling

    name = str(data["device"])
    ceiling, _ = gemm_ceiling(name)
    if not ceiling:
        raise MachineError(f"machine {src}: device {name!r} has no measured GEMM ceiling in axo4d/facts/devices.py")
    from axo4d.facts.devices import vendor_peak

    out = {**{k: v for k, v in data.items() if k != "device"}, "gemm_tflops": data.get("gemm_tflops", ceiling)}
    out.setdefault("vendor_tflops", vendor_peak(name)[0] or None)  # MFU and HFU are against it
    return out


def dump_machine(machine: Machine, path: str | os.PathLike, header: str = "") -> None:
    """Write ``machine`` as YAML (``header`` lines become comments)."""
    text = "".join(f"# {line}\n" for line in header.splitlines())
    text += yaml.safe_dump(machine.to_dict(), sort_keys=False, default_flow_style=None)
    Path(path).write_text(text)


__all__ = [
    "Machine",
    "MachineError",
    "BandwidthEntry",
    "load_machine",
    "machine_names",
    "machine_from_dict",
    "dump_machine",
    "group_link",
    "GIB",
]
