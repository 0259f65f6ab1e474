"""DCP's file writer, checksumming every file from the bytes it writes.

:class:`HashingWriter` is ``torch.distributed.checkpoint``'s :class:`FileSystemWriter` on a file
system whose write streams pass every byte through :func:`zlib.crc32` on its way to the file (and
count it), so the ``COMPLETE`` manifest's size and CRC-32 of each shard and of ``.metadata`` come
from what was written, without reading the files back. The writer only ever appends to a fresh
file (``tell`` and ``write``); anything else on a stream is an error rather than a wrong checksum.
"""

from __future__ import annotations

import os
import threading
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from axo4d.training.checkpointing.integrity import HASH


class _HashingStream:
    """A binary write stream that CRCs and counts what passes through it."""

    def __init__(self, raw) -> None:
        self.raw, self.crc, self.nbytes = raw, 0, 0

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.nbytes += view.nbytes
        return self.raw.write(view)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self.raw.closed

    def close(self) -> None:
        self.raw.close()


class HashingFileSystem(FileSystem):
    """DCP's local file system; files opened for writing are checksummed as written (``hashed``:
    ``{file name: {"bytes", "crc32"}}``, renames followed)."""

    def __init__(self) -> None:
        super().__init__()
        self.hashed: dict[str, dict] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator:
        if "w" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        with open(path, mode) as raw:
            s = _HashingStream(raw)
            yield s
        with self._lock:
            self.hashed[Path(path).name] = {"bytes": s.nbytes, HASH: f"{s.crc & 0xFFFFFFFF:08x}"}

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:
            entry = self.hashed.pop(Path(path).name, None)
            if entry is not None:
                self.hashed[Path(new_path).name] = entry


class HashingWriter(FileSystemWriter):
    """:class:`FileSystemWriter` whose files are checksummed as they are written (module docstring)."""

    def __init__(self, path: str | os.PathLike, **kw) -> None:
        super().__init__(path, **kw)
        self.fs = HashingFileSystem()

    @property
    def hashed(self) -> dict[str, dict]:
        """``{file name: {"bytes", "crc32"}}`` of every file this rank wrote."""
        return dict(self.fs.hashed)


__all__ = ["HashingWriter", "HashingFileSystem"]
