"""Loss curves from ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(training records, validation records) of a metrics.jsonl file."""
    train, val = [], []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "val_loss" in rec or "loss" in rec:  # not the harness's scores (eval.tasks)
                (val if "val_loss" in rec else train).append(rec)
    return train, val


def plot_loss(metrics: str | Path, png: str | Path, title: str = "", ref_lines: dict | None = None) -> Path:
    """Training and validation loss against step; ``ref_lines``: label -> y of horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = read_metrics(metrics)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=1)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    for label, y in (ref_lines or {}).items():
        ax.axhline(y, ls="--", color="gray", lw=1)
        ax.text(0, y, f" {label}", va="bottom", fontsize=8, color="gray")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
