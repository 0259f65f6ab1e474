"""The report folder: ``report.md``, ``exact_match.png``, ``sizes.png`` (a size sweep),
``per_document.jsonl`` and ``config.yaml``. Everything in it is computed from the per-document
records (:mod:`axo4d.memorization.stats`); the summary sentences are comparisons of intervals, not
words chosen after the fact."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from axo4d.memorization.stats import Cell, cell, fmt_rate, measured_epochs

DECODING = (
    "greedy (argmax of the logits gathered over the whole vocabulary; ties go to the lowest id); "
    "prompt = the document's first {prefix} tokens, exactly as they were trained (with the "
    "tokenizer's begin-of-text token if it adds one); {suffix} new tokens always generated (no "
    "stop at an end-of-text token, nothing truncated), in the training compute dtype ({dtype}); "
    "exact match = all {suffix} equal to the document's tokens {prefix}..{end}; token match = the "
    "fraction of the {suffix} positions equal"
)


def records(result, sources: list[str]) -> list[dict]:
    """One record per (seed, arm, document) of a size's result (lines of per_document.jsonl)."""
    out = []
    for run in result.runs:
        for doc, bucket in enumerate(run.buckets):
            out.append(
                {
                    "size": result.name,
                    "params": result.params,
                    "seed": run.seed,
                    "arm": run.arm,
                    "goldfish_k": run.k,
                    "doc": doc,
                    "source": sources[doc],
                    "bucket": bucket,
                    "epochs": list(run.epochs),
                    "exact": [int(x) for x in run.exact[:, doc]],
                    "token_match": [round(float(x), 4) for x in run.token[:, doc]],
                }
            )
    return out


def relation(a: Cell, control: Cell) -> str:
    lo, hi = control.interval
    if a.interval[0] > hi:
        return "above the control's interval"
    if lo <= a.rate <= hi:
        return "within the control's interval"
    if a.rate < lo:
        return "below the control's interval"
    return "above the control's interval, with overlapping intervals"


def _summary(recs: list[dict], arms: list[str], epochs: int) -> list[str]:
    lines = [
        "| arm | treated, epoch "
        f"{epochs} | treated, before training | newly matched since epoch 0 | "
        f"control, epoch {epochs} | control, before training |",
        "|---|---|---|---|---|---|",
    ]
    notes = []
    for arm in arms:
        t, c = cell(recs, arm, "treated", epochs), cell(recs, arm, "control", epochs)
        t0, c0 = cell(recs, arm, "treated", 0), cell(recs, arm, "control", 0)
        lines.append(
            f"| {arm} | {fmt_rate(t.rate, t.interval)} | {fmt_rate(t0.rate, t0.interval)} | "
            f"{fmt_rate(t.new / t.n, t.new_interval)} | {fmt_rate(c.rate, c.interval)} | "
            f"{fmt_rate(c0.rate, c0.interval)} |"
        )
        notes.append(
            f"- **{arm}**: treated {t.rate:.3f} ({t.k}/{t.n}) after {epochs} epochs is "
            f"{relation(t, c)} [{c.interval[0]:.3f}, {c.interval[1]:.3f}]; the control, "
            f"{c.rate:.3f} ({c.k}/{c.n}), is {_stays(c, c0)} its epoch-0 interval "
            f"[{c0.interval[0]:.3f}, {c0.interval[1]:.3f}] ({c.new} control documents newly matched, "
            f"{c.lost} lost)."
        )
    return lines + [""] + notes


def _stays(c: Cell, c0: Cell) -> str:
    lo, hi = c0.interval
    return "within" if lo <= c.rate <= hi else ("above" if c.rate > hi else "below")


