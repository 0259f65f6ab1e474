"""Weak-scaling tables: the runs of a series (a ``manifest.json`` that :mod:`launch.weak_scaling`'s
``generate`` or ``local`` wrote) read from their ``metrics.jsonl`` into rows -- measured beside
predicted, weak-scaling efficiency against the smallest point -- written as Markdown, CSV and a
plot (:func:`collect`). The definitions of every column: ``jobs/README.md``.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path


class WeakScalingError(ValueError):
    """A weak-scaling series that cannot be built or collected."""


@dataclass
class Row:
    """One point of the table; measured fields are None when the run has no usable metrics."""

    gpus: int
    model: str
    grid: str
    steps: int = 0
    step_time_s: float | None = None
    tflops_per_gpu: float | None = None
    peak_tflops: float | None = None
    pred_step_time_s: float | None = None
    pred_tflops_per_gpu: float | None = None
    efficiency: float | None = None
    note: str = ""

    @property
    def pct_peak(self) -> float | None:
        ok = self.tflops_per_gpu is not None and self.peak_tflops
        return 100 * self.tflops_per_gpu / self.peak_tflops if ok else None


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a ``metrics.jsonl`` (one JSON object per line)."""
    recs = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise WeakScalingError(f"{path}:{i}: not a JSON object ({e.msg})") from None
    return recs


def summarize(records: list[dict], skip: int) -> dict | None:
    """Mean step time and TFLOP/s per GPU after the first ``skip`` steps (None if none are left).

    TFLOP/s per GPU = mean(TFLOP per GPU per step) / mean(step time), the per-step TFLOP being
    ``tflops_per_device * step_time_s`` of each record (the trainer's FLOP count).
    """
    kept = sorted((r for r in records if "step_time_s" in r), key=lambda r: r.get("step", 0))[skip:]
    if not kept:
        return None
    t = sum(r["step_time_s"] for r in kept) / len(kept)
    flop = sum(r.get("tflops_per_device", 0.0) * r["step_time_s"] for r in kept) / len(kept)
    return {
        "steps": len(kept),
        "step_time_s": t,
        "tflop_per_step": flop,
        "tflops_per_gpu": flop / t,
        # the vendor's peak on a GPU; a CPU has none, then the GEMM rate the run measured at start-up
        "peak_tflops": kept[-1].get("peak_tflops") or kept[-1].get("gemm_ceiling_tflops"),
        "grid": kept[-1].get("grid"),
    }


def collect_rows(
    points: list[tuple[int, str, str, Path, dict | None]], skip: int, default_peak: float | None = None
) -> list[Row]:
    """Rows for ``(gpus, model, grid, run_dir, prediction)`` points, sorted by GPUs, with
    weak-scaling efficiency relative to the smallest measured point."""
    rows = []
    for gpus, model, grid, run_dir, pred in sorted(points, key=lambda p: p[0]):
        row, mfile = Row(gpus, model, grid), Path(run_dir) / "metrics.jsonl"
        s = summarize(read_metrics(mfile), skip) if mfile.is_file() else None
        if s is None:
            row.note = "no metrics.jsonl" if not mfile.is_file() else f"no steps after skipping {skip}"
        else:
            row.steps, row.step_time_s, row.tflops_per_gpu = s["steps"], s["step_time_s"], s["tflops_per_gpu"]
            row.grid = s["grid"] or grid
            row.peak_tflops = s["peak_tflops"] or default_peak
        if pred:
            row.pred_step_time_s = pred["step_time_s"]
            row.pred_tflops_per_gpu = s["tflop_per_step"] / pred["step_time_s"] if s else pred.get("tflops_per_gpu")
            row.peak_tflops = row.peak_tflops or pred.get("gemm_tflops")
        rows.append(row)
    ref = next((r for r in rows if r.tflops_per_gpu), None)
    for r in rows:
        if ref and r.tflops_per_gpu is not None:
            r.efficiency = r.tflops_per_gpu / ref.tflops_per_gpu
    return rows


COLUMNS = (
    "GPUs",
    "model",
    "grid",
    "steps",
    "time/step (s)",
    "predicted (s)",
    "TFLOP/s/GPU",
    "predicted TFLOP/s/GPU",
    "% of peak",
    "weak-scaling eff.",
)


def _cells(r: Row) -> list[str]:
    def f(v: float | None, fmt: str) -> str:
        return "—" if v is None else format(v, fmt)

    return [
        str(r.gpus),
        r.model,
        r.grid,
        str(r.steps or "—"),
        f(r.step_time_s, ".4g"),
        f(r.pred_step_time_s, ".4g"),
        f(r.tflops_per_gpu, ".4g"),
        f(r.pred_tflops_per_gpu, ".4g"),
        f(r.pct_peak, ".1f"),
        "—" if r.efficiency is None else f"{100 * r.efficiency:.1f}%",
    ]


