"""Convergence evidence: a longer 8-rank CPU training on the embedded corpus.

    python -m bench.convergence [--ranks 8] [--grid data=2,x=2,y=1,z=2] [--steps N] [--out runs/converge]

Trains ``configs/converge.yaml`` (byte-level GPT on the Python standard library's
sources), then writes ``docs/convergence.md`` and ``docs/convergence_loss.png``:
training/validation loss against step beside the unigram entropy of the byte
distribution (the loss of the best model that ignores context). The run passes
when the final validation loss is well below that entropy (by more than 1 nat).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from axo4d.config import load_config
from axo4d.training.datasets.dataset import open_dataset
from axo4d.training.plot import plot_loss, read_metrics

ROOT = Path(__file__).resolve().parents[1]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--grid", default="data=2,x=2,y=1,z=2")
    ap.add_argument("--steps", type=int, default=0, help="override train.steps (0 = config)")
    ap.add_argument("--out", default="runs/converge")
    ap.add_argument("--docs", default=str(ROOT / "docs"))
    return ap.parse_args(argv)


def _train_cmd(a: argparse.Namespace, sets: list[str]) -> list[str]:
    """The ``launch.local`` command of the training run."""
    return [
        sys.executable,
        "-m",
        "launch.local",
        "-n",
        str(a.ranks),
        "--",
        "axo4d.train",
        "--config",
        "converge",
        "--grid",
        a.grid,
        "--out",
        a.out,
    ] + [x for s in sets for x in ("--set", s)]


def _doc_text(
    a: argparse.Namespace,
    cfg: Any,
    train: list[dict],
    val: list[dict],
    nats: float,
    bits: float,
    wall: float,
    load0: float,
    load1: float,
) -> str:
    """``docs/convergence.md``: the command, the setting, the entropy, the final loss and the table."""
    final = val[-1]["val_loss"]
    ok = final < nats - 1.0
    rows = "\n".join(f"| {r['step']} | {r['val_loss']:.4f} | {r['val_loss'] / math.log(2):.3f} |" for r in val)
    steps_arg = f" --steps {a.steps}" if a.steps else ""
    text = f"""# Convergence evidence

Command: `python -m bench.convergence --ranks {a.ranks} --grid {a.grid}{steps_arg}`
(date {datetime.date.today()}, {platform.machine()} CPU, {a.ranks} gloo ranks on this machine,
wall time {wall / 60:.1f} min; 1-minute load average {load0:.1f} before the run, {load1:.1f} after).

Model `converge` ({cfg.model.n_layer} layers, hidden {cfg.model.n_embd}, {cfg.model.n_head} heads, seq
{cfg.model.seq_len}, byte vocabulary), global batch {cfg.train.global_batch}, {len(train)} steps, on the
embedded corpus (the Python standard library's `.py` sources, byte-level tokens).

Unigram entropy of the byte distribution (validation split): **{nats:.4f} nats = {bits:.3f} bits/byte**.
Final validation loss: **{final:.4f} nats = {final / math.log(2):.3f} bits/byte**
({'below' if final < nats else 'NOT below'} the unigram entropy by {nats - final:.2f} nats;
required: > 1 nat: {'PASS' if ok else 'FAIL'}).

| step | val loss (nats) | bits/byte |
|---|---|---|
{rows}

![loss](convergence_loss.png)
"""
    return text


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    sets = [f"train.steps={a.steps}"] if a.steps else []
    cmd = _train_cmd(a, sets)
    print("running:", " ".join(cmd), flush=True)
    t0, load0 = time.time(), os.getloadavg()[0]
    rc = subprocess.call(cmd, cwd=ROOT)
    wall, load1 = time.time() - t0, os.getloadavg()[0]
    if rc != 0:
        print(f"training failed with exit code {rc}", file=sys.stderr)
        return rc
    cfg = load_config("converge", sets)
    nats, bits = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size).unigram_entropy("val")
    train, val = read_metrics(Path(a.out) / "metrics.jsonl")
    docs = Path(a.docs)
    docs.mkdir(exist_ok=True)
    plot_loss(
        Path(a.out) / "metrics.jsonl",
        docs / "convergence_loss.png",
        title=f"converge: {a.ranks} CPU ranks, grid {a.grid}",
        ref_lines={f"unigram entropy of bytes ({nats:.2f} nats)": nats},
    )
    final = val[-1]["val_loss"]
    ok = final < nats - 1.0
    text = _doc_text(a, cfg, train, val, nats, bits, wall, load0, load1)
    (docs / "convergence.md").write_text(text)
    shutil.copy(Path(a.out) / "metrics.jsonl", docs / "convergence_metrics.jsonl")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