def _table(recs: list[dict], arm: str, buckets: list[str], epochs: int) -> list[str]:
    lines = [
        "| epoch | bucket | exact match [95% CI] | per seed | before training | difference | newly matched "
        "[95% CI] | lost | token match [95% CI] |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in measured_epochs(recs, epochs):
        for b in buckets + ["treated"]:
            c = cell(recs, arm, b, e)
            name = "**all treated**" if b == "treated" else b
            lines.append(
                f"| {e} | {name} | {fmt_rate(c.rate, c.interval)} | "
                f"{', '.join(f'{x:.2f}' for x in c.per_seed)} | {c.base:.3f} | {c.delta:+.3f} | "
                f"{fmt_rate(c.new / c.n, c.new_interval)} | {c.lost} | {fmt_rate(c.token[0], c.token[1:])} |"
            )
    return lines


def _sizes_table(all_recs: list[dict], names: list[str], arms: list[str], epochs: int) -> list[str]:
    lines = [
        "| size | parameters | arm | treated before training | after 1 epoch | after "
        f"{epochs} epochs | control after {epochs} |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in names:
        recs = [r for r in all_recs if r["size"] == name]
        for arm in arms:
            c0, c1, ce = (cell(recs, arm, "treated", e) for e in (0, 1, epochs))
            ctl = cell(recs, arm, "control", epochs)
            lines.append(
                f"| {name} | {recs[0]['params']:,} | {arm} | {fmt_rate(c0.rate, c0.interval)} | "
                f"{fmt_rate(c1.rate, c1.interval)} | {fmt_rate(ce.rate, ce.interval)} | "
                f"{fmt_rate(ctl.rate, ctl.interval)} |"
            )
    return lines


def plot_exact_match(all_recs: list[dict], names: list[str], arms: list[str], epochs: int, png: Path) -> None:
    """Exact match (top) and token match (bottom) against epochs: per arm the treated buckets (solid)
    and the control (dashed), 95% intervals shaded; one column per size."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        axes[0][col].set_ylabel("exact match (all 50 tokens)")
        axes[1][col].set_ylabel("token match rate")
        axes[1][col].set_xlabel("epochs of training on the treated buckets")
        for ax in axes[:, col]:
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(
        "Memorization: greedy continuation of each document's prefix\n(95% intervals over documents x seeds)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_sizes(all_recs: list[dict], names: list[str], arms: list[str], epochs: int, png: Path) -> None:
    """Exact match after one and after ``epochs`` epochs against parameter count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    params = [next(r["params"] for r in all_recs if r["size"] == n) for n in names]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(arms):
        for e, style in ((1, ":"), (epochs, "-")):
            cells = [cell([r for r in all_recs if r["size"] == n], arm, "treated", e) for n in names]
            ys = [c.rate for c in cells]
            err = [[c.rate - c.interval[0] for c in cells], [c.interval[1] - c.rate for c in cells]]
            ax.errorbar(
                params,
                ys,
                yerr=err,
                fmt=style + "o",
                capsize=3,
                color=colours[i % len(colours)],
                label=f"{arm}, after {e} epoch{'s' if e > 1 else ''}",
            )
    ctl = [cell([r for r in all_recs if r["size"] == n], arms[0], "control", epochs) for n in names]
    ax.plot(params, [c.rate for c in ctl], "--x", color="gray", label=f"control ({arms[0]} arm), epoch {epochs}")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("exact match of treated documents")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write_report(out: Path, meta: dict, all_recs: list[dict]) -> Path:
    """Every file of the report folder from ``meta`` (settings, counts, timings) and the records."""
    out.mkdir(parents=True, exist_ok=True)
    study, names, arms = meta["study"], meta["sizes"], meta["arms"]
    epochs, buckets = study["epochs"], meta["buckets"]
    with open(out / "per_document.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in all_recs)
    with open(out / "config.yaml", "w") as f:
        yaml.safe_dump(
            {
                "command": meta["command"],
                "study": study,
                "run": meta["run"],
                "sizes": names,
                "decoding": meta["decoding"],
            },
            f,
            sort_keys=False,
        )
    plot_exact_match(all_recs, names, arms, epochs, out / "exact_match.png")
    if len(names) > 1:
        plot_sizes(all_recs, names, arms, epochs, out / "sizes.png")
    lines = [
        "# Memorization study",
        "",
        f"`{meta['command']}`",
        "",
        f"Grid {meta['grid']} ({meta['world_size']} ranks, {meta['device']}); wall time "
        f"{meta['seconds'] / 60:.1f} min. Written by `python -m axo4d.memorization` (docs/design.md section 8).",
        "",
    ]
    for name in names:
        recs = [r for r in all_recs if r["size"] == name]
        size = meta["per_size"][name]
        lines += [
            f"## Result: {name} ({recs[0]['params']:,} parameters)",
            "",
            f"Exact match of the last {study['suffix']} tokens after {epochs} epochs, pooled over seeds "
            f"{study['seeds']} ({_n(recs, 'treated')} treated and {_n(recs, 'control')} control "
            f"document-seed pairs per arm); 95% Wilson intervals over documents x seeds.",
            "",
        ]
        lines += _summary(recs, arms, epochs) + [""]
        lines += [f"Starting model: {size['start']}.", ""]
    lines += ["![exact match against epochs](exact_match.png)", ""]
    if len(names) > 1:
        lines += [
            "## Size sweep",
            "",
            *_sizes_table(all_recs, names, arms, epochs),
            "",
            "![exact match against parameters](sizes.png)",
            "",
        ]
    lines += _protocol(meta)
    for name in names:
        recs = [r for r in all_recs if r["size"] == name]
        for arm in arms:
            lines += [f"## {name}: {arm}, every bucket and epoch", "", *_table(recs, arm, buckets, epochs), ""]
    (out / "report.md").write_text("\n".join(lines))
    return out / "report.md"


def _n(recs: list[dict], bucket: str) -> int:
    arm = recs[0]["arm"]
    return cell(recs, arm, bucket, 0).n


def _protocol(meta: dict) -> list[str]:
    s, c = meta["study"], meta["counts"]
    lines = [
        "## Protocol",
        "",
        f"- **Documents.** Source `{meta['source']}`, tokenizer `{meta['tokenizer']}`. A document is "
        f"{s['prefix']} + {s['suffix']} = {s['prefix'] + s['suffix']} tokens: "
        + (
            "each source document cut into consecutive documents of that length"
            if meta["split"]
            else "the first that many tokens of each source document"
        )
        + f". Read {c['source_documents']:,} source documents ({c['tokens_read']:,} tokens); skipped "
        f"{c['skipped_short']:,} shorter than {s['prefix'] + s['suffix']} tokens; dropped {c['duplicates']:,} "
        f"whose last {s['suffix']} tokens repeat an earlier document's; {c['usable']:,} usable. The study's "
        f"{(s['buckets'] + 1) * s['bucket_size']} documents are the first in the order of a hash of their "
        f"tokens; the other usable documents are the *rest*.",
        f"- **Buckets.** {s['buckets']} treated bucket(s) and 1 control of {s['bucket_size']} documents; each "
        f"seed ({s['seeds']}) draws the assignment anew and the order of the training batches. The control "
        f"is never trained on.",
        "- **Measured.** Every document of every bucket, before training (epoch 0) and after "
        + (
            "every epoch"
            if s.get("measure_every", 1) == 1
            else f"epochs {', '.join(str(e) for e in _measured(s)[1:])} (study.measure_every={s['measure_every']})"
        )
        + ".",
        f"- **Decoding.** {meta['decoding']}.",
        f"- **Training.** Every arm starts from the same weights (so epoch 0, measured once per size, is the "
        f"same for every arm and seed). An epoch is one pass over the treated documents, each one whole "
        f"sample, {meta['batch']} per step ({meta['steps_per_epoch']} steps per epoch), AdamW, learning rate "
        f"{meta['lr']} ({meta['warmup']} warm-up steps, then constant), weight decay "
        f"{meta['weight_decay']}, gradient clipping {meta['grad_clip']}. Goldfish arms drop a target when the "
        f"hash of the {s['goldfish_h']} tokens before it is 0 mod k (the first {s['goldfish_h']} tokens of "
        f"a document are never dropped).",
        "- **Statistics.** A cell pools its bucket's documents over the seeds (n = documents x seeds): exact "
        "match k/n with the Wilson 95% interval; *before training* = the same documents at epoch 0; "
        "*difference* = (k - k0)/n; *newly matched* = matched now but not at epoch 0 (Wilson interval), "
        "*lost* = matched at epoch 0 but not now; token match: mean with a normal 95% interval. Per-seed "
        "rates are listed beside each cell. Every document's result at every epoch: `per_document.jsonl`.",
        "",
    ]
    for name, size in meta["per_size"].items():
        dropped = ", ".join(f"{a} {100 * d:.1f}%" for a, d in size["dropped"].items() if d > 0) or "none"
        lines.append(
            f"- **{name}**: starting model: {size['start']}"
            + (
                f" (pre-training loss {size['pretrain']['first_loss']:.3f} -> {size['pretrain']['last_loss']:.3f},"
                f" validation {size['pretrain']['val_loss']:.3f}, {size['pretrain']['seconds']:.0f} s)"
                if size.get("pretrain")
                else ""
            )
            + f"; targets dropped by Goldfish loss: {dropped}; time per arm and seed "
            f"{size['seconds_per_run']:.0f} s."
        )
    return lines + [""]


def _measured(study: dict) -> list[int]:
    e, m = study["epochs"], study.get("measure_every", 1)
    return sorted({0, 1, e} | set(range(m, e + 1, m)))


def decoding_text(prefix: int, suffix: int, dtype: str) -> str:
    return DECODING.format(prefix=prefix, suffix=suffix, dtype=dtype, end=prefix + suffix - 1)
