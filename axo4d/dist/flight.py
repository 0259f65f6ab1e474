"""Each rank's last collectives, and what they say when a collective fails or hangs.

:class:`CollectiveTrace` is a ring buffer of the last ``N`` collectives :class:`~axo4d.dist.comm.Comm`
issued on this rank (``parallel.trace_collectives``; 0 = off): the group (its name, e.g. ``y``,
``z+data`` or ``world``, and its ranks), the operation, the group's sequence number (the how-many-th
collective on that process group this rank entered), the bytes, and the wall-clock times it was
entered and completed (``end`` is set when the rank's ``wait()`` returns; ``null`` while pending).
Recording one costs a few list and dict operations, no allocation beyond the record.

When a collective fails or times out (:meth:`CollectiveTrace.failed`), every rank that is still
alive writes ``OUT/traces/rank_K.json`` and prints a one-line summary; the first of them to claim
``OUT/traces/.reporter`` waits until the other ranks' files stop arriving (a few seconds), then
compares them (:func:`axo4d.dist.flight_report.diagnose`) and prints which rank is behind, on which
group and sequence number, and writes ``OUT/traces/summary.txt``; the others wait for that file, so
that a launcher that stops the job at the first rank that exits does not cut the report short.
``python -m axo4d.trace OUT/traces`` prints the comparison table. Torch-free (the launchers and
the command line read traces without torch).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

#: seconds without a new trace file after which the reporter compares what it has
QUIET_S = 3.0
#: longest the ranks wait for each other's traces after a failure
LINGER_S = 12.0
REPORTER, SUMMARY = ".reporter", "summary.txt"


class CollectiveTrace:
    """The last ``size`` collectives of rank ``rank`` of ``world`` ranks (module docstring)."""

    __slots__ = ("rank", "world", "size", "ring", "n", "seq", "groups", "folder", "grid", "dumped")

    def __init__(self, rank: int, world: int, size: int = 512, grid: str = "") -> None:
        self.rank, self.world, self.size, self.grid = rank, world, max(1, size), grid
        self.ring: list = [None] * self.size
        self.n = 0
        self.seq: dict[str, int] = {}
        self.groups: dict[str, list[int]] = {}
        self.folder: Path | None = None
        self.dumped = False

    def add_group(self, name: str, ranks) -> None:
        self.groups[name] = sorted(int(r) for r in ranks)

    def start(self, group: str, op: str, nbytes: int) -> list:
        """This rank enters a collective on ``group``: its record (``[group, seq, op, bytes, start, end]``)."""
        s = self.seq[group] = self.seq.get(group, 0) + 1
        rec = [group, s, op, nbytes, time.time(), None]
        self.ring[self.n % self.size] = rec
        self.n += 1
        return rec

    @staticmethod
    def end(rec: list) -> None:
        rec[5] = time.time()

    def dump_into(self, folder: str | os.PathLike) -> None:
        """Where :meth:`failed` writes this rank's trace (the run's ``OUT/traces``)."""
        self.folder = Path(folder)

    def records(self) -> list[list]:
        """The buffer's records, oldest first."""
        if self.n <= self.size:
            return [r for r in self.ring[: self.n]]
        i = self.n % self.size
        return self.ring[i:] + self.ring[:i]

    def snapshot(self, what: str, rec: list | None) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world,
            "grid": self.grid,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": time.time(),
            "failed": what,
            "waiting": None if rec is None else {"group": rec[0], "seq": rec[1], "op": rec[2], "start": rec[4]},
            "groups": self.groups,
            "last_seq": dict(self.seq),
            "recorded": self.n,
            "records": [
                {"group": g, "seq": s, "op": op, "bytes": b, "start": t0, "end": t1}
                for g, s, op, b, t0, t1 in self.records()
            ],
        }

    def failed(self, what: str, rec: list | None) -> None:
        """A collective of this rank failed or timed out (``rec``: its record): write the trace, print
        one line, and let the first rank that can compare every rank's trace (module docstring).
        Once per process; never raises."""
        if self.dumped:
            return
        self.dumped = True
        try:
            self._report(what, rec)
        except Exception as e:  # the diagnosis must never hide the failure itself
            print(f"[rank {self.rank}] collective trace not written: {type(e).__name__}: {e}", file=sys.stderr)

    def _report(self, what: str, rec: list | None) -> None:
        snap = self.snapshot(what, rec)
        last = "nothing recorded"
        if rec is not None:
            members = self.groups.get(rec[0], [])
            last = (
                f"waiting in {rec[2]} #{rec[1]} over {rec[0]} (group ranks {members}) for {time.time() - rec[4]:.1f} s"
            )
        if self.folder is None:
            print(f"[rank {self.rank}] collective trace: {last}", file=sys.stderr, flush=True)
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank_{self.rank}.json"
        tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(snap))
        os.replace(tmp, path)
        print(f"[rank {self.rank}] collective trace {path}: {last}", file=sys.stderr, flush=True)
        wait_and_report(self.folder, self.world)


def trace_files(folder: Path) -> dict[int, Path]:
    out = {}
    for p in Path(folder).glob("rank_*.json"):
        tail = p.stem[5:]
        if tail.isdigit():
            out[int(tail)] = p
    return out


def load_traces(folder: str | os.PathLike) -> dict[int, dict]:
    """``{rank: trace}`` of every readable ``rank_K.json`` in ``folder``."""
    out = {}
    for r, p in sorted(trace_files(Path(folder)).items()):
        try:
            out[r] = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
    return out


def wait_and_report(folder: Path, world: int, linger_s: float = LINGER_S, quiet_s: float = QUIET_S) -> None:
    """After this rank wrote its trace: the first rank to claim the report waits for the others'
    files (all ``world`` of them, or none new for ``quiet_s``, at most ``linger_s``), then prints
    the diagnosis and writes ``summary.txt``; every other rank waits for that file (``linger_s``)."""
    from axo4d.dist.flight_report import diagnose

    t0 = time.time()
    try:
        fd = os.open(folder / REPORTER, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    except FileExistsError:
        while time.time() - t0 < linger_s + quiet_s and not (folder / SUMMARY).exists():
            time.sleep(0.1)
        return
    count, changed = 0, t0
    while time.time() - t0 < linger_s:
        n = len(trace_files(folder))
        if n != count:
            count, changed = n, time.time()
        if n >= world or time.time() - changed >= quiet_s:
            break
        time.sleep(0.1)
    lines = diagnose(load_traces(folder), world)
    text = "\n".join(lines) + f"\n(every rank's trace: python -m axo4d.trace {folder})\n"
    tmp = folder / f".{SUMMARY}.tmp"
    tmp.write_text(text)
    os.replace(tmp, folder / SUMMARY)
    for line in text.splitlines():
        print(f"axo4d: hang diagnosis: {line}", file=sys.stderr, flush=True)


def clear(folder: str | os.PathLike) -> None:
    """Remove an earlier run's traces (the run folder is being reused)."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for p in [*folder.glob("rank_*.json"), folder / REPORTER, folder / SUMMARY]:
        try:
            p.unlink()
        except OSError:
            pass


__all__ = ["CollectiveTrace", "load_traces", "wait_and_report", "clear", "trace_files"]