def markdown(rows: list[Row], title: str, extra: tuple[str, ...] = ()) -> str:
    """The table as markdown, with a note on how each column is computed."""
    lines = [f"## {title}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    notes = [f"GPUs {r.gpus}: {r.note}" for r in rows if r.note]
    lines += (
        [
            "",
            "time/step: mean over the steps after the warm-up ones; TFLOP/s/GPU: the trainer's FLOPs "
            "per step / mean step time / GPUs; % of peak: of the peak in metrics.jsonl; weak-scaling eff.: "
            "TFLOP/s/GPU relative to the smallest measured point; predicted: perfmodel step time (predicted "
            "TFLOP/s/GPU uses the same FLOP count as the measurement).",
        ]
        + notes
        + list(extra)
    )
    return "\n".join(lines)


def write_csv(rows: list[Row], path: str | os.PathLike) -> None:
    keys = (
        "gpus",
        "model",
        "grid",
        "steps",
        "step_time_s",
        "pred_step_time_s",
        "tflops_per_gpu",
        "pred_tflops_per_gpu",
        "pct_peak",
        "efficiency",
        "note",
    )
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for r in rows:
            w.writerow(["" if getattr(r, k) is None else getattr(r, k) for k in keys])


def plot(rows: list[Row], path: str | os.PathLike, title: str) -> None:
    """Measured and predicted TFLOP/s per GPU against GPUs (log2 axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for attr, style, label in (("tflops_per_gpu", "o-", "measured"), ("pred_tflops_per_gpu", "s--", "predicted")):
        pts = [(r.gpus, getattr(r, attr)) for r in rows if getattr(r, attr) is not None]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    for r in rows if len({r.model for r in rows}) > 1 else ():
        y = r.tflops_per_gpu if r.tflops_per_gpu is not None else r.pred_tflops_per_gpu
        if y is not None:
            ax.annotate(r.model, (r.gpus, y), textcoords="offset points", xytext=(4, 6), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xticks([r.gpus for r in rows], [str(r.gpus) for r in rows])
    ax.set_xlabel("GPUs (ranks)")
    ax.set_ylabel("TFLOP/s per GPU")
    ys = [v for r in rows for v in (r.tflops_per_gpu, r.pred_tflops_per_gpu) if v]
    if ys and max(ys) > 20 * min(ys):
        ax.set_yscale("log")  # measured and predicted far apart: keep both readable
    else:
        ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(rows: list[Row], prefix: Path, title: str, notes: tuple[str, ...] = ()) -> None:
    """``prefix.md``, ``prefix.csv``, ``prefix.png``; the markdown is also printed."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, title, notes)
    Path(f"{prefix}.md").write_text(md + "\n")
    write_csv(rows, f"{prefix}.csv")
    plot(rows, f"{prefix}.png", title)
    print(md)
    print(f"\nwrote {prefix}.md, {prefix}.csv, {prefix}.png")


def rows_from_manifest(manifest: dict, skip: int) -> list[Row]:
    """Table rows for the points of a ``generate`` (or ``local``) manifest."""
    return collect_rows(
        [(p["gpus"], p["model"], p["grid"], Path(p["run_dir"]), p.get("prediction")) for p in manifest["points"]],
        skip=skip,
        default_peak=manifest.get("peak_tflops"),
    )


def collect(
    target: str | os.PathLike, skip: int = 2, out: str | os.PathLike | None = None, docs: str | None = None
) -> list[Row]:
    """Collect a manifest directory (``generate``/``local`` output) into table, CSV and plot
    (``out`` prefix, default ``DIR/weak_scaling``); ``docs``: also ``docs.md`` and ``docs.png``."""
    d = Path(target)
    mf = d / "manifest.json"
    if not mf.is_file():
        raise WeakScalingError(f"{mf} not found: give the directory written by `generate` or `local`")
    manifest = json.loads(mf.read_text())
    rows = rows_from_manifest(manifest, skip)
    title = manifest.get("title") or f"Weak scaling on {manifest['machine']}"
    notes = tuple(manifest.get("notes", ()))
    write_outputs(rows, Path(out) if out else d / "weak_scaling", title=title, notes=notes)
    if docs:
        Path(docs).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{docs}.md").write_text(markdown(rows, title, notes) + "\n")
        plot(rows, f"{docs}.png", title)
        print(f"wrote {docs}.md, {docs}.png")
    return rows
