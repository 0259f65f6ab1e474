"""Token data: sources, the token cache, and deterministic grid-independent batches.

Sources (``DataConfig.source``):

* ``'stdlib'``: the ``.py`` files of this Python's standard library
  (``sysconfig.get_paths()['stdlib']``) in sorted relative-path order, skipping
  ``site-packages``/``dist-packages``, ``__pycache__`` and hidden entries. The
  ``test`` packages are *included* (~60% of the ~30 MB of text). No download.
* a directory: all files under it, sorted by relative path, decoded as UTF-8 with
  ``errors='replace'``; hidden entries, ``__pycache__`` and binary files (a NUL in
  the first 8 KiB) are skipped. A single text file is a one-file corpus.
* a token file, memory-mapped: ``.bin``/``.u16`` uint16 (``.bin`` is uint32 under
  ``auto`` when the model vocabulary > 65536), ``.u32`` uint32, ``.npy`` (any 1-D
  integer array). A non-``auto`` ``token_dtype`` overrides (for ``.npy``: must match).

Text sources (files joined by ``DOC_SEP``) are tokenised once into
``<cache_dir>/tokens-<key>.u16`` (``.u32`` for vocabularies > 65536), ``key`` a hash
of (files with sizes and mtimes, tokenizer name/hash, max_tokens).
:func:`prepare_tokens` writes it atomically (temporary file, ``os.replace``) under
a ``flock``, so concurrent ranks tokenise once. The trainer calls it on rank 0,
barriers, then every rank calls :func:`open_dataset` (a cache hit).

Batches are a pure function of ``(seed, step, micro)``: the micro-batch's window
offsets come from ``np.random.default_rng([seed, stream, step, micro])`` (stream 0
train, 1 validation), uniform over the split's valid offsets. Batch shard ``shard``
of ``n_shards = data*z`` is a contiguous chunk, so the shards concatenate to the
unsharded batch on any grid, and resuming needs only the step (:attr:`TokenDataset.state`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import sysconfig
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from axo4d.config import DataConfig, default_cache_dir
from axo4d.dist.grid import Grid
from axo4d.errors import DataError
from axo4d.training.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "DataError",
    "TokenDataset",
    "prepare_tokens",
    "open_tokens",
    "open_dataset",
    "global_batch_offsets",
    "shard_of",
    "default_cache_dir",
    "source_files",
    "DOC_SEP",
]

log = logging.getLogger(__name__)

DOC_SEP = "\n\n"
"""Text placed between consecutive files of a text source."""
CACHE_VERSION = 1
TOKEN_SUFFIXES = (".bin", ".u16", ".u32", ".npy")
TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_CHUNK = 1 << 22  # tokens per chunk for scans (max, bincount)
_READ_BATCH_BYTES = 8 << 20  # text read per tokenizer call


# ---------------------------------------------------------------------------
# sources
def _walk_sorted(root: Path, suffix: str | None) -> list[Path]:
    """Files under ``root`` in sorted relative-path order, skipping hidden/vendored dirs."""
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for f in filenames:
            if not f.startswith(".") and (suffix is None or f.endswith(suffix)):
                out.append(Path(dirpath) / f)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def _is_text(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return b"\0" not in f.read(8192)
    except OSError:
        return False


def _is_token_file(path: Path) -> bool:
    return path.is_file() and path.suffix in TOKEN_SUFFIXES


def _resolve_source(source: str) -> Path:
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(
            f"data source {source!r} does not exist; valid sources: 'stdlib', a directory of text "
            f"files, a text file, or a token file ({'/'.join(TOKEN_SUFFIXES)})"
        )
    return path


def source_files(source: str) -> tuple[Path, list[Path]]:
    """``(root, files)`` of a text source ('stdlib', a directory or a text file)."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _walk_sorted(root, ".py")
    else:
        root = _resolve_source(source)
        if root.is_file():
            return root.parent, [root]
        files = [p for p in _walk_sorted(root, None) if _is_text(p)]
    if not files:
        what = "standard library .py files" if source == "stdlib" else "text files"
        raise DataError(f"data source {source!r} ({str(root)!r}) holds no {what}: the dataset is empty")
    return root, files


