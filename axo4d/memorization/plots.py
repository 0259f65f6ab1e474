"""The report's plots, from the per-document records alone (so ``render`` redraws them): exact and
token match against epochs (``exact_match.png``) and, for a size sweep, against parameter count
(``sizes.png``). PNGs are written without a software tag, so the same records give the same bytes."""

from __future__ import annotations

from pathlib import Path

from axo4d.memorization.stats import cell, epochs_to_reach, measured_epochs

PNG = {"dpi": 110, "metadata": {"Software": None}}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_exact_match(
    all_recs: list[dict], names: list[str], arms: list[str], epochs: int, png: Path, suffix: int = 50
) -> None:
    """Exact match (top) and token match (bottom) against epochs: per arm the treated buckets (solid)
    and the control (dashed), 95% intervals shaded; one column per size."""
    import matplotlib.ticker

    plt = _pyplot()
    fig, axes = plt.subplots(2, len(names), figsize=(6.4 * len(names), 7.2), squeeze=False, sharex=True)
    xs = measured_epochs(all_recs, epochs)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for col, name in enumerate(names):
        recs = [r for r in all_recs if r["size"] == name]
        for i, arm in enumerate(arms):
            for bucket, style in (("treated", "-"), ("control", "--")):
                cells = [cell(recs, arm, bucket, e) for e in xs]
                label = f"{arm}, {'treated' if bucket == 'treated' else 'control (never trained)'}"
                for row, (ys, lo, hi) in enumerate(
                    (
                        ([c.rate for c in cells], [c.interval[0] for c in cells], [c.interval[1] for c in cells]),
                        ([c.token[0] for c in cells], [c.token[1] for c in cells], [c.token[2] for c in cells]),
                    )
                ):
                    ax = axes[row][col]
                    ax.plot(xs, ys, style, marker="o", ms=3, color=colours[i % len(colours)], label=label)
                    ax.fill_between(xs, lo, hi, color=colours[i % len(colours)], alpha=0.15 if style == "-" else 0.08)
        axes[0][col].set_title(f"{name} ({recs[0]['params'] / 1e6:.3g}M parameters)")
        axes[0][col].set_ylabel(f"exact match (all {suffix} tokens)")
        axes[1][col].set_ylabel("token match rate")
        axes[1][col].set_xlabel("epochs of training on the treated buckets")
        for ax in axes[:, col]:
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "Memorization: greedy continuation of each document's prefix\n"
        "(95% intervals over documents: Wilson at the effective n, documents as clusters)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, **PNG)
    plt.close(fig)


def plot_sizes(all_recs: list[dict], names: list[str], arms: list[str], epochs: int, png: Path) -> None:
    """Against parameter count: exact match of the treated documents after one and after ``epochs``
    epochs (left), and the epochs to reach half of them matched (right; an arrow at the last
    epoch: not reached)."""
    import matplotlib.ticker

    plt = _pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12.8, 4.8))
    params = [next(r["params"] for r in all_recs if r["size"] == n) for n in names]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(arms):
        colour = colours[i % len(colours)]
        for e, style in ((1, ":"), (epochs, "-")):
            cells = [cell([r for r in all_recs if r["size"] == n], arm, "treated", e) for n in names]
            err = [[c.rate - c.interval[0] for c in cells], [c.interval[1] - c.rate for c in cells]]
            ax.errorbar(
                params,
                [c.rate for c in cells],
                yerr=err,
                fmt=style + "o",
                capsize=3,
                color=colour,
                label=f"{arm}, after {e} epoch{'s' if e > 1 else ''}",
            )
        reach = [epochs_to_reach([r for r in all_recs if r["size"] == n], arm) for n in names]
        shift = 1.07 ** (i - (len(arms) - 1) / 2)  # arms side by side
        for p, r in zip((p * shift for p in params), reach):
            if r.epoch is None:
                ax2.annotate("", (p, epochs * 1.08), (p, epochs), arrowprops={"arrowstyle": "->", "color": colour})
                ax2.plot([p], [epochs], "v", color=colour)
            else:
                hi = epochs if r.high is None else r.high
                ax2.errorbar([p], [r.epoch], yerr=[[r.epoch - r.low], [hi - r.epoch]], fmt="o", capsize=3, color=colour)
        ax2.plot([], [], "o", color=colour, label=f"{arm} (triangle: not reached in {epochs})")
    ctl = [cell([r for r in all_recs if r["size"] == n], arms[0], "control", epochs) for n in names]
    ax.plot(params, [c.rate for c in ctl], "--x", color="gray", label=f"control ({arms[0]} arm), epoch {epochs}")
    for a in (ax, ax2):
        a.set_xscale("log")
        a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        a.set_xlabel("parameters")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    ax.set_ylabel("exact match of treated documents")
    ax.set_ylim(-0.02, 1.02)
    ax2.set_ylabel("epochs to reach half of the treated documents matched")
    ax2.set_ylim(0, epochs * 1.12)
    fig.tight_layout()
    fig.savefig(png, **PNG)
    plt.close(fig)
