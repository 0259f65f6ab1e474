"""The report folder: ``per_document.jsonl`` (every document under every seed and arm), ``meta.json``
(every other figure the report prints: the command, the grid, corpus and exclusion counts,
pre-training losses, Goldfish's dropped fraction, timings), ``config.yaml`` (a ``--config`` that
reruns the study), and what :func:`render` makes from the first two alone: ``report.md``,
``exact_match.png`` and, for a size sweep, ``sizes.png``. A run writes the stored files, then
renders from what it wrote, so ``python -m axo4d.memorization render DIR`` reproduces the report
byte for byte. Every number in it is computed from the records (:mod:`axo4d.memorization.stats`);
the summary sentences are comparisons of intervals, not words chosen after the fact."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from axo4d.config.errors import ConfigError
from axo4d.memorization.plots import plot_exact_match, plot_sizes
from axo4d.memorization.stats import Cell, cell, epochs_to_reach, fmt_rate, measured_epochs

DECODING = (
    "greedy (argmax of the logits gathered over the whole vocabulary; ties go to the lowest id); "
    "prompt = the document's first {prefix} tokens, exactly as they were trained (with the "
    "tokenizer's begin-of-text token if it adds one); {suffix} new tokens always generated (no "
    "stop at an end-of-text token, nothing truncated), in the training compute dtype ({dtype}); "
    "exact match = all {suffix} equal to the document's tokens {prefix}..{end}; token match = the "
    "fraction of the {suffix} positions equal"
)
STORED = ("meta.json", "per_document.jsonl")
"""The files :func:`render` reads."""


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


def write_run(out: Path, meta: dict, all_recs: list[dict]) -> Path:
    """The stored files, then :func:`render` from them; the path of report.md."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "per_document.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in all_recs)
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    with open(out / "config.yaml", "w") as f:
        yaml.safe_dump(
            {
                "command": meta["command"],
                "study": meta["study"],
                "run": meta["run"],
                "sizes": meta["sizes"],
                "decoding": meta["decoding"],
            },
            f,
            sort_keys=False,
        )
    return render(out)


def render(out: Path) -> Path:
    """``report.md`` and the plots of the folder ``out`` from its ``meta.json`` and
    ``per_document.jsonl`` (:class:`ConfigError` naming a missing or unreadable one)."""
    out = Path(out)
    try:
        meta = json.loads((out / "meta.json").read_text())
        recs = [json.loads(line) for line in (out / "per_document.jsonl").read_text().splitlines() if line]
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot render {str(out)!r}: {e.__class__.__name__}: {str(e).splitlines()[0]} (a report folder holds "
            f"{' and '.join(STORED)}, written by python -m axo4d.memorization)"
        ) from None
    study, names, arms = meta["study"], meta["sizes"], meta["arms"]
    epochs = study["epochs"]
    plot_exact_match(recs, names, arms, epochs, out / "exact_match.png", study["suffix"])
    if len(names) > 1:
        plot_sizes(recs, names, arms, epochs, out / "sizes.png")
    (out / "report.md").write_text("\n".join(report_lines(meta, recs)))
    return out / "report.md"


def report_lines(meta: dict, all_recs: list[dict]) -> list[str]:
    study, names, arms = meta["study"], meta["sizes"], meta["arms"]
    epochs, buckets = study["epochs"], meta["buckets"]
    launch = f" on {meta['world_size']} rank{'s' if meta['world_size'] > 1 else ''}"
    if meta.get("launcher"):
        launch += f" (launcher: {meta['launcher']})"
    lines = [
        "# Memorization study",
        "",
        f"`{meta['command']}`{launch}, grid {meta['grid']}, {meta['device']}; wall time "
        f"{meta['seconds'] / 60:.1f} min. Written by `python -m axo4d.memorization` (docs/design.md section 8); "
        "`python -m axo4d.memorization render DIR` rewrites this file and the plots from `meta.json` and "
        "`per_document.jsonl`.",
        "",
    ]
    for name in names:
        recs = [r for r in all_recs if r["size"] == name]
        t, c = cell(recs, arms[0], "treated", 0), cell(recs, arms[0], "control", 0)
        lines += [
            f"## Result: {name} ({recs[0]['params']:,} parameters)",
            "",
            f"Exact match of the last {study['suffix']} tokens after {epochs} epochs, pooled over seeds "
            f"{study['seeds']}: per arm {t.n} treated document-seed pairs from {t.docs} documents and {c.n} control "
            f"pairs from {c.docs} documents. Intervals are 95% over documents: Wilson at the effective number of "
            "trials n_eff (a document's seeds are not independent; see Statistics below); per seed, plain Wilson.",
            "",
            *_summary(recs, arms, epochs),
            "",
            f"Starting model: {meta['per_size'][name]['start']}.",
            "",
        ]
    lines += ["![exact match against epochs](exact_match.png)", ""]
    if len(names) > 1:
        lines += ["## Size sweep", "", *_sizes_table(all_recs, names, arms, epochs), ""]
        lines += ["![exact match and epochs to half against parameters](sizes.png)", ""]
    lines += _protocol(meta)
    for name in names:
        recs = [r for r in all_recs if r["size"] == name]
        for arm in arms:
            lines += [f"## {name}: {arm}, every bucket and epoch", "", *_table(recs, arm, buckets, epochs), ""]
    return lines


