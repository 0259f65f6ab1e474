"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save, find, load on any grid.

A checkpoint is a folder ``OUT/checkpoints/step_000123`` (the state after 123
completed optimizer steps, so training resumes at step 123)::

    .metadata, __<rank>_0.distcp   DCP: tensors of the full logical shapes, chunks written by their holders
    config.yaml                    the resolved config of the run that saved it
    meta.json                      format, step, grid, order, world size, tensor shapes, torch version
    COMPLETE                       written last: a manifest {file: {bytes, crc32}} of everything above

DCP keys: ``model/<param name>`` (full shape; the LM head without vocabulary
padding), ``optim/<param name>/{exp_avg,exp_avg_sq}`` (sharded like the
parameter), ``optim/<param name>/step``, ``train/step``, and ``rng/rank<r>``
(torch, numpy and Python RNG states of rank ``r``). How each rank writes just
its own shard and reads just what its new shard needs is in :mod:`axo4d.training.checkpoint.shards`.
The LR schedule and the data position are pure functions of the step, so the
step is all the schedule state there is.

Atomicity: ranks write into ``.step_000123.partial``; after every rank is done,
rank 0 writes ``config.yaml``, ``meta.json``, then ``COMPLETE`` and renames the
folder to ``step_000123``. Only folders named ``step_N`` holding ``COMPLETE``
count; a crash mid-save leaves the previous checkpoints untouched, and older
ones are pruned (``checkpoint.keep``) only once the new one is complete.

Integrity (:mod:`axo4d.training.checkpoint.integrity`): ``COMPLETE`` records the size and CRC-32 of every
file, hashed by the ranks that wrote them; a resume checks them (each rank a share of the files)
before anything is read or written, and a mismatch is one :class:`CheckpointError` naming the
file. Before a save rank 0 checks the free space against the checkpoint's size; a save that fails
(a full disk, a dead rank) removes its partial folder. A model with non-finite weights is never
saved. Saves and loads run under the start-up timeout (``parallel.init_timeout_s``).

Choosing and verifying the checkpoint to resume from: :mod:`axo4d.training.checkpoint.resume`; one
safetensors file and back: :mod:`axo4d.training.checkpoint.single_file`; the command line
(``python -m axo4d.checkpoint``): :mod:`axo4d.checkpoint`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
import yaml
from torch import nn

from axo4d.config import RunConfig, config_from_dict, config_to_dict, dump_config
from axo4d.dist.comm import Comm
from axo4d.errors import CheckpointError, CheckpointWriteError, ConfigError, TrainError, agreed
from axo4d.training.checkpoint import integrity
from axo4d.training.checkpoint.shards import logical_shapes, read_shards, write_shards

FORMAT = "axo4d-dcp/1"
STEP_RE = re.compile(r"^step_(\d+)$")
#: model config keys that do not change what the weights mean
_IGNORED_MODEL_KEYS = ("init_std", "vocab_multiple")


# ---- finding checkpoints -------------------------------------------------------------
def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def is_complete(path: Path) -> bool:
    return STEP_RE.match(path.name) is not None and (path / "COMPLETE").is_file()


def complete_checkpoints(folder: str | Path) -> list[Path]:
    """Complete checkpoints directly under ``folder``, oldest step first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(STEP_RE.match(p.name).group(1)))


def find_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint: ``path`` itself, or the newest one in a run or checkpoints folder."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not p.is_dir():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not a folder (give a checkpoint folder "
            f"step_N or a run folder holding checkpoints/)"
        )
    if (p / "COMPLETE").is_file() or (p / ".metadata").exists() or p.name.endswith(".partial"):
        if not is_complete(p):
            raise CheckpointError(
                f"checkpoint {str(path)!r} is incomplete (no COMPLETE marker: "
                "its save did not finish); use an earlier one"
            )
        return p
    for folder in (p / "checkpoints", p):
        found = complete_checkpoints(folder)
        if found:
            return found[-1]
    raise CheckpointError(
        f"no complete checkpoint in {str(path)!r} (looked for step_N folders with a "
        f"COMPLETE marker in it and in its checkpoints/)"
    )


def corrupt(ckpt: Path, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {str(ckpt)!r} is corrupt: {why}")


def read_manifest(ckpt: Path) -> dict:
    """``{file: entry}`` of a checkpoint's ``COMPLETE`` (see :mod:`axo4d.training.checkpoint.integrity`)."""
    try:
        files = json.loads((ckpt / "COMPLETE").read_text())["files"]
        total = integrity.total_bytes(files)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise corrupt(ckpt, f"its COMPLETE manifest: {type(e).__name__}: {e}") from None
    if not isinstance(files, dict) or total < 0:
        raise corrupt(ckpt, "its COMPLETE manifest holds no file list")
    return files


