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
from pathlib import Path
from typing import Any

import yaml

from .collectives import KINDS
from .compute import DTYPES, LAYOUTS, GemmPoint
from .machine_types import (
    _BY_LINK,
    _COVER_MAX,
    _NUMBERS,
    _OPTIONAL,
    _REQUIRED,
    _ZERO_OK,
    GIB,
    LINK_CLASSES,
    MACHINE_DIR,
    BandwidthEntry,
    Machine,
    MachineError,
    Range,
    group_link,
    group_span,
)


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
    "group_span",
    "GIB",
]
