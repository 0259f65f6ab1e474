"""Where documents come from: the embedded corpus, text and JSONL files, Arrow and Parquet tables.

A *text source* is a sequence of documents (``(name, text)``):

* ``'stdlib'``: the ``.py`` files of this Python's standard library (``sysconfig``'s ``stdlib``) in
  sorted relative-path order, skipping ``site-packages``/``dist-packages``, ``__pycache__`` and
  hidden entries (the ``test`` packages are included). One document per file; no download.
* a directory: every file under it in sorted relative-path order (hidden entries and
  ``__pycache__`` skipped); each file is read by its kind below, other binary files (a NUL byte
  in the first 8 KiB) are skipped.
* a text file: one document (UTF-8; undecodable bytes are replaced by U+FFFD and counted, and the
  preparation's summary says how many, in how many files: :func:`decode_utf8`).
* a ``.jsonl`` file: one document per non-blank line, the string field ``text_field`` of each.
* a Hugging Face ``datasets`` folder (``save_to_disk``: ``state.json`` and Arrow files; a
  ``DatasetDict`` folder means its ``train`` split), an ``.arrow`` file, or a ``.parquet`` file: one
  document per row, its ``text_field`` column. Read with ``pyarrow`` (``pip install pyarrow``):
  Arrow's own reader follows the format as it evolves, where code of ours would trail it.

A *token source* -- a prepared folder or a token file -- is opened by :mod:`axo4d.training.datasets.prepared`.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from axo4d.config.errors import DataError

TOKEN_SUFFIXES = (".bin", ".u16", ".u32", ".npy")
TABLE_SUFFIXES = (".arrow", ".parquet")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
#: rows of an Arrow/Parquet table read at a time
_TABLE_BATCH = 4096


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


def resolve_source(source: str) -> Path:
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(
            f"data source {source!r} does not exist; valid sources: 'stdlib', a directory of text/JSONL "
            f"files, a text or .jsonl file, a Hugging Face datasets folder, an .arrow/.parquet file, a "
            f"prepared folder (python -m axo4d.data prepare), a Megatron dataset prefix (PREFIX.bin + PREFIX.idx) "
            f"or a token file ({'/'.join(TOKEN_SUFFIXES)})"
        )
    return path


def hf_dataset_files(folder: Path) -> list[Path] | None:
    """The Arrow files of a ``save_to_disk`` folder in order (a DatasetDict: its ``train``
    split), or None when ``folder`` is not one."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read {str(folder / 'dataset_dict.json')!r}: {e}") from None
        if "train" not in splits:
            raise DataError(
                f"Hugging Face DatasetDict {str(folder)!r} has no 'train' split (splits: {', '.join(splits)}); "
                f"give the folder of the split to use, e.g. {str(folder / (splits[0] if splits else 'train'))!r}"
            )
        folder = folder / "train"
    state = folder / "state.json"
    if not state.is_file():
        return None
    try:
        files = [folder / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{str(state)!r} is not a Hugging Face datasets state.json: {e}") from None
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise DataError(f"Hugging Face datasets folder {str(folder)!r} lacks its data file {missing[0]!r}")
    return files


def source_files(source: str) -> tuple[Path, list[Path]]:
    """``(root, files)`` of a text source (module docstring)."""
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _walk_sorted(root, ".py")
    else:
        root = resolve_source(source)
        if root.is_file():
            return root.parent, [root]
        files = hf_dataset_files(root)
        if files is not None:
            return root, files
        files = [p for p in _walk_sorted(root, None) if p.suffix in TABLE_SUFFIXES or _is_text(p)]
    if not files:
        what = "standard library .py files" if source == "stdlib" else "text files"
        raise DataError(f"data source {source!r} ({str(root)!r}) holds no {what}: the dataset is empty")
    return root, files


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError(
            "Arrow/Parquet sources (Hugging Face datasets folders, .arrow, .parquet) need the 'pyarrow' "
            "package: pip install pyarrow"
        ) from None
    return pyarrow


def _table_batches(path: Path):
    """Record batches of an Arrow (stream or file format) or Parquet file."""
    pa = _pyarrow()
    try:
        if path.suffix == ".parquet":
            yield from pa.parquet.ParquetFile(path).iter_batches(batch_size=_TABLE_BATCH)
            return
        with pa.memory_map(str(path)) as src:
            try:
                reader = pa.ipc.open_stream(src)  # what save_to_disk writes
            except pa.ArrowInvalid:
                src.seek(0)
                f = pa.ipc.open_file(src)
                reader = (f.get_batch(i) for i in range(f.num_record_batches))
            yield from reader
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot read {str(path)!r} as {path.suffix[1:]}: {e}") from None


def _table_documents(path: Path, name: str, text_field: str) -> Iterator[tuple[str, str]]:
    row = 0
    for batch in _table_batches(path):
        if text_field not in batch.schema.names:
            raise DataError(
                f"{str(path)!r} has no column {text_field!r} (columns: {', '.join(batch.schema.names)}); "
                f"set data.text_field (or --text-field) to the column holding the text"
            )
        for text in batch.column(text_field).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise DataError(f"{str(path)!r} row {row}: column {text_field!r} is {type(text).__name__}, not text")
            yield f"{name}:{row}", text


def _jsonl_documents(path: Path, raw: str, name: str, text_field: str) -> Iterator[tuple[str, str]]:
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise DataError(f"{str(path)!r} line {n} is not JSON: {e}") from None
        if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
            raise DataError(
                f"{str(path)!r} line {n} has no string field {text_field!r} "
                f"(set data.text_field to the field holding the text)"
            )
        yield f"{name}:{n}", rec[text_field]


def decode_utf8(raw: bytes) -> tuple[str, int]:
    """``raw`` decoded as UTF-8 with every invalid sequence replaced by U+FFFD (the same text as
    ``raw.decode('utf-8', errors='replace')``) and the number of bytes so replaced."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        pass
    parts: list[str] = []
    bad = at = 0
    while True:  # each failed decode stops at the next invalid sequence: linear in len(raw)
        try:
            parts.append(raw[at:].decode("utf-8"))
            return "".join(parts), bad
        except UnicodeDecodeError as e:
            parts += [raw[at : at + e.start].decode("utf-8"), "\ufffd"]
            bad += e.end - e.start
            at += e.end


def named_documents(
    files: list[Path], text_field: str, root: Path | None = None, counts: dict | None = None
) -> Iterator[tuple[str, str]]:
    """``(name, text)`` of the documents of ``files``: a text file is one document (named by its
    path under ``root``), a .jsonl file one per line (``path:line``), a table one per row
    (``path:row``). ``counts`` (optional) gets ``replaced_bytes`` (invalid UTF-8 replaced by
    U+FFFD), ``replaced_files`` and ``first_replaced`` (the first such file's name) added."""
    for p in files:
        name = p.relative_to(root).as_posix() if root is not None and p != root else p.name
        if p.suffix in TABLE_SUFFIXES:
            yield from _table_documents(p, name, text_field)
            continue
        try:
            raw, bad = decode_utf8(p.read_bytes())
        except OSError as e:
            raise DataError(f"cannot read data file {str(p)!r}: {e.strerror}") from None
        if bad and counts is not None:
            counts["replaced_bytes"] = counts.get("replaced_bytes", 0) + bad
            counts["replaced_files"] = counts.get("replaced_files", 0) + 1
            counts.setdefault("first_replaced", name)
        if p.suffix == ".jsonl":
            yield from _jsonl_documents(p, raw, name, text_field)
        else:
            yield name, raw