def read_info(ckpt: Path, verify: bool = False) -> dict:
    """Validate a complete checkpoint's files (sizes; with ``verify`` also every checksum, read by a
    few threads); returns meta.json plus ``config`` (a RunConfig) and ``files`` (the manifest).
    A job of many ranks verifies in parallel instead: :func:`verify_checkpoint`."""
    manifest = read_manifest(ckpt)
    for name in ("meta.json", "config.yaml"):
        bad = integrity.content_problem(ckpt, name, manifest[name]) if name in manifest else None
        if bad:
            raise corrupt(ckpt, bad)
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        raw_cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as e:
        raise corrupt(ckpt, f"{type(e).__name__}: {e}") from None
    problems = [integrity.size_problem(ckpt, n, e) for n, e in manifest.items()]
    if verify:
        problems.append(integrity.verify(ckpt, manifest)[0])
    if meta.get("format") != FORMAT:
        problems.append(f"format {meta.get('format')!r}, expected {FORMAT!r}")
    first = next((p for p in problems if p), None)
    if first:
        raise corrupt(ckpt, first)
    try:
        meta["config"] = config_from_dict(raw_cfg)
    except ConfigError as e:
        raise corrupt(ckpt, f"its config.yaml: {e}") from None
    meta["files"] = manifest
    return meta


def check_model_config(saved: RunConfig, cfg: RunConfig, ckpt: Path) -> None:
    """Refuse a checkpoint of another model, naming the first differing keys."""
    a, b = config_to_dict(saved.model), config_to_dict(cfg.model)
    diff = [k for k in a if k not in _IGNORED_MODEL_KEYS and a[k] != b.get(k)]
    if diff:
        pairs = ", ".join(f"model.{k}={a[k]!r} (this run: {b.get(k)!r})" for k in diff[:4])
        raise CheckpointError(f"checkpoint {str(ckpt)!r} is of another model: it was saved with {pairs}")


def check_tensors(ckpt: Path, model: nn.Module) -> bool:
    """Compare the checkpoint's tensors with the model's; returns whether optimizer state is stored."""
    import torch.distributed.checkpoint as dcp

    try:
        md = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except Exception as e:  # unpickling garbage can raise nearly anything
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} is corrupt: cannot read its DCP .metadata ({type(e).__name__}: {e})"
        ) from None
    saved = {k[6:]: tuple(v.size) for k, v in md.items() if k.startswith("model/")}
    want = logical_shapes(model)
    for name, shape in want.items():
        if name not in saved:
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r} does not fit this model: it has no parameter {name!r} (shape {shape})"
            )
        if saved[name] != shape:
            raise CheckpointError(
                f"checkpoint {str(ckpt)!r} does not fit this model: parameter {name!r} "
                f"has shape {saved[name]} in the checkpoint, {shape} in this model"
            )
    extra = sorted(set(saved) - set(want))
    if extra:
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r} does not fit this model: it has parameter "
            f"{extra[0]!r} {saved[extra[0]]} that this model lacks"
        )
    return all(f"optim/{n}/exp_avg" in md for n in want)