def relation(a: Cell, control: Cell) -> str:
    lo, hi = control.interval
    if a.interval[0] > hi:
        return "above the control's interval"
    if lo <= a.rate <= hi:
        return "within the control's interval"
    if a.rate < lo:
        return "below the control's interval"
    return "above the control's interval, the two intervals overlapping"


def _stays(c: Cell, c0: Cell) -> str:
    lo, hi = c0.interval
    return "within" if lo <= c.rate <= hi else ("above" if c.rate > hi else "below")


def _rate(c: Cell) -> str:
    return f"{fmt_rate(c.rate, c.interval)} (n_eff {c.n_eff:.1f})"


def _seed(c: Cell, seed: int) -> str:
    """A cell's rate under one seed with its Wilson interval and counts ('-': the seed has no pair here)."""
    i = next((j for j, x in enumerate(c.per_seed) if x[0] == seed), None)
    return "-" if i is None else f"{fmt_rate(*c.seed_rate(i))} ({c.per_seed[i][1]}/{c.per_seed[i][2]})"


def _summary(recs: list[dict], arms: list[str], epochs: int) -> list[str]:
    lines = [
        f"| arm | treated, epoch {epochs} | treated, before training | newly matched since epoch 0 | control, "
        f"epoch {epochs} | control, before training | epochs to half the treated matched |",
        "|---|---|---|---|---|---|---|",
    ]
    seeds, notes = [f"| arm | seed | treated, epoch {epochs} | control, epoch {epochs} |", "|---|---|---|---|"], []
    for arm in arms:
        t, c = cell(recs, arm, "treated", epochs), cell(recs, arm, "control", epochs)
        t0, c0 = cell(recs, arm, "treated", 0), cell(recs, arm, "control", 0)
        lines.append(
            f"| {arm} | {_rate(t)} | {_rate(t0)} | {fmt_rate(t.new / t.n, t.new_interval)} | {_rate(c)} | "
            f"{_rate(c0)} | {epochs_to_reach(recs, arm).text(epochs)} |"
        )
        seeds += [f"| {arm} | {s} | {_seed(t, s)} | {_seed(c, s)} |" for s, _, _ in t.per_seed]
        notes.append(
            f"- **{arm}**: treated {t.rate:.3f} ({t.k}/{t.n}) after {epochs} epochs is "
            f"{relation(t, c)} ({c.interval[0]:.3f} to {c.interval[1]:.3f}); the control, "
            f"{c.rate:.3f} ({c.k}/{c.n}), is {_stays(c, c0)} its epoch-0 interval "
            f"[{c0.interval[0]:.3f}, {c0.interval[1]:.3f}] ({c.new} control pairs newly matched, {c.lost} lost)."
        )
    return lines + [""] + seeds + [""] + notes