# ---------------------------------------------------------------------------
# the token cache
def _cache_key(root: Path, files: list[Path], tok: Tokenizer, max_tokens: int, text_field: str = "text") -> str:
    h = hashlib.sha256()
    meta = {"v": CACHE_VERSION, "root": str(root.resolve()), "tok": tok.name, "max_tokens": max_tokens, "sep": DOC_SEP}
    if tok.eos_id is not None:  # documents separated by the end-of-text token
        meta["sep"] = f"eos:{tok.eos_id}"
    if any(p.suffix == ".jsonl" for p in files):
        meta["text_field"] = text_field
    h.update(json.dumps(meta, sort_keys=True).encode())
    for p in files:
        st = p.stat()
        h.update(f"\n{p.relative_to(root).as_posix()}\t{st.st_size}\t{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def named_documents(files: list[Path], text_field: str, root: Path | None = None) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of the documents of ``files``: a text file is one document (named by its
    path under ``root``), a .jsonl file one per line (``path:line``, the ``text_field`` of each)."""
    for p in files:
        name = p.relative_to(root).as_posix() if root is not None and p != root else p.name
        try:
            raw = p.read_bytes().decode("utf-8", errors="replace")
        except OSError as e:
            raise DataError(f"cannot read data file {str(p)!r}: {e.strerror}") from None
        if p.suffix != ".jsonl":
            yield name, raw
            continue
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise DataError(f"{str(p)!r} line {n} is not JSON: {e}") from None
            if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
                raise DataError(
                    f"{str(p)!r} line {n} has no string field {text_field!r} "
                    f"(set data.text_field to the field holding the text)"
                )
            yield f"{name}:{n}", rec[text_field]


def _documents(files: list[Path], text_field: str) -> Iterator[str]:
    """The texts of :func:`named_documents`."""
    return (text for _, text in named_documents(files, text_field))


def _batches(files: list[Path], text_field: str = "text") -> Iterator[tuple[list[str], bool]]:
    """Documents in groups of about ``_READ_BATCH_BYTES``, and whether the group is the last."""
    group: list[str] = []
    size = 0
    for doc in _documents(files, text_field):
        group.append(doc)
        size += len(doc)
        if size >= _READ_BATCH_BYTES:
            yield group, False
            group, size = [], 0
    yield group, True


def _tokenize_files(files: list[Path], tok: Tokenizer, max_tokens: int, text_field: str = "text") -> np.ndarray:
    """The token stream of ``files`` (first ``max_tokens`` tokens; 0 = all): documents joined by
    ``DOC_SEP`` text, or by the tokenizer's end-of-text token when it has one."""
    parts: list[np.ndarray] = []
    total = 0
    eos = tok.eos_id
    for group, last in _batches(files, text_field):
        if not group:
            continue
        if eos is None:
            ids = tok.encode_docs([d + DOC_SEP for d in group[:-1]] + [group[-1] if last else group[-1] + DOC_SEP])
        else:
            ids = np.concatenate([np.append(tok.encode_docs([d]), eos) for d in group])
        parts.append(ids)
        total += len(ids)
        if 0 < max_tokens <= total:
            break
    arr = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return arr[:max_tokens] if max_tokens > 0 else arr