def finalize(
    tmp: Path,
    final: Path,
    cfg: RunConfig,
    meta: dict,
    hashed: dict | None = None,
    replace: bool = True,
    fault_point: Callable[[str], None] = lambda point: None,
) -> None:
    """Rank 0, after every rank wrote: config, meta, the COMPLETE manifest (sizes and CRC-32s:
    ``hashed`` by the writers, the rest here), atomic rename. ``replace=False``: an existing
    ``final`` is an error instead of being replaced."""
    dump_config(cfg, tmp / "config.yaml")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    for name in ("config.yaml", "meta.json"):  # on disk before COMPLETE says they are (DCP syncs its own)
        fd = os.open(tmp / name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    names = sorted(f.name for f in tmp.iterdir() if f.is_file())
    files = {n: e for n, e in (hashed or {}).items() if n in names}
    files.update(integrity.describe(tmp, [n for n in names if n not in files]))
    with open(tmp / "COMPLETE", "w") as f:
        json.dump({"files": dict(sorted(files.items())), "hash": integrity.HASH, "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    fault_point("finalize")
    if final.exists() and not replace:
        raise FileExistsError(17, "a checkpoint of this step already exists", str(final))
    trash = final.with_name(f".{final.name}.old")
    if final.exists():  # an older run's checkpoint of the same step
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(tmp, final)
    shutil.rmtree(trash, ignore_errors=True)
    try:
        fd = os.open(final.parent, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:
        pass


def prune(folder: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (0 = keep all) and stale partial folders."""
    done = complete_checkpoints(folder)
    removed = done[:-keep] if keep > 0 else []
    removed += [p for p in folder.glob(".step_*.partial") if p.is_dir()]  # no save is in flight now
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


# ---- the run's checkpointer --------------------------------------------------------------
class Checkpointer:
    """Saves and loads this run's checkpoints under ``out/checkpoints`` (collective calls)."""

    def __init__(
        self, out: Path, cfg: RunConfig, comm: Comm, model: nn.Module, opt: torch.optim.Optimizer | None
    ) -> None:
        self.dir, self.cfg, self.comm, self.model, self.opt = Path(out) / "checkpoints", cfg, comm, model, opt
        self.last: Path | None = None

    def _rank0(self, fn, tmp: Path | None = None) -> None:
        """Run ``fn`` on rank 0; an OSError (or CheckpointError) there stops every rank alike with
        CheckpointWriteError, after rank 0 removed the partial folder ``tmp``."""
        err = None
        if self.comm.rank == 0:
            try:
                fn()
            except OSError as e:
                err = self._write_failure(f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else ""), tmp, e)
            except CheckpointError as e:
                err = self._write_failure(str(e), tmp, e)
        err = self.comm.broadcast_object(err)
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
        n = sum(math.prod(s) for s in logical_shapes(self.model).values())
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
            "tensors": {k: list(v) for k, v in logical_shapes(self.model).items()},
        }

    def save(self, step: int, replace: bool = True, keep: int | None = None) -> Path:
        """Write the state after ``step`` completed steps to ``checkpoints/step_<step>`` (collective).

        ``replace``: an existing folder of that step is replaced (else: CheckpointWriteError);
        ``keep``: complete checkpoints kept afterwards (None: ``checkpoint.keep``; 0: all)."""
        with self.comm.timeout(self.cfg.parallel.init_timeout_s):
            if hasattr(self.opt, "settle"):  # the sharded optimizer's weight gathers still in flight
                self.opt.settle()
            self._check_finite(step)
            return self._save(step, replace, self.cfg.checkpoint.keep if keep is None else keep)

    def _save(self, step: int, replace: bool, keep: int) -> Path:
        tmp, final = self.dir / f".{step_dir_name(step)}.partial", self.dir / step_dir_name(step)

        def fresh_tmp() -> None:
            self.dir.mkdir(parents=True, exist_ok=True)
            for old in self.dir.glob(".step_*.partial"):  # a crashed save's leftovers: no save is in flight
                integrity.remove_tree(old)
            if not replace and final.exists():
                raise CheckpointError(f"{str(final)!r} already exists: not replacing it")
            short = integrity.space_problem(self.dir, self.expected_bytes())
            if short:
                raise CheckpointError(
                    f"{short}; free some space or lower checkpoint.keep; last checkpoint: {self.last or 'none'}"
                )
            tmp.mkdir()

        self._rank0(fresh_tmp)
        mine, why = {}, None
        try:  # a failed DCP write is raised on every rank; a rank's own OSError is shared
            write_shards(tmp, self.model, self.opt, step, self.comm)
            self.comm.fault_point("save")
            mine = integrity.describe(tmp, sorted(f.name for f in tmp.glob(f"__{self.comm.rank}_*")))
        except CheckpointWriteError as e:
            why = str(e)
        except OSError as e:
            why = f"rank {self.comm.rank}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else "")
        outcomes = self.comm.all_gather_object((why, mine))
        why = next((w for w, _ in outcomes if w), None)
        if why:
            raise agreed(CheckpointWriteError(self._write_failure(why, tmp, why) if self.comm.rank == 0 else why))
        hashed = {k: v for _, d in outcomes for k, v in d.items()}

        def complete() -> None:
            finalize(tmp, final, self.cfg, self.meta(step), hashed, replace, self.comm.fault_point)
            if keep > 0:
                prune(self.dir, keep)

        self._rank0(complete, tmp)
        self.last = final
        return final

    def load(self, ckpt: Path, saved_grid: str = "") -> int:
        """Load ``ckpt`` (found and checked by :func:`axo4d.training.checkpoint.resume.choose_resume`) onto this
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
