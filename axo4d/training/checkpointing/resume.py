"""Choosing the checkpoint a run resumes from, and checking it before anything is read or written.

``--resume PATH`` names a checkpoint folder (or a run folder: its newest complete checkpoint);
``--resume auto`` takes the newest complete checkpoint in ``--out`` and, when that one fails its
checks, the next older one (with a warning) -- never a silent fresh start. Rank 0 finds the
checkpoint and reads its manifest, meta and config (:func:`resolve_resume`); then every rank
verifies a share of the files' checksums and all agree (:func:`verify_checkpoint`,
:func:`choose_resume`). The folder protocol is :mod:`axo4d.training.checkpointing.checkpointer`.
"""

from __future__ import annotations

from pathlib import Path

from axo4d.config import RunConfig, TrainConfig
from axo4d.config.errors import CheckpointError, agreed
from axo4d.dist.comm import Comm
from axo4d.facts.run import RunFacts
from axo4d.training.checkpointing import integrity
from axo4d.training.checkpointing.checkpointer import (
    check_model_config,
    complete_checkpoints,
    corrupt,
    find_checkpoint,
    read_info,
)


def verify_checkpoint(ckpt: Path, manifest: dict, comm: Comm) -> dict:
    """Collective: every rank checks its share of the files' checksums; all agree on the outcome.

    Raises the same :class:`CheckpointError` (naming the file) on every rank when one fails;
    returns ``{'bytes', 'seconds', 'ranks', 'checked'}`` (``checked``: whether checksums exist)."""
    names = integrity.share_out(manifest, comm.grid.world_size)[comm.rank]
    try:
        bad, nbytes, secs = integrity.verify(ckpt, manifest, names)
    except OSError as e:
        bad, nbytes, secs = f"{e.strerror or e} ({e.filename})", 0, 0.0
    outcomes = comm.all_gather_object((bad, nbytes, secs))
    problem = next((b for b, _, _ in outcomes if b), None)
    if problem:
        raise agreed(corrupt(ckpt, problem))
    return {
        "bytes": sum(o[1] for o in outcomes),
        "seconds": max(o[2] for o in outcomes),
        "ranks": comm.grid.world_size,
        "checked": integrity.has_checksums(manifest),
    }


def resolve_resume(arg: str | None, out: Path, cfg: RunConfig, skip: dict[str, str] | None = None) -> dict | None:
    """The checkpoint to resume from (``--resume``): None, 'auto' (newest in ``out``) or a path.

    Returns ``{'path', 'step', 'grid', 'config', 'files', 'data', 'plan', 'warnings'}`` after checking the files'
    sizes and the model config. With 'auto' a corrupt checkpoint (or one in ``skip``: path -> why)
    is passed over for the next older one, with a warning; none usable is an error naming the first
    reason, never a fresh start.
    """
    if not arg:
        return None
    warnings: list[str] = []
    if arg == "auto":
        skip = skip or {}
        found = [c for c in reversed(complete_checkpoints(Path(out) / "checkpoints")) if str(c) not in skip]
        if not found and not skip:
            return None
        for ckpt in found:
            try:
                info = read_info(ckpt)
                break
            except CheckpointError as e:
                warnings.append(f"{e}; trying the previous checkpoint")
        else:
            why = [*skip.values(), *(w.rsplit("; trying", 1)[0] for w in warnings)][0]
            raise CheckpointError(
                f"no usable checkpoint in {str(Path(out) / 'checkpoints')!r} for --resume auto "
                f"(move them away to start afresh): {why}"
            )
    else:
        ckpt = find_checkpoint(arg)
        info = read_info(ckpt)
    check_model_config(info["config"], cfg, ckpt)
    return {
        "path": str(ckpt),
        "step": int(info["step"]),
        "grid": info.get("grid", ""),
        "config": info["config"],
        "files": info["files"],
        "data": info.get("data"),
        "plan": info.get("plan"),  # the saving run's derived numbers (None: saved before they were recorded)
        "warnings": warnings,
    }


def choose_resume(arg: str | None, out: Path, cfg: RunConfig, comm: Comm) -> dict | None:
    """Collective: :func:`resolve_resume` on rank 0, then every rank verifies a share of the
    checkpoint's checksums (:func:`verify_checkpoint`). With 'auto' a checkpoint that fails is
    passed over for the next older one (a warning in ``'warnings'``); else the error stops every rank.
    The result gains ``'verified'``."""
    skip: dict[str, str] = {}
    warnings: list[str] = []
    while True:
        res: object = None
        if comm.rank == 0:
            try:
                res = resolve_resume(arg, out, cfg, skip)
            except CheckpointError as e:
                res = e
            except OSError as e:
                res = CheckpointError(f"cannot read checkpoint: {e.strerror or e} ({e.filename})")
        res = comm.broadcast_object(res)
        if isinstance(res, CheckpointError):
            raise agreed(res)
        if res is None:
            return None
        warnings += res["warnings"]
        try:
            res["verified"] = verify_checkpoint(Path(res["path"]), res["files"], comm)
        except CheckpointError as e:
            if arg != "auto":
                raise
            warnings.append(f"{e}; trying the previous checkpoint")
            skip[res["path"]] = str(e)
            continue
        res["warnings"] = warnings
        return res


#: train settings whose change makes a resumed run's loss leave the checkpoint's run
RESUME_TRAIN_KEYS = (
    "steps",
    "lr",
    "min_lr",
    "warmup_steps",
    "decay_steps",
    "global_batch",
    "seed",
    "goldfish_k",
    "goldfish_h",
)


def resume_changes(resume: dict, train: TrainConfig, facts: RunFacts) -> list[str]:
    """The notes a resumed run prints about what differs from the checkpoint's run (:func:`resolve_resume`'s
    ``resume``): its run plan (micro-batch, accumulation, z split, optimizer mode; none for a checkpoint
    saved before meta.json recorded the plan) and its train settings."""
    out = []
    changed = facts.changes_from(resume.get("plan"))
    if changed:
        out.append("note: the run plan differs from the checkpoint's run: " + ", ".join(changed))
    old = resume["config"].train
    diff = [k for k in RESUME_TRAIN_KEYS if getattr(old, k) != getattr(train, k)]
    if diff:
        out.append(
            "note: train settings differ from the checkpoint's run (the loss will not follow it exactly): "
            + ", ".join(f"train.{k} {getattr(old, k)} -> {getattr(train, k)}" for k in diff)
        )
    return out