def _write_atomic(path: Path, arr: np.ndarray) -> None:
    """Write ``arr``'s raw bytes to ``path`` via a temporary file and ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            arr.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (no-op where fcntl is unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def prepare_tokens(cfg: DataConfig) -> Path:
    """The token file of ``cfg``'s source, tokenising and caching a text source if needed.

    Token-file sources are returned as they are. Safe to call from many ranks at
    once (the work is done under a lock, the file appears atomically); calling it
    again is cheap (it stats the files to compute the cache key).
    """
    if cfg.max_tokens < 0:
        raise DataError(f"data.max_tokens={cfg.max_tokens} must be >= 0 (0 = all tokens)")
    if cfg.source != "stdlib":
        path = _resolve_source(cfg.source)
        if _is_token_file(path):
            return path
    root, files = source_files(cfg.source)
    tok = load_tokenizer(cfg.tokenizer)
    suffix = ".u16" if tok.vocab_size <= 1 << 16 else ".u32"
    cache = default_cache_dir(cfg)
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"tokens-{_cache_key(root, files, tok, cfg.max_tokens, cfg.text_field)}{suffix}"
    if out.exists():
        return out
    with _file_lock(out.with_suffix(".lock")):
        if out.exists():  # another process finished while we waited
            return out
        log.info("tokenising %d files of %s with %s -> %s", len(files), cfg.source, tok.name, out)
        arr = _tokenize_files(files, tok, cfg.max_tokens, cfg.text_field)
        if len(arr) == 0:
            raise DataError(f"data source {cfg.source!r} gives 0 tokens ({len(files)} files): the dataset is empty")
        info = {
            "source": cfg.source,
            "root": str(root),
            "files": len(files),
            "tokens": int(len(arr)),
            "tokenizer": tok.name,
            "vocab_size": tok.vocab_size,
            "max_tokens": cfg.max_tokens,
        }
        meta = out.with_suffix(".json")
        _write_atomic(meta, np.frombuffer(json.dumps(info, indent=1).encode(), np.uint8))
        _write_atomic(out, arr.astype(np.uint16 if suffix == ".u16" else np.uint32))
    return out


# ---------------------------------------------------------------------------
# opening token files
def _raw_dtype(path: Path, token_dtype: str, vocab_size: int | None) -> np.dtype:
    if token_dtype != "auto":
        return np.dtype(TOKEN_DTYPES[token_dtype])
    if path.suffix == ".u32" or (path.suffix == ".bin" and vocab_size is not None and vocab_size > 1 << 16):
        return np.dtype(np.uint32)
    return np.dtype(np.uint16)


def open_tokens(
    path: str | Path, token_dtype: str = "auto", vocab_size: int | None = None, max_tokens: int = 0
) -> np.ndarray:
    """Memory-map a token file as a 1-D integer array (first ``max_tokens`` tokens; 0 = all).

    With ``vocab_size``, token ids ``>= vocab_size`` are a :class:`DataError`.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token file {str(path)!r} does not exist")
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read token file {str(path)!r} as .npy: {e}") from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise DataError(
                f"token file {str(path)!r} holds a {arr.ndim}-D {arr.dtype} array; expected a 1-D integer array"
            )
        if token_dtype != "auto" and arr.dtype != np.dtype(TOKEN_DTYPES[token_dtype]):
            raise DataError(
                f"token file {str(path)!r} holds {arr.dtype} but data.token_dtype is "
                f"{token_dtype!r}; use 'auto' or {arr.dtype.name!r}"
            )
    else:
        dt = _raw_dtype(path, token_dtype, vocab_size)
        size = path.stat().st_size
        if size % dt.itemsize:
            raise DataError(
                f"token file {str(path)!r} has {size} bytes, not a multiple of {dt.itemsize} "
                f"({dt.name}); check data.token_dtype (valid: auto, {', '.join(TOKEN_DTYPES)})"
            )
        arr = np.memmap(path, dtype=dt, mode="r") if size else np.zeros(0, dt)
    if max_tokens > 0:
        arr = arr[:max_tokens]
    if len(arr) == 0:
        raise DataError(f"token file {str(path)!r} holds 0 tokens: the dataset is empty")
    if vocab_size is not None:
        _check_vocab(arr, vocab_size, path)
    return arr


