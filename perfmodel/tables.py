"""Text rendering of estimates: the ``rank`` table and the ``explain`` detail."""

from __future__ import annotations

import re
from collections import Counter

from axo4d.facts.grid import Grid

from .expert_pricing import grid_label
from .machine import GIB, Machine, group_link
from .model import Estimate

MB = 1e6


def _table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    right = right if right is not None else set(range(1, len(headers)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _pct(v: float, peak: float) -> str:
    return f"{100 * v:.1f}%" if peak else "n/a"


def _row(e: Estimate, status: bool = True) -> list[str]:
    cells = [
        grid_label(e.grid.spec(), e.expert) + (" seq" if e.z_split == "sequence" else ""),
        ",".join(e.grid.order),
        "on" if e.checkpointing else "off",
        str(e.cached_blocks),
        f"{e.step_time_s:.3f}",
        f"{e.compute_s:.3f}",
    ]
    cells += [f"{e.exposed_by_axis.get(a, 0.0):.3f}" for a in ("x", "y", "z", "data")]
    cells += [
        f"{e.contention_s:.3f}",
        f"{e.memory_bytes['total'] / GIB:.1f}",
        f"{e.model_tflops_per_gpu:.1f}",
        _pct(e.mfu, e.vendor_tflops),
        _pct(e.hfu, e.vendor_tflops),
        f"{100 * e.ceiling_fraction:.0f}%",
        "tie" if e.tie else "",
    ]
    if status:
        notes = [f"sequence split: {e.z_split_note}"] * bool(e.z_split_note)
        notes += [f"x and y exchanged: runs as {e.runs_as}"] * bool(e.runs_as)
        ok = f"ok ({'; '.join(notes)})" if notes else "ok"
        cells.append(ok if e.feasible else e.reason)
    return cells


RANK_HEADERS = [
    "grid",
    "order",
    "ckpt",
    "cache",
    "step_s",
    "compute_s",
    "exp_x",
    "exp_y",
    "exp_z",
    "exp_data",
    "contend_s",
    "mem_GiB",
    "TFLOP/s",
    "MFU",
    "HFU",
    "ceil",
    "tie",
]
"""``grid ... seq``: z splits every sample's sequence (``parallel.z_split=sequence``);
``exp_*``: seconds the compute stream waits for that axis's collectives; ``contend_s``: compute
slowed by concurrent collectives; ``TFLOP/s``: model FLOPs (no recomputation) per second per GPU;
``MFU``: that over the vendor's dense bf16 peak (the machine's ``vendor_tflops``); ``HFU``: the
same counting the recomputed FLOPs; ``ceil``: hardware FLOPs (recomputation counted) as a share of
the machine's *measured* GEMM ceiling ``gemm_tflops`` -- not a utilisation; ``cache``: blocks whose
weights are kept for backward; ``tie``:
within the machine's stated uncertainty of the best grid."""


def rank_text(ests: list[Estimate], header: str, show_infeasible: int = 5) -> str:
    """The ``rank`` table: feasible grids best first, then a few infeasible ones."""
    feas = [e for e in ests if e.feasible]
    infeas = [e for e in ests if not e.feasible]
    lines = [header, ""]
    if feas:
        lines.append(
            _table(
                ["#"] + RANK_HEADERS + ["status"],
                [[str(i + 1)] + _row(e) for i, e in enumerate(feas)],
                right=set(range(0, len(RANK_HEADERS))) - {1, 2},
            )
        )
        ties = [e for e in feas if e.tie]
        if len(ties) > 1:
            lines += [
                "",
                f"{len(ties)} grids marked 'tie' are within the model's stated uncertainty "
                f"({100 * feas[0].uncertainty:.0f}% of step time) of the best: the model cannot order them; "
                f"measure them (python -m axo4d.train --grid ...) or pick by other criteria (memory).",
            ]
    else:
        lines.append("no feasible grid.")
    if infeas:
        lines += ["", f"{len(infeas)} infeasible grid(s); most common reasons:"]
        kinds = Counter(_reason_kind(r) for e in infeas for r in e.reason.split("; "))
        lines += [f"  {n:4d} x {k}" for k, n in kinds.most_common(6)]
        if show_infeasible > 0:
            lines += ["", f"first {min(show_infeasible, len(infeas))} infeasible grid(s):"]
            lines.append(
                _table(
                    RANK_HEADERS + ["reason"],
                    [_row(e) for e in infeas[:show_infeasible]],
                    right=set(range(3, len(RANK_HEADERS))),
                )
            )
    return "\n".join(lines)


def _reason_kind(reason: str) -> str:
    """Group reasons by kind ('memory ...', 'n_head=56 not divisible by G_y=16' -> 'n_head not divisible by G_y')."""
    if reason.startswith("memory "):
        return "does not fit in memory"
    words = [w.split("=")[0] for w in re.sub(r"\s*\(.*?\)", "", reason).split()]
    return " ".join(words)


def explain_text(e: Estimate, machine: Machine, header: str) -> str:
    """One grid in detail: every collective, compute, overlap, memory."""
    g = e.grid
    lines = [
        header,
        f"grid {g.spec()}  order {','.join(g.order)}  checkpointing "
        f"{'on' if e.checkpointing else 'off'}  overlap {'on' if e.overlap else 'off'}  z_split {e.z_split}"
        + (f" ({e.z_split_note})" if e.z_split_note else "")
        + (f"; x and y exchanged: runs as {e.runs_as}" if e.runs_as else ""),
        "",
    ]
    lines += _link_lines(g, machine)
    lines += ["", "collectives (per rank per step; MB = 1e6 bytes, logical message size):"]
    lines += _collective_lines(e)
    lines += ["", *_compute_lines(e, machine), "", "memory per GPU (GiB):"]
    for k, v in e.memory_bytes.items():
        lines.append(f"  {k:12s} {v / GIB:10.3f}")
    lines.append(f"  {'limit':12s} {e.memory_limit_bytes / GIB:10.3f}")
    lines += ["", "bytes per rank per step (group:kind, logical message sizes):"]
    for (grp, kind), v in sorted(e.bytes_per_rank.items()):
        lines.append(f"  {grp + ':' + kind:26s} {v / MB:14.3f} MB")
    lines += ["", "feasible" if e.feasible else f"INFEASIBLE: {e.reason}"]
    return "\n".join(lines)


def _link_lines(g: Grid, machine: Machine) -> list[str]:
    """Each group's link: the stride of its fastest axis, its size and its bandwidth."""
    lines = ["group links (stride of the fastest axis, size, bandwidth):"]
    for axes in (("x",), ("y",), ("z",), ("data",), ("data", "z")):
        stride, p = group_link(g, axes)
        bw = f"{machine.bandwidth(stride, p):g} GB/s" if p > 1 else "-"
        lines.append(f"  {','.join(axes):7s} stride {stride:6d}  size {p:6d}  {bw}")
    return lines


def _collective_lines(e: Estimate) -> list[str]:
    """The table of every collective of a group of more than one rank (one line: none)."""
    rows = []
    for c, reps, t1 in e.details:
        if group_link(e.grid, c.axes)[1] == 1:
            continue
        rows.append(
            [
                c.layer, c.phase, ",".join(c.axes), c.kind, f"{c.nbytes / MB:.3f}", str(reps),
                f"{1e3 * t1:.3f}", f"{1e3 * t1 * reps:.2f}", c.pool,
            ]
        )  # fmt: skip
    if not rows:
        return ["  none (single GPU)"]
    headers = ["layer", "phase", "group", "kind", "MB/call", "calls", "ms/call", "ms/step", "overlap"]
    return [_table(headers, rows, right={4, 5, 6, 7})]


def _compute_lines(e: Estimate, machine: Machine) -> list[str]:
    """Compute as priced alone, the machine's rates, communication alone and exposed, overlap, the
    step and its FLOP rates."""
    cd = e.compute_detail
    g_, c_, conc = machine.slowdowns()
    gm = machine.gemm_model
    return [
        f"compute (as priced alone): forward {cd['forward_s']:.4f} s, backward {cd['backward_s']:.4f} s, "
        f"recompute {cd['recompute_s']:.4f} s (of which attention, on each rank's heads: {cd['attention_s']:.4f} s), "
        f"optimizer {cd.get('other_s', 0.0):.4f} s; total {e.compute_s:.4f} s",
        f"GEMMs: {len(gm.points)} measured shapes, shape curve {machine.gemm_tflops:g} x "
        f"{machine.gemm_efficiency:g} TFLOP/s, half-speed dimension {machine.gemm_half_dim:g}; attention "
        + (f"{machine.attention_tflops:g} TFLOP/s (measured)" if machine.attention_tflops else "at the GEMM rate")
        + f"; elementwise {machine.memory_gbps or 0:g} GB/s",
        "communication per axis, alone: "
        + ", ".join(f"{a} {v:.4f} s" for a, v in e.comm_s.items())
        + f"; total {e.comm_total_s:.4f} s",
        "exposed (compute stream waiting) per axis: "
        + ", ".join(f"{a} {v:.4f} s" for a, v in e.exposed_by_axis.items())
        + f"; total {e.exposed_comm_s:.4f} s; compute slowed by concurrent collectives {e.contention_s:.4f} s",
        f"overlap: compute x{g_:g} and collectives x{c_:g} while both run; concurrent collectives "
        f"x{conc['intra']:g} (in a node), x{conc['inter']:g} (across nodes); weights cached for backward "
        f"in the last {e.cached_blocks} block(s)" + (" and the head" if e.cached_blocks else ""),
        f"step {e.step_time_s:.4f} s; {e.flops_per_step / 1e15:.2f} PFLOP/step; "
        f"{e.model_tflops_per_gpu:.1f} model TFLOP/s per GPU (MFU {_pct(e.mfu, e.vendor_tflops)} of the vendor's "
        f"{e.vendor_tflops:g}), {e.tflops_per_gpu:.1f} with recomputation (HFU {_pct(e.hfu, e.vendor_tflops)}; "
        f"{100 * e.ceiling_fraction:.1f}% of the measured GEMM ceiling {machine.gemm_tflops:g})",
    ]
