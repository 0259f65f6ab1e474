"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save, find, load on any grid.

A checkpoint is a folder ``OUT/checkpoints/step_000123`` (the state after 123
completed optimizer steps, so training resumes at step 123)::

    .metadata, __<rank>_0.distcp   DCP: tensors of the full logical shapes, chunks written by their holders
    config.yaml                    the resolved config of the run that saved it
    meta.json                      format, step, grid, order, world size, tensor shapes, torch version,
                                   the run plan's derived numbers (``plan``, when the run gave them)
    COMPLETE                       written last: a manifest {file: {bytes, crc32}} of everything above

DCP keys: ``model/<param name>`` (full shape; the LM head without vocabulary
padding), ``optim/<param name>/{exp_avg,exp_avg_sq}`` (sharded like the
parameter), ``optim/<param name>/step``, ``train/step``, and ``rng/rank<r>``
(torch, numpy and Python RNG states of rank ``r``). How each rank writes just
its own shard and reads just what its new shard needs is in :mod:`axo4d.training.checkpointing.shards`.
The LR schedule is a pure function of the step; meta.json's ``data`` records the position in the
sample stream the next step starts at (and what the dataset was), so a resume continues with the
exact next sample on any grid (:mod:`axo4d.training.datasets.batches`).

Atomicity: ranks write into ``.step_000123.partial``; after every rank is done,
rank 0 writes ``config.yaml``, ``meta.json``, then ``COMPLETE`` and renames the
folder to ``step_000123``. Only folders named ``step_N`` holding ``COMPLETE``
count; a crash mid-save leaves the previous checkpoints untouched, and older
ones are pruned (``checkpoint.keep``) only once the new one is complete.

Integrity (:mod:`axo4d.training.checkpointing.integrity`): ``COMPLETE`` records the size and CRC-32 of every
file, hashed by the ranks that wrote them; a resume checks them (each rank a share of the files)
before anything is read or written, and a mismatch is one :class:`CheckpointError` naming the
file. Before a save rank 0 checks the free space against the checkpoint's size; a save that fails
(a full disk, a dead rank) removes its partial folder. A model with non-finite weights is never
saved. Saves and loads run under the start-up timeout (``parallel.init_timeout_s``).

Finding, reading and completing checkpoint folders: :mod:`axo4d.training.checkpointing.folder`; the
write in the background (``checkpoint.async``): :mod:`axo4d.training.checkpointing.background`.
Choosing and verifying the checkpoint to resume from: :mod:`axo4d.training.checkpointing.resume`; one
safetensors file and back: :mod:`axo4d.training.checkpointing.single_file`; the command line
(``python -m axo4d.checkpoint``): :mod:`axo4d.checkpoint`.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from axo4d.config import RunConfig
from axo4d.config.errors import CheckpointError, CheckpointWriteError, TrainError, agreed
from axo4d.dist.bootstrap import register_closable
from axo4d.dist.comm import Comm
from axo4d.facts.run import RunFacts
from axo4d.training.checkpointing import integrity
from axo4d.training.checkpointing.background import Group, SaveJob
from axo4d.training.checkpointing.folder import (  # noqa: F401 -- the folder functions, re-exported
    FORMAT,
    STEP_RE,
    check_model_config,
    check_tensors,
    complete_checkpoints,
    corrupt,
    finalize,
    find_checkpoint,
    is_complete,
    prune,
    read_info,
    read_manifest,
    step_dir_name,
)
from axo4d.training.checkpointing.shards import logical_shapes, read_shards, save_state, stage

#: seconds the end of a run waits for a save in flight before its process group goes
SHUTDOWN_WAIT_S = 600.0


