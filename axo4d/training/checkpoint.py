"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save, find, load on any grid.

A checkpoint is a folder ``OUT/checkpoints/step_000123`` (the state after 123
completed optimizer steps, so training resumes at step 123)::

    .metadata, __<rank>_0.distcp   DCP: tensors of the full logical shapes, chunks written by their holders
    config.yaml                    the resolved config of the run that saved it
    meta.json                      format, step, grid, order, world size, tensor shapes, torch version
    COMPLETE                       written last: a manifest {file: bytes} of everything above

DCP keys: ``model/<param name>`` (full shape; the LM head without vocabulary
padding), ``optim/<param name>/{exp_avg,exp_avg_sq}`` (sharded like the
parameter), ``optim/<param name>/step``, ``train/step``, and ``rng/rank<r>``
(torch, numpy and Python RNG states of rank ``r``). How each rank writes just
its own shard and reads just what its new shard needs is in :mod:`axo4d.training.shards`.
The LR schedule and the data position are pure functions of the step, so the
step is all the schedule state there is.

Atomicity: ranks write into ``.step_000123.partial``; after every rank is done,
rank 0 writes ``config.yaml``, ``meta.json``, then ``COMPLETE`` and renames the
folder to ``step_000123``. Only folders named ``step_N`` holding ``COMPLETE``
count; a crash mid-save leaves the previous checkpoints untouched, and older
ones are pruned (``checkpoint.keep``) only once the new one is complete.

The command line (``python -m axo4d.checkpoint``) is :mod:`axo4d.checkpoint`. ``import`` writes ``RUN/checkpoints/step_N`` (weights only: the optimizer starts fresh);
``--resume RUN`` then trains from it on any grid.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
import yaml
from torch import nn

from axo4d.config import RunConfig, config_from_dict, config_to_dict, dump_config
from axo4d.dist.comm import Comm
from axo4d.dist.placement import placement_of
from axo4d.errors import CheckpointError, CheckpointWriteError, ConfigError
from axo4d.training.shards import first_failure, logical_shapes, read_shards, single_process, write_shards

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
        raise CheckpointError(f"checkpoint {str(path)!r} is not a folder (give a checkpoint folder "
                              f"step_N or a run folder holding checkpoints/)")
    if (p / "COMPLETE").is_file() or (p / ".metadata").exists() or p.name.endswith(".partial"):
        if not is_complete(p):
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete (no COMPLETE marker: "
                                  "its save did not finish); use an earlier one")
        return p
    for folder in (p / "checkpoints", p):
        found = complete_checkpoints(folder)
        if found:
            return found[-1]
    raise CheckpointError(f"no complete checkpoint in {str(path)!r} (looked for step_N folders with a "
                          f"COMPLETE marker in it and in its checkpoints/)")


def read_info(ckpt: Path) -> dict:
    """Validate a complete checkpoint's files; returns meta.json plus ``config`` (a RunConfig)."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {str(ckpt)!r} is corrupt: {why}")
    try:
        manifest = json.loads((ckpt / "COMPLETE").read_text())["files"]
        meta = json.loads((ckpt / "meta.json").read_text())
        raw_cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as e:
        raise bad(f"{type(e).__name__}: {e}") from None
    for name, size in manifest.items():
        f = ckpt / name
        if not f.is_file():
            raise bad(f"file {name!r} is missing")
        if f.stat().st_size != size:
            raise bad(f"file {name!r} has {f.stat().st_size} bytes, {size} were written (truncated or modified)")
    if meta.get("format") != FORMAT:
        raise bad(f"format {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        meta["config"] = config_from_dict(raw_cfg)
    except ConfigError as e:
        raise bad(f"its config.yaml: {e}") from None
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
        raise CheckpointError(f"checkpoint {str(ckpt)!r} is corrupt: cannot read its DCP .metadata "
                              f"({type(e).__name__}: {e})") from None
    saved = {k[6:]: tuple(v.size) for k, v in md.items() if k.startswith("model/")}
    want = logical_shapes(model)
    for name, shape in want.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint {str(ckpt)!r} does not fit this model: it has no parameter "
                                  f"{name!r} (shape {shape})")
        if saved[name] != shape:
            raise CheckpointError(f"checkpoint {str(ckpt)!r} does not fit this model: parameter {name!r} "
                                  f"has shape {saved[name]} in the checkpoint, {shape} in this model")
    extra = sorted(set(saved) - set(want))
    if extra:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} does not fit this model: it has parameter "
                              f"{extra[0]!r} {saved[extra[0]]} that this model lacks")
    return all(f"optim/{n}/exp_avg" in md for n in want)


def finalize(tmp: Path, final: Path, cfg: RunConfig, meta: dict) -> None:
    """Rank 0, after every rank wrote: config, meta, COMPLETE manifest, atomic rename."""
    dump_config(cfg, tmp / "config.yaml")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
    with open(tmp / "COMPLETE", "w") as f:
        json.dump({"files": files, "time": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    trash = final.with_name(f".{final.name}.old")
    if final.exists():                      # an older run's checkpoint of the same step
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
    removed += [p for p in folder.glob(".step_*.partial") if p.is_dir()]   # no save is in flight now
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


# ---- the run's checkpointer --------------------------------------------------------------
class Checkpointer:
    """Saves and loads this run's checkpoints under ``out/checkpoints`` (collective calls)."""

    def __init__(self, out: Path, cfg: RunConfig, comm: Comm, model: nn.Module,
                 opt: torch.optim.Optimizer | None) -> None:
        self.dir, self.cfg, self.comm, self.model, self.opt = Path(out) / "checkpoints", cfg, comm, model, opt
        self.last: Path | None = None

    def _rank0(self, fn) -> None:
        """Run ``fn`` on rank 0; an OSError there stops every rank with CheckpointWriteError."""
        err = None
        if self.comm.rank == 0:
            try:
                fn()
            except OSError as e:
                err = f"rank 0: {e.strerror or e} ({e.filename or self.dir})"
        err = self.comm.broadcast_object(err)
        if err is not None:
            raise CheckpointWriteError(f"saving a checkpoint in {str(self.dir)!r} failed: {err}")

    def meta(self, step: int) -> dict:
        g = self.comm.grid
        return {"format": FORMAT, "step": step, "grid": g.spec(), "order": ",".join(g.order),
                "world_size": g.world_size, "optimizer": self.opt is not None, "torch": torch.__version__,
                "tensors": {k: list(v) for k, v in logical_shapes(self.model).items()}}

    def save(self, step: int) -> Path:
        """Write the state after ``step`` completed steps to ``checkpoints/step_<step>``."""
        tmp, final = self.dir / f".{step_dir_name(step)}.partial", self.dir / step_dir_name(step)

        def fresh_tmp() -> None:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self._rank0(fresh_tmp)
        write_shards(tmp, self.model, self.opt, step, self.comm)

        def complete() -> None:
            finalize(tmp, final, self.cfg, self.meta(step))
            prune(self.dir, self.cfg.checkpoint.keep)
        self._rank0(complete)
        self.last = final
        return final

    def load(self, ckpt: Path, saved_grid: str = "") -> int:
        """Load ``ckpt`` (found and checked by :func:`resolve_resume`) onto this grid; returns its step."""
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
        step = read_shards(ckpt, self.model, self.opt if res else None, self.comm, load_rng=same_grid)
        self.last = ckpt
        return step


