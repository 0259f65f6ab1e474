"""Prepare training data ahead of a job: tokenise once into a memory-mapped token file and a
document index, then train on the folder with no tokenisation.

    python -m axo4d.data prepare SOURCE --tokenizer byte|TOKENIZER.json --out DIR
                                [--text-field text] [--workers N] [--dedup] [--max-tokens N] [--force]
                                [--format prepared|megatron] [--prefix text_document]
    python -m axo4d.data info DIR|PREFIX

``SOURCE`` is what ``data.source`` takes as text: ``stdlib``, a folder of text/JSONL files, a text
or ``.jsonl`` file, a Hugging Face ``datasets`` folder (``save_to_disk``), an ``.arrow`` or
``.parquet`` file (:mod:`axo4d.training.datasets.sources`). ``prepare`` tokenises batches of documents
in ``--workers`` processes (default: the CPUs), in order, shows a progress bar (tokens/s, ETA) on
stderr and ends with a summary: documents, tokens, empty documents skipped, with ``--dedup``
exact duplicates dropped, and the bytes of invalid UTF-8 replaced by U+FFFD (if any: a source
that is not all UTF-8 is prepared, and the summary says how much of it was not). ``DIR``
(:mod:`axo4d.training.datasets.prepared`) appears whole or not at all;
an existing ``DIR`` is replaced only with ``--force``. Train on it with ``--set data.source=DIR``
(the tokenizer's vocabulary must fit ``model.vocab_size``). ``--format megatron`` writes a
Megatron-LM indexed dataset instead, ``DIR/PREFIX.bin`` + ``DIR/PREFIX.idx``
(:mod:`axo4d.training.datasets.megatron`: one sequence per document, each ending in the end-of-text
token), which Megatron-LM and axo4d (``data.source=DIR/PREFIX``) both train on. ``info`` checks a
prepared folder or a Megatron dataset (its index against its token file) and prints its counts.

Bad input (a missing source, a record without the text field, an empty source, an unusable
tokenizer, an existing ``DIR``, a ``DIR`` under a file) is one line on stderr and exit status 2, ``DIR`` untouched
(:mod:`axo4d.exits`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from axo4d.exits import run_and_exit
from axo4d.training.datasets.megatron import DEFAULT_PREFIX, megatron_prefix, open_megatron, write_megatron
from axo4d.training.datasets.prepared import open_prepared
from axo4d.training.datasets.prepared_writer import Progress, check_out, replaced_note, write_prepared
from axo4d.training.datasets.sources import source_files
from axo4d.training.datasets.tokenizer import load_tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m axo4d.data", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenise a text source into a prepared folder")
    p.add_argument("source", help="stdlib, a folder, a text/.jsonl/.arrow/.parquet file or a datasets folder")
    p.add_argument("--tokenizer", required=True, help="'byte' or the path of a tokenizer.json (or its folder)")
    p.add_argument("--out", required=True, help="the prepared folder to write")
    p.add_argument("--text-field", default="text", help="field (JSONL) or column (Arrow, Parquet) of the text")
    p.add_argument("--workers", type=int, default=0, help="tokenising processes (0 = the CPUs of this machine)")
    p.add_argument("--dedup", action="store_true", help="drop documents whose text equals an earlier one's")
    p.add_argument("--max-tokens", type=int, default=0, help="stop after this many tokens (0 = all)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    p.add_argument(
        "--format",
        choices=("prepared", "megatron"),
        default="prepared",
        help="an axo4d prepared folder, or a Megatron-LM indexed dataset DIR/PREFIX.bin + DIR/PREFIX.idx",
    )
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="file name prefix of --format megatron's files")
    i = sub.add_parser("info", help="check a prepared folder or a Megatron dataset and print its counts")
    i.add_argument("folder", help="a prepared folder, or a Megatron dataset (PREFIX, PREFIX.bin/.idx or its folder)")
    return ap.parse_args(argv)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def prepare(a: argparse.Namespace) -> int:
    from axo4d.config.errors import DataError

    if a.workers < 0 or a.max_tokens < 0:
        raise DataError(f"--workers={a.workers} and --max-tokens={a.max_tokens} must be >= 0")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = a.workers or cpus
    check_out(Path(a.out), a.force)
    load_tokenizer(a.tokenizer)  # one line now, not after the files are listed
    _, files = source_files(a.source)
    total = sum(p.stat().st_size for p in files)
    print(f"preparing {a.source}: {len(files):,} files, {_size(total)}, {workers} worker(s) -> {a.out}", flush=True)
    t0 = time.time()
    bar = Progress(total)
    kw = dict(text_field=a.text_field, workers=workers, dedup=a.dedup, max_tokens=a.max_tokens, force=a.force)
    if a.format == "megatron":
        info = write_megatron(a.source, a.tokenizer, Path(a.out), prefix=a.prefix, progress=bar.update, **kw)
    else:
        info = write_prepared(a.source, a.tokenizer, Path(a.out), progress=bar.update, **kw)
    dt = time.time() - t0
    tok_bytes = info["tokens"] * (2 if info["dtype"] == "uint16" else 4)
    target = info["prefix"] if a.format == "megatron" else a.out
    dups = f", {info['duplicates']:,} duplicates dropped" if a.dedup else ""
    dups += f", {replaced_note(info)}" if replaced_note(info) else ""
    print(
        f"prepared {a.out}: {info['documents']:,} documents, {info['tokens']:,} tokens ({info['dtype']}, "
        f"{_size(tok_bytes)}), {info['skipped_empty']:,} empty documents skipped{dups}; {dt:.1f} s, "
        f"{info['tokens'] / max(dt, 1e-9):,.0f} tokens/s; tokenizer {info['tokenizer']} (vocabulary "
        f"{info['vocab_size']:,}); train with --set data.source={target}",
        flush=True,
    )
    return 0


def info(a: argparse.Namespace) -> int:
    prefix = megatron_prefix(a.folder)
    docs = open_megatron(prefix) if prefix is not None else open_prepared(Path(a.folder))
    meta = {k: v for k, v in docs.info.items() if k != "separator"}
    print(json.dumps(meta, indent=1))
    n = len(docs)
    per = docs.n_tokens / n
    print(f"{a.folder}: {n:,} documents, {docs.n_tokens:,} tokens ({per:,.1f} per document); index checked")
    return 0


def run(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    return prepare(a) if a.command == "prepare" else info(a)


def main(argv: list[str] | None = None) -> int:
    return run_and_exit(run, argv, "axo4d.data")


if __name__ == "__main__":
    sys.exit(main())