def _chunks(arr: np.ndarray, max_scan: int = 1 << 28) -> Iterator[np.ndarray]:
    """Chunks covering ``arr``, or 64 evenly spaced chunks when it is longer than ``max_scan``."""
    n = len(arr)
    if n <= max_scan:
        starts = range(0, n, _CHUNK)
    else:
        starts = np.linspace(0, n - _CHUNK, 64).astype(np.int64)
    for s in starts:
        yield np.asarray(arr[int(s) : int(s) + _CHUNK])


def _check_vocab(arr: np.ndarray, vocab_size: int, where: object) -> None:
    lo, hi = 0, 0
    for c in _chunks(arr):
        lo, hi = min(lo, int(c.min())), max(hi, int(c.max()))
    if hi >= vocab_size or lo < 0:
        bad = hi if hi >= vocab_size else lo
        raise DataError(
            f"token id {bad} in {str(where)!r} is outside the model vocabulary "
            f"0..{vocab_size - 1}; set model.vocab_size >= {hi + 1} or use the matching tokenizer"
        )


# ---------------------------------------------------------------------------
# batches
def global_batch_offsets(seed: int, stream: int, step: int, micro: int, n_valid: int, batch: int) -> np.ndarray:
    """Window start offsets (relative to the split) of one global micro-batch: ``(batch,)``.

    A pure function of ``(seed, stream, step, micro)``; uniform over ``0..n_valid-1``.
    """
    rng = np.random.default_rng([int(seed) % (1 << 64), stream, step, micro])
    return rng.integers(0, n_valid, size=batch, dtype=np.int64)


def shard_of(grid: Grid, rank: int) -> tuple[int, int]:
    """``(shard, n_shards)`` of ``rank``: its index in its (z, data) group, z fastest."""
    return grid.group_index(rank, ("z", "data")), grid.size("z", "data")