def resolve_resume(arg: str | None, out: Path, cfg: RunConfig) -> dict | None:
    """The checkpoint to resume from (``--resume``): None, 'auto' (newest in ``out``) or a path.

    Returns ``{'path', 'step', 'grid', 'config'}`` after checking the files and the model config.
    """
    if not arg:
        return None
    if arg == "auto":
        found = complete_checkpoints(Path(out) / "checkpoints")
        if not found:
            return None
        ckpt = found[-1]
    else:
        ckpt = find_checkpoint(arg)
    info = read_info(ckpt)
    check_model_config(info["config"], cfg, ckpt)
    return {"path": str(ckpt), "step": int(info["step"]), "grid": info.get("grid", ""), "config": info["config"]}


# ---- single-file export / import ------------------------------------------------------------
def export_safetensors(ckpt: str | Path, out_file: str | Path) -> dict[str, tuple[int, ...]]:
    """Write the model of a checkpoint as one safetensors file of full tensors keyed by parameter name."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    ckpt = find_checkpoint(ckpt)
    info = read_info(ckpt)
    try:
        md = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} is corrupt: cannot read its .metadata ({e})") from None
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
          for k, v in md.items() if k.startswith("model/")}
    try:
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=single_process() or True)
    except dcp.CheckpointException as e:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} cannot be read: {first_failure(e)}") from None
    tensors = {k[6:]: v.contiguous() for k, v in sd.items()}
    cfg_yaml = yaml.safe_dump(config_to_dict(info["config"]), sort_keys=False)
    save_file(tensors, str(out_file), metadata={"format": "axo4d-full/1", "step": str(info["step"]),
                                                "config": cfg_yaml})
    return {k: tuple(v.shape) for k, v in tensors.items()}


@torch.no_grad()
def import_safetensors(in_file: str | Path, out: str | Path, cfg: RunConfig, step: int = 0) -> Path:
    """Create ``out/checkpoints/step_<step>`` (weights only; fresh optimizer) from a safetensors file.

    Checkpoints do not depend on the grid, so the result resumes on any grid of ``cfg``'s model.
    The model is built once on a single process to check names and shapes.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from axo4d.dist.grid import Grid
    from axo4d.models import build_model
    from axo4d.nn.context import as_context
    try:
        sd = load_file(str(in_file))
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"cannot read safetensors file {str(in_file)!r}: {e}") from None
    comm = Comm(Grid(), 0, init_groups=False)
    model = build_model(cfg.model, as_context(comm), seed=cfg.train.seed)
    shapes = logical_shapes(model)
    for name, p in model.named_parameters():
        if name not in sd:
            raise CheckpointError(f"{str(in_file)!r} has no tensor {name!r} (shape {shapes[name]}) of this model")
        if tuple(sd[name].shape) != shapes[name]:
            raise CheckpointError(f"{str(in_file)!r}: tensor {name!r} has shape {tuple(sd[name].shape)}, "
                                  f"this model needs {shapes[name]}")
        full = p.data.view(placement_of(p).full_shape)
        full.zero_()
        full[tuple(slice(0, n) for n in shapes[name])].copy_(sd[name])
    extra = sorted(set(sd) - set(shapes))
    if extra:
        raise CheckpointError(f"{str(in_file)!r} has tensor {extra[0]!r} that this model lacks")
    ck = Checkpointer(Path(out), cfg, comm, model, None)
    return ck.save(step)