# ---- the run's checkpointer --------------------------------------------------------------
class Checkpointer:
    """Saves and loads this run's checkpoints under ``out/checkpoints`` (collective calls)."""

    def __init__(
        self,
        out: Path,
        cfg: RunConfig,
        comm: Comm,
        model: nn.Module,
        opt: torch.optim.Optimizer | None,
        background: bool = False,
        data_state: Callable[[int], dict] | None = None,
        facts: RunFacts | None = None,
    ) -> None:
        """``background``: saves may run in the background (``save(background=True)``); makes the
        saves' own process group (collective: every rank constructs its Checkpointer alike).
        ``facts``: the run plan's derived numbers, recorded in meta.json's ``plan`` (micro-batch,
        accumulation, z split, optimizer mode: what a resume compares, :meth:`RunFacts.changes_from`)."""
        self.dir, self.cfg, self.comm, self.model, self.opt = Path(out) / "checkpoints", cfg, comm, model, opt
        self.facts = facts
        self.data_state = data_state
        """``step -> dict``: where the data stream stands after ``step`` steps (meta.json's ``data``)."""
        self.last: Path | None = None
        self.last_save: dict = {}
        self._job = None
        self._buffers: dict = {}
        self._pg = None
        if background and comm.grid.world_size > 1 and dist.is_initialized():
            timeout = datetime.timedelta(seconds=cfg.parallel.init_timeout_s)
            self._pg = dist.new_group(backend="gloo", timeout=timeout)
            register_closable(self)

    def _rank0(self, fn, tmp: Path | None = None, group=None) -> None:
        """Run ``fn`` on rank 0; an OSError (or CheckpointError) there stops every rank alike with
        CheckpointWriteError, after rank 0 removed the partial folder ``tmp`` (shared over ``group``,
        a save's :class:`~axo4d.training.checkpointing.background.Group`; default the world of ``comm``)."""
        err = None
        if self.comm.rank == 0:
            try:
                fn()
            except OSError as e:
                err = self._write_failure(f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else ""), tmp, e)
            except CheckpointError as e:
                err = self._write_failure(str(e), tmp, e)
        err = group.share(err) if group is not None else self.comm.broadcast_object(err)
        if err is not None:
            raise agreed(CheckpointWriteError(err))

    def _write_failure(self, why: str, tmp: Path | None, exc: BaseException | str) -> str:
        """Rank 0: the one-line reason a save failed (saying so when the disk is full); removes ``tmp``."""
        full = tmp is not None and integrity.is_out_of_space(exc, self.dir)
        if full:
            why += f"; the disk is full ({integrity.mib(integrity.free_bytes(self.dir))} free)"
        if tmp is not None:
            integrity.remove_tree(tmp)
            why += f"; the partial checkpoint {tmp.name} was removed"
        return f"saving a checkpoint in {str(self.dir)!r} failed: {why}"

    def expected_bytes(self) -> int:
        """Size of the next checkpoint: the largest complete one of this run, else an estimate
        (fp32 weights, and two fp32 AdamW moments per weight when the optimizer is saved)."""
        sizes = []
        for c in [*complete_checkpoints(self.dir), *([self.last] if self.last else [])]:
            try:
                sizes.append(integrity.total_bytes(read_manifest(c)))
            except CheckpointError:
                pass
        if sizes:
            return max(sizes)
        n = sum(math.prod(s) for s in self._shapes().values())
        return int(1.05 * n * (12 if self.opt is not None else 4)) + 65536 * self.comm.grid.world_size

    def check_space_at_start(self, start: int = 0) -> None:
        """Rank 0, before training from step ``start``: CheckpointError when the run will save a
        checkpoint and one does not fit on the disk of ``out`` (a long run must not die at its first save)."""
        c, steps = self.cfg.checkpoint, self.cfg.train.steps
        saves = start < steps and (c.at_end or (c.interval > 0 and steps // c.interval > start // c.interval))
        if not saves:
            return
        short = integrity.space_problem(self.dir, self.expected_bytes())
        if short:
            raise CheckpointError(
                f"{short}; free some space, use another --out, or train without checkpoints "
                f"(checkpoint.interval=0 checkpoint.at_end=false)"
            )

    def _check_finite(self, step: int) -> None:
        """Refuse (on every rank alike) to save a model whose weights hold NaN or infinity."""
        local = any(not bool(torch.isfinite(p).all()) for p in self.model.parameters())
        if any(self.comm.all_gather_object(local)):
            raise agreed(
                TrainError(
                    f"the weights after step {step} are not finite (the model diverged): not "
                    f"saving them; last checkpoint: {self.last or 'none'}"
                )
            )

    def meta(self, step: int) -> dict:
        g = self.comm.grid
        return {
            "format": FORMAT,
            "step": step,
            "grid": g.spec(),
            "order": ",".join(g.order),
            "world_size": g.world_size,
            "optimizer": self.opt is not None,
            "torch": torch.__version__,
            "expert": g.expert,
            "tensors": {k: list(v) for k, v in self._shapes().items()},
            **({"data": self.data_state(step)} if self.data_state is not None else {}),
            **({"plan": self.facts.to_dict()} if self.facts is not None else {}),
        }

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """Logical shapes of every parameter of the model, those only other ranks hold included."""
        return {**logical_shapes(self.model), **getattr(self.model, "remote_shapes", dict)()}

    def save(self, step: int, replace: bool = True, keep: int | None = None, background: bool = False) -> Path:
        """Write the state after ``step`` completed steps to ``checkpoints/step_<step>`` (collective).

        ``replace``: an existing folder of that step is replaced (else: CheckpointWriteError);
        ``keep``: complete checkpoints kept afterwards (None: ``checkpoint.keep``; 0: all);
        ``background``: return once the state is copied to host memory and let the write go on
        (:mod:`axo4d.training.checkpointing.background`; :meth:`wait`, :meth:`failed`). A save in flight
        is waited for first (its failure raised here)."""
        t0 = time.perf_counter()
        self.wait()
        keep = self.cfg.checkpoint.keep if keep is None else keep
        tmp, final = self.dir / f".{step_dir_name(step)}.partial", self.dir / step_dir_name(step)
        background = background and (self._pg is not None or self.comm.grid.world_size == 1)
        with self.comm.timeout(self.cfg.parallel.init_timeout_s):
            if hasattr(self.opt, "settle"):  # the sharded optimizer's weight gathers still in flight
                self.opt.settle()
            self._check_finite(step)
            self._rank0(lambda: self._fresh_tmp(tmp, final, replace))
            state = save_state(self.model, self.opt, step, self.comm)
            if background:
                state = stage(state, self._buffers)
            self.comm.fault_point("stage")
            group = Group(self.comm, self._pg if background else None)
            job = SaveJob(self, step, tmp, final, state, replace, keep, group, time.perf_counter() - t0)
            job.on_done = self._done
            if not background:
                job.run()
                if job.error is not None:
                    raise job.error
                return final
        job.start()
        self._job = job
        return final

    def wait(self, raise_error: bool = True) -> Path | None:
        """Wait for the save in flight, if any; its failure raised (``raise_error``) or dropped.
        Returns the newest complete checkpoint."""
        job, self._job = self._job, None
        if job is not None:
            err = job.join()
            if err is not None and raise_error:
                raise err
        return self.last

    def failed(self) -> bool:
        """Whether the save in flight has ended with an error (not waiting for it)."""
        return self._job is not None and self._job.failed()

    @property
    def in_flight(self) -> bool:
        return self._job is not None and not self._job.done()

    def _fresh_tmp(self, tmp: Path, final: Path, replace: bool) -> None:
        """Rank 0: the partial folder of a new save (free space checked; a crashed save's leftovers removed)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.glob(".step_*.partial"):  # no save is in flight
            integrity.remove_tree(old)
        if not replace and final.exists():
            raise CheckpointError(f"{str(final)!r} already exists: not replacing it")
        short = integrity.space_problem(self.dir, self.expected_bytes())
        if short:
            raise CheckpointError(
                f"{short}; free some space or lower checkpoint.keep; last checkpoint: {self.last or 'none'}"
            )
        tmp.mkdir()

    def _complete(
        self, tmp: Path, final: Path, step: int, hashed: dict, replace: bool, keep: int, timing: dict
    ) -> None:
        """Rank 0, after every rank wrote: config, meta, ``COMPLETE`` (with the save's timing), rename, prune."""
        finalize(tmp, final, self.cfg, self.meta(step), hashed, replace, self.comm.fault_point, timing)
        if keep > 0:
            prune(self.dir, keep)

    def _done(self, job) -> None:
        self.last = job.final
        self.last_save = {"step": job.step, "blocked_s": job.blocked_s, "write_s": job.write_s, "path": job.final}
        if self.comm.rank == 0 and job.thread is not None:
            print(
                f"checkpoint {job.final} complete (written in the background in {job.write_s:.2f} s; "
                f"training was blocked {job.blocked_s:.2f} s)",
                flush=True,
            )

    def close(self) -> None:
        """Destroy the saves' process group (after the save in flight, if it can end); idempotent."""
        if self._job is not None:
            self._job.join(SHUTDOWN_WAIT_S)
        pg, self._pg = self._pg, None
        if pg is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group(pg)

    def load(self, ckpt: Path, saved_grid: str = "") -> int:
        """Load ``ckpt`` (found and checked by :func:`axo4d.training.checkpointing.resume.choose_resume`) onto this
        grid; returns its step."""
        with self.comm.timeout(self.cfg.parallel.init_timeout_s):
            if hasattr(self.opt, "settle"):  # no weight gather in flight may land over what is loaded
                self.opt.settle()
            return self._load(ckpt, saved_grid)

    def _load(self, ckpt: Path, saved_grid: str) -> int:
        self.comm.fault_point("load")
        res = None
        if self.comm.rank == 0:
            try:
                res = check_tensors(ckpt, self.model)
            except CheckpointError as e:
                res = e
        res = self.comm.broadcast_object(res)
        if isinstance(res, CheckpointError):
            raise res
        same_grid = saved_grid == self.comm.grid.spec()
        step = read_shards(ckpt, self.model, self.opt, self.comm, load_rng=same_grid, optimizer_state=bool(res))
        self.last = ckpt
        return step