def _table(recs: list[dict], arm: str, buckets: list[str], epochs: int) -> list[str]:
    lines = [
        "| epoch | bucket | exact match [95% CI] | pairs / documents / n_eff | per seed | before training | "
        "difference | newly matched [95% CI] | lost | token match [95% CI] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in measured_epochs(recs, epochs):
        for b in buckets + ["treated"]:
            c = cell(recs, arm, b, e)
            name = "**all treated**" if b == "treated" else b
            lines.append(
                f"| {e} | {name} | {fmt_rate(c.rate, c.interval)} | {c.n} / {c.docs} / {c.n_eff:.1f} | "
                f"{', '.join(f'{k}/{n}' for _, k, n in c.per_seed)} | {c.base:.3f} | {c.delta:+.3f} | "
                f"{fmt_rate(c.new / c.n, c.new_interval)} | {c.lost} | {fmt_rate(c.token[0], c.token[1:])} |"
            )
    return lines


def _sizes_table(all_recs: list[dict], names: list[str], arms: list[str], epochs: int) -> list[str]:
    lines = [
        "| size | parameters | arm | treated before training | after 1 epoch | after "
        f"{epochs} epochs | control after {epochs} | epochs to half the treated matched [95% CI] |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        recs = [r for r in all_recs if r["size"] == name]
        for arm in arms:
            c0, c1, ce = (cell(recs, arm, "treated", e) for e in (0, 1, epochs))
            ctl = cell(recs, arm, "control", epochs)
            lines.append(
                f"| {name} | {recs[0]['params']:,} | {arm} | {_rate(c0)} | {_rate(c1)} | {_rate(ce)} | {_rate(ctl)} | "
                f"{epochs_to_reach(recs, arm).text(epochs)} |"
            )
    return lines + [
        "",
        "Epochs to half: the first measured epoch at which the treated pairs' exact match is at least 0.5; "
        "the interval is the 2.5th and 97.5th percentiles of a bootstrap over documents (2000 resamples, "
        f"seeded); '> {epochs}': not reached.",
    ]


def _protocol(meta: dict) -> list[str]:
    s, c = meta["study"], meta["counts"]
    length = s["prefix"] + s["suffix"]
    lines = [
        "## Protocol",
        "",
        f"- **Documents.** Source `{meta['source']}`, tokenizer `{meta['tokenizer']}`. A document is "
        f"{s['prefix']} + {s['suffix']} = {length} tokens: "
        + (
            "each source document cut into consecutive documents of that length"
            if meta["split"]
            else "the first that many tokens of each source document"
        )
        + f". Read {c['source_documents']:,} source documents ({c['tokens_read']:,} tokens); skipped "
        f"{c['skipped_short']:,} shorter than {length} tokens; {c['usable']:,} usable. The study's "
        f"{(s['buckets'] + 1) * s['bucket_size']} documents are the first in the order of a hash of their tokens "
        f"that share no passage ({s['suffix']} consecutive tokens, at any offset) with one taken before "
        f"({c['pool_skipped']:,} skipped).",
        _exclusion(meta),
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
        "- **Statistics.** A cell pools its bucket's documents over the seeds: n document-seed pairs from "
        "fewer distinct documents. Exact match k/n with Wilson's 95% interval at the effective number of trials "
        "n_eff = p(1-p)/v, v the variance of k/n with documents as clusters (at most n; the number of documents "
        "when k is 0 or n); *before training* = the same pairs at epoch 0; *difference* = (k - k0)/n; *newly "
        "matched* = matched now but not at epoch 0 (interval as for exact match), *lost* = matched at epoch 0 "
        "but not now; per seed: k/n of that seed with the plain Wilson interval (one pair per document); token "
        "match: the mean with a normal 95% interval from the same clustered variance "
        "(`axo4d/memorization/stats.py`). Every document's result at every epoch: `per_document.jsonl`.",
        "",
    ]
    return lines + _size_lines(meta) + [""]


def _size_lines(meta: dict) -> list[str]:
    """The protocol's line per model size: its starting model, Goldfish drops and time per run."""
    lines = []
    for name, size in meta["per_size"].items():
        dropped = ", ".join(f"{a} {100 * d:.1f}%" for a, d in size["dropped"].items() if d > 0) or "none"
        pre = size.get("pretrain")
        lines.append(
            f"- **{name}**: starting model: {size['start']}"
            + (
                f" (pre-training loss {pre['first_loss']:.3f} -> {pre['last_loss']:.3f}, validation "
                f"{pre['val_loss']:.3f}, {pre['seconds']:.0f} s; {pre['windows_dropped']:,} of the "
                f"{pre['windows']:,} windows of {pre['span']} tokens of the rest as it was showed a study passage "
                "and are not in what it trained on)"
                if pre
                else ""
            )
            + f"; targets dropped by Goldfish loss: {dropped}; time per arm and seed {size['seconds_per_run']:.0f} s."
        )
    return lines


def _exclusion(meta: dict) -> str:
    c, w = meta["counts"], meta["study"]["suffix"]
    if "rest_documents" not in c:
        return "- **The rest.** Not read (study.pretrain_steps=0: nothing else is trained on)."
    share = c["dropped_tokens"] / c["rest_tokens"] if c["rest_tokens"] else 0.0
    return (
        f"- **The rest** (what pre-training reads): the other {c['rest_documents']:,} usable documents "
        f"({c['rest_tokens']:,} tokens), in file order, after {c.get('duplicates', 0):,} documents whose last {w} "
        f"tokens repeat an earlier document's were dropped. A hash of every {w}-token window of it, each hit confirmed "
        f"token by token, found {c['occurrences']:,} occurrences of a study passage; the {c['dropped_inside']:,} "
        f"documents holding one and the {c['dropped_junction']:,} with part of one across their junction with a "
        f"neighbour were dropped ({c['dropped_tokens']:,} tokens, {100 * share:.2f}% of the rest), and the "
        "concatenation scanned again until none was left: no study document's suffix, nor any other "
        f"{w} consecutive tokens of it, is in the pre-training data."
    )


def _measured(study: dict) -> list[int]:
    e, m = study["epochs"], study.get("measure_every", 1)
    return sorted({0, 1, e} | set(range(m, e + 1, m)))


def decoding_text(prefix: int, suffix: int, dtype: str) -> str:
    return DECODING.format(prefix=prefix, suffix=suffix, dtype=dtype, end=prefix + suffix - 1)
