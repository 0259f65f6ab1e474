"""Training memory does not grow with the size of a prepared dataset (docs/design.md section 11).

    python -m bench.data_memory --gib 2 --dir /tmp/axo4d-data-memory [--steps 200] [--keep]
                                [--format prepared|megatron]

Writes two prepared folders of random byte tokens -- a small one (``--small-mib``, default 4 MiB)
and a large one (``--gib``), documents of 100 to 1,900 tokens (1,000 on average); with ``--format
megatron`` Megatron-LM indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``, uint16, one sequence per
document) of the same documents instead -- then, for each
in a fresh process, records the resident set size (VmRSS, which counts the pages of memory-mapped
files the process touched) before the dataset is opened, after it is opened, after the first
training step of the tiny model and after ``--steps`` steps, and prints both side by side. The
pass bound: the large folder's growth from before opening to the last step is under 100 MiB, and
within 100 MiB of the small folder's. The folders are deleted at the end unless ``--keep``.
Nothing is timed. Writing 2 GiB takes about a minute; each training run about as long.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

CHUNK = 1 << 26  # tokens written at a time (128 MiB)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def write_folder(folder: Path, n_tokens: int, seed: int = 0) -> dict:
    """A prepared folder of ``n_tokens`` random byte tokens in documents of 100..1900 tokens."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    lengths = rng.integers(100, 1900, size=n_tokens // 1000 + 2)
    ends = np.cumsum(lengths)
    ends = np.append(ends[ends < n_tokens], n_tokens)
    np.save(folder / "documents.npy", np.concatenate([[0], ends]).astype(np.int64))
    with open(folder / "tokens.u16", "wb") as f:
        for s in range(0, n_tokens, CHUNK):
            rng.integers(0, 256, size=min(CHUNK, n_tokens - s), dtype=np.uint16).tofile(f)
    info = {
        "format": "axo4d-tokens/1",
        "tokens_file": "tokens.u16",
        "dtype": "uint16",
        "documents": len(ends),
        "tokens": n_tokens,
        "separator": [10, 10],
        "tokenizer": "byte",
        "vocab_size": 256,
        "source": "bench.data_memory (random bytes)",
    }
    (folder / "dataset.json").write_text(json.dumps(info))
    return info


def _lengths(rng: np.random.Generator, n_tokens: int) -> np.ndarray:
    """Document lengths of 100..1900 tokens adding up to ``n_tokens`` (the last one cut)."""
    ends = np.cumsum(rng.integers(100, 1900, size=n_tokens // 1000 + 2))
    return np.diff(np.concatenate([[0], ends[ends < n_tokens], [n_tokens]]))


def write_megatron_files(folder: Path, n_tokens: int, seed: int = 0) -> Path:
    """A Megatron dataset ``folder/data.bin`` + ``.idx`` of ``n_tokens`` random byte tokens in
    documents of 100..1900 tokens; returns its prefix."""
    from axo4d.training.datasets.megatron import write_index

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    write_index(folder / "data.idx", np.dtype(np.uint16), _lengths(rng, n_tokens))
    with open(folder / "data.bin", "wb") as f:
        for s in range(0, n_tokens, CHUNK):
            rng.integers(0, 256, size=min(CHUNK, n_tokens - s), dtype=np.uint16).tofile(f)
    return folder / "data"


def measure(folder: str, steps: int) -> dict:
    """In this (fresh) process: RSS around opening ``folder`` and training the tiny model on it."""
    import torch

    from axo4d.config import load_config
    from axo4d.dist.comm import Comm
    from axo4d.facts.grid import Grid
    from axo4d.training.datasets.dataset import open_dataset
    from axo4d.training.trainer import Trainer

    cfg = load_config(
        "tiny", [f"data.source={folder}", "data.max_tokens=0", "parallel.tuner=false", f"train.steps={steps}"]
    )
    torch.zeros(1)  # torch's own start-up before the first reading
    out = {"before_open": rss_mib()}
    ds = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    out["after_open"] = rss_mib()
    tr = Trainer(cfg, Comm(Grid(), 0, init_groups=False), ds, torch.device("cpu"))
    tr.step(0)
    out["after_step_1"] = rss_mib()
    for i in range(1, steps):
        tr.step(i)
    tr.evaluate()
    out["after_last_step"] = rss_mib()
    out["documents"], out["tokens"] = ds.train.n_documents + ds.val.n_documents, len(ds)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.data_memory", description=__doc__)
    ap.add_argument("--gib", type=float, default=2.0, help="size of the large token file in GiB")
    ap.add_argument("--small-mib", type=float, default=4.0, help="size of the small token file in MiB")
    ap.add_argument("--dir", default="/tmp/axo4d-data-memory", help="where the folders are written")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--keep", action="store_true", help="keep the folders")
    ap.add_argument("--format", choices=("prepared", "megatron"), default="prepared", help="what to write and train on")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the child process
    a = ap.parse_args(argv)
    if a.measure:
        print(json.dumps(measure(a.measure, a.steps)))
        return 0
    root = Path(a.dir)
    rows = {}
    try:
        for name, n in (("small", int(a.small_mib * 2**20 / 2)), ("large", int(a.gib * 2**30 / 2))):
            folder = root / name
            if a.format == "megatron":
                source = write_megatron_files(folder, n)
            else:
                write_folder(folder, n)
                source = folder
            p = subprocess.run(
                [sys.executable, "-m", "bench.data_memory", "--measure", str(source), "--steps", str(a.steps)],
                capture_output=True,
                text=True,
                check=True,
            )
            rows[name] = json.loads(p.stdout.strip().splitlines()[-1])
            token_file = folder / ("data.bin" if a.format == "megatron" else "tokens.u16")
            rows[name]["file_mib"] = token_file.stat().st_size / 2**20
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{'':24s} {'small':>12s} {'large':>12s}")
    for k in ("file_mib", "documents", "tokens", "before_open", "after_open", "after_step_1", "after_last_step"):
        print(
            f"{k + (' (MiB RSS)' if k.startswith(('before', 'after')) else ''):24s} "
            f"{rows['small'][k]:12,.1f} {rows['large'][k]:12,.1f}"
        )
    growth = {n: r["after_last_step"] - r["before_open"] for n, r in rows.items()}
    ok = growth["large"] < 100 and growth["large"] - growth["small"] < 100
    print(
        f"RSS growth from before opening to step {a.steps}: small {growth['small']:.1f} MiB, large "
        f"{growth['large']:.1f} MiB ({rows['large']['file_mib']:,.0f} MiB token file): "
        f"{a.format}: {'PASS' if ok else 'FAIL'} (bound: < 100 MiB, and < 100 MiB more than the small file)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
