"""A checkpoint folder on disk: finding complete checkpoints, reading and checking their manifest,
meta and config, completing a written one (``COMPLETE`` last, the atomic rename) and pruning.
The protocol: :mod:`axo4d.training.checkpointing.checkpointer`; the checksums:
:mod:`axo4d.training.checkpointing.integrity`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable

import yaml
from torch import nn

from axo4d.config import RunConfig, config_from_dict, config_to_dict, dump_config
from axo4d.config.errors import CheckpointError, ConfigError
from axo4d.training.checkpointing import integrity
from axo4d.training.checkpointing.shards import logical_shapes

FORMAT = "axo4d-dcp/1"
STEP_RE = re.compile(r"^step_(\d+)$")
#: model config keys that do not change what the weights mean (MoE: whether and how much the
#: load-balancing loss enters the training loss; a resumed run may change them)
_IGNORED_MODEL_KEYS = ("init_std", "vocab_multiple", "router_aux_loss_coef", "output_router_logits")


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
    """``{file: entry}`` of a checkpoint's ``COMPLETE`` (see :mod:`axo4d.training.checkpointing.integrity`)."""
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
    # the parameters other ranks hold too (the experts of the other positions of an expert group)
    want = {**logical_shapes(model), **getattr(model, "remote_shapes", dict)()}
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
    timing: dict | None = None,
) -> None:
    """Rank 0, after every rank wrote: config, meta, the COMPLETE manifest (sizes and CRC-32s:
    ``hashed`` by the writers as they wrote, the rest here; ``timing``: how long the save blocked
    training and took, recorded beside them), atomic rename. ``replace=False``: an existing
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
    t = time.time()
    record = {"files": dict(sorted(files.items())), "hash": integrity.HASH, "time": t}
    if timing:
        record["save"] = {**timing, "seconds": round(t - timing.get("started", t), 4)}
    with open(tmp / "COMPLETE", "w") as f:
        json.dump(record, f)
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


__all__ = [
    "FORMAT",
    "STEP_RE",
    "step_dir_name",
    "is_complete",
    "complete_checkpoints",
    "find_checkpoint",
    "corrupt",
    "read_manifest",
    "read_info",
    "check_model_config",
    "check_tensors",
    "finalize",
    "prune",
]
