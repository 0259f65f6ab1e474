"""The write of one checkpoint, in the training thread or in the background (``checkpoint.async``).

At the step boundary the training thread checks the weights, has rank 0 make the partial folder,
and copies this rank's state into host buffers (:func:`~axo4d.training.checkpointing.shards.stage`;
pinned on CUDA, reused by every save). A :class:`SaveJob` then does the rest while training goes
on: ``torch.distributed.checkpoint`` writes the copies, every file checksummed as it is written
(:mod:`axo4d.training.checkpointing.writer`); the ranks share their outcomes and checksums; rank 0
writes ``config.yaml``, ``meta.json`` and, last, ``COMPLETE``, renames the folder and prunes.

**Why a background writer and not DCP's ``async_save``.** ``async_save`` stages the values of
the state dict it is given, but axo4d's chunks are not state-dict values: the save planner
resolves each rank's rectangles of the full tensors from views of the live shards when it writes
(:mod:`axo4d.training.checkpointing.shards`), so the staging has to be ours; and what makes a
checkpoint count -- every rank's checksums gathered, ``COMPLETE`` written, the rename -- has to
happen after DCP's write, in the same background thread. One thread runs both.

**Its own process group.** The background thread's collectives (DCP's plan and metadata
exchange, the outcomes, rank 0's decision) run on a gloo group of all ranks made for saves, so
they never interleave with the training thread's collectives on the grid's groups (a process
group's collectives must come in the same order on every rank; two threads on one group would
not). At most one save is in flight: the next save, the end of the run and a stop on a signal
wait for it first. A failure in the background is kept and reported at the next step boundary,
on every rank at the same step (:mod:`axo4d.training.lifecycle`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from axo4d.config.errors import CheckpointWriteError, CommError, agreed
from axo4d.training.checkpointing.shards import SaveState, write_shards


class Group:
    """Object collectives of a save: over ``pg`` (the saves' own group) or, without one, the
    training thread's :class:`~axo4d.dist.comm.Comm` (world group)."""

    def __init__(self, comm, pg=None) -> None:
        self.comm, self.pg = comm, pg

    def gather(self, obj) -> list:
        if self.pg is None:
            return self.comm.all_gather_object(obj)
        out: list = [None] * self.comm.grid.world_size
        try:
            dist.all_gather_object(out, obj, group=self.pg)
        except Exception as e:
            raise CommError(
                f"rank {self.comm.rank}: checkpoint save: all_gather_object over world failed: {e}"
            ) from None
        return out

    def share(self, obj, src: int = 0):
        if self.pg is None:
            return self.comm.broadcast_object(obj, src)
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=src, group=self.pg)
        except Exception as e:
            raise CommError(
                f"rank {self.comm.rank}: checkpoint save: broadcast_object over world failed: {e}"
            ) from None
        return box[0]


class SaveJob:
    """The write of the checkpoint of ``step`` from ``state`` into ``tmp``, completed as ``final``, for
    the :class:`~axo4d.training.checkpointing.checkpointer.Checkpointer` ``ck`` (which starts it)."""

    def __init__(
        self,
        ck: Any,
        step: int,
        tmp: Path,
        final: Path,
        state: SaveState,
        replace: bool,
        keep: int,
        group: Group,
        blocked_s: float = 0.0,
    ) -> None:
        self.ck, self.step, self.tmp, self.final, self.state = ck, step, tmp, final, state
        self.replace, self.keep, self.group, self.blocked_s = replace, keep, group, blocked_s
        self.started = time.time() - blocked_s
        self.error: BaseException | None = None
        self.write_s = 0.0
        self.thread: threading.Thread | None = None
        self.on_done: Callable[[SaveJob], None] | None = None

    # ---- running ------------------------------------------------------------------------
    def run(self) -> None:
        """Write, agree, complete (collective over the job's group); the outcome in ``error``."""
        t0 = time.perf_counter()
        try:
            self._write()
        except BaseException as e:  # kept for the training thread, raised there
            self.error = e
        self.write_s = time.perf_counter() - t0
        self.state = None  # the staged copies stay in the checkpointer's buffers for the next save
        if self.on_done is not None and self.error is None:
            self.on_done(self)

    def start(self) -> None:
        """Run in a background thread (daemon: a rank that fails leaves without waiting for it)."""
        self.thread = threading.Thread(target=self.run, name=f"axo4d-save-{self.step}", daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def failed(self) -> bool:
        return self.done() and self.error is not None

    def join(self, timeout: float | None = None) -> BaseException | None:
        if self.thread is not None:
            self.thread.join(timeout)
        return self.error

    # ---- the write ------------------------------------------------------------------------
    def _write(self) -> None:
        ck, comm = self.ck, self.ck.comm
        mine, why = {}, None
        try:  # a failed DCP write is raised on every rank; a rank's own OSError is shared
            mine = write_shards(self.tmp, ck.model, ck.opt, self.step, comm, self.state, self.group.pg)
            comm.fault_point("save")
        except CheckpointWriteError as e:
            why = str(e)
        except OSError as e:
            why = f"rank {comm.rank}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
        outcomes = self.group.gather((why, mine))
        why = next((w for w, _ in outcomes if w), None)
        if why:
            msg = ck._write_failure(why, self.tmp, why) if comm.rank == 0 else why
            raise agreed(CheckpointWriteError(msg))
        hashed = {k: v for _, d in outcomes for k, v in d.items()}
        timing = {"started": self.started, "blocked_s": round(self.blocked_s, 4), "background": self.thread is not None}
        ck._rank0(
            lambda: ck._complete(self.tmp, self.final, self.step, hashed, self.replace, self.keep, timing),
            self.tmp,
            self.group,
        )


__all__ = ["SaveJob", "Group"]