class TokenDataset:
    """A token stream split into train (head) and validation (tail, ``val_fraction``).

    A sample is a window of ``seq_len + 1`` tokens: input ``[:-1]``, target ``[1:]``.
    """

    SPLITS = {"train": 0, "val": 1}

    def __init__(
        self, tokens: np.ndarray, seq_len: int, val_fraction: float = 0.05, seed: int = 0, name: str = "tokens"
    ) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len={seq_len} must be >= 1")
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"data.val_fraction={val_fraction} must be strictly between 0 and 1")
        self.tokens, self.seq_len, self.seed, self.name = tokens, seq_len, seed, name
        n = len(tokens)
        self.n_val = int(n * val_fraction)
        self.n_train = n - self.n_val
        need = seq_len + 1
        if min(self.n_train, self.n_val) < need:
            raise DataError(
                f"dataset {name!r} has {n} tokens, split into train={self.n_train} and val={self.n_val} "
                f"(val_fraction={val_fraction}); each split needs at least seq_len+1={need} tokens: "
                f"use more data (data.max_tokens/source), a shorter seq_len or another val_fraction"
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def split_range(self, split: str) -> tuple[int, int]:
        """``(start, n_tokens)`` of ``split`` in the token stream."""
        if split not in self.SPLITS:
            raise DataError(f"unknown split {split!r}; valid: {', '.join(self.SPLITS)}")
        return (0, self.n_train) if split == "train" else (self.n_train, self.n_val)

    def n_windows(self, split: str) -> int:
        """Number of valid window start offsets of ``split``."""
        return self.split_range(split)[1] - self.seq_len

    def batch_offsets(self, split: str, step: int, micro: int, micro_batch_global: int) -> np.ndarray:
        """Absolute window offsets of the whole (unsharded) micro-batch: ``(micro_batch_global,)``."""
        if step < 0 or micro < 0:
            raise DataError(f"step={step} and micro={micro} must be >= 0")
        start, _ = self.split_range(split)
        offs = global_batch_offsets(
            self.seed, self.SPLITS[split], step, micro, self.n_windows(split), micro_batch_global
        )
        return offs + start

    def get_batch(
        self,
        split: str,
        step: int,
        micro: int,
        shard: int,
        n_shards: int,
        micro_batch_global: int,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Shard ``shard`` of ``n_shards`` of micro-batch ``(step, micro)``: int64 ``(x, y)``.

        Both have shape ``(micro_batch_global / n_shards, seq_len)``. For ``'val'``,
        ``step`` is the evaluation batch index (use ``micro=0``).
        """
        if micro_batch_global < 1 or n_shards < 1 or micro_batch_global % n_shards:
            raise DataError(
                f"micro-batch of {micro_batch_global} samples (global_batch/grad_accum) does not "
                f"divide over {n_shards} batch shards (data*z); choose a multiple of {n_shards}"
            )
        if not 0 <= shard < n_shards:
            raise DataError(f"shard {shard} outside 0..{n_shards - 1}")
        b = micro_batch_global // n_shards
        offs = self.batch_offsets(split, step, micro, micro_batch_global)[shard * b : (shard + 1) * b]
        idx = offs[:, None] + np.arange(self.seq_len + 1)  # (B/(data*z), T+1)
        win = np.asarray(self.tokens[idx], dtype=np.int64)  # (B/(data*z), T+1)
        x = torch.from_numpy(np.ascontiguousarray(win[:, :-1]))  # (B/(data*z), T)
        y = torch.from_numpy(np.ascontiguousarray(win[:, 1:]))  # (B/(data*z), T)
        if device is not None:
            x, y = x.to(device), y.to(device)
        return x, y

    def unigram_entropy(self, split: str = "train") -> tuple[float, float]:
        """``(nats, bits)``: entropy of the split's token frequency distribution.

        A model that beats this per-token loss has learnt more than token frequencies.
        Splits over 2**28 tokens are estimated from 64 evenly spaced chunks.
        """
        start, n = self.split_range(split)
        counts = np.zeros(0, np.int64)
        for c in _chunks(self.tokens[start : start + n]):
            bc = np.bincount(c.astype(np.int64, copy=False))
            if len(bc) > len(counts):
                counts = np.pad(counts, (0, len(bc) - len(counts)))
            counts[: len(bc)] += bc
        p = counts[counts > 0] / counts.sum()
        nats = float(-(p * np.log(p)).sum())
        return nats, nats / math.log(2)

    @property
    def state(self) -> dict:
        """What a checkpoint records. Batches are a pure function of (seed, step,
        micro), so the data position *is* the optimizer step: nothing else to save.
        :meth:`check_state` verifies on resume that the stream is the same."""
        return {
            "seed": int(self.seed),
            "n_tokens": len(self.tokens),
            "n_train": self.n_train,
            "seq_len": self.seq_len,
            "name": self.name,
        }

    def check_state(self, state: dict) -> None:
        """Raise :class:`DataError` if a checkpoint's ``state`` was made with other data."""
        for k in ("seed", "n_tokens", "n_train", "seq_len"):
            if k in state and state[k] != self.state[k]:
                raise DataError(
                    f"checkpoint data {k}={state[k]!r} differs from this run's {self.state[k]!r}: "
                    f"resuming would replay different batches"
                )


def open_dataset(cfg: DataConfig, seq_len: int, seed: int, vocab_size: int | None = None) -> TokenDataset:
    """Prepare (or find in the cache) and open ``cfg``'s tokens as a :class:`TokenDataset`.

    Tokens ``>= vocab_size`` (when given) are a :class:`DataError`.
    """
    path = prepare_tokens(cfg)
    is_cache = cfg.source == "stdlib" or not _is_token_file(Path(cfg.source).expanduser())
    tokens = open_tokens(path, "auto" if is_cache else cfg.token_dtype, vocab_size, 0 if is_cache else cfg.max_tokens)
    return TokenDataset(tokens, seq_len, cfg.val_fraction, seed, name=cfg.source)
