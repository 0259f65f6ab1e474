"""A checkpoint as one safetensors file of full tensors, and back (single process).

``export_safetensors`` writes the model of a checkpoint (its files verified first) keyed by
parameter name; ``import_safetensors`` creates ``RUN/checkpoints/step_N`` with the weights only
(a fresh optimizer), refusing to replace an existing checkpoint and pruning nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml

from axo4d.config import RunConfig, config_to_dict
from axo4d.config.errors import CheckpointError, CheckpointWriteError
from axo4d.dist.comm import Comm
from axo4d.facts.placement import placement_of
from axo4d.training.checkpointing.checkpointer import Checkpointer, find_checkpoint, read_info, step_dir_name
from axo4d.training.checkpointing.shards import first_failure, logical_shapes, single_process


def export_safetensors(ckpt: str | Path, out_file: str | Path) -> dict[str, tuple[int, ...]]:
    """Write the model of a checkpoint as one safetensors file of full tensors keyed by parameter name."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    out_file = Path(out_file)
    if not out_file.parent.is_dir():
        raise CheckpointError(f"cannot write {str(out_file)!r}: folder {str(out_file.parent)!r} does not exist")
    ckpt = find_checkpoint(ckpt)
    info = read_info(ckpt, verify=True)
    try:
        md = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} is corrupt: cannot read its .metadata ({e})") from None
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items() if k.startswith("model/")}
    try:
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(ckpt)), no_dist=single_process() or True)
    except dcp.CheckpointException as e:
        raise CheckpointError(f"checkpoint {str(ckpt)!r} cannot be read: {first_failure(e)}") from None
    tensors = {k[6:]: v.contiguous() for k, v in sd.items()}
    cfg_yaml = yaml.safe_dump(config_to_dict(info["config"]), sort_keys=False)
    tmp = out_file.with_name(f".{out_file.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": "axo4d-full/1", "step": str(info["step"]), "config": cfg_yaml})
        os.replace(tmp, out_file)
    except OSError as e:
        raise CheckpointError(f"cannot write {str(out_file)!r}: {e.strerror or e}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return {k: tuple(v.shape) for k, v in tensors.items()}


@torch.no_grad()
def import_safetensors(in_file: str | Path, out: str | Path, cfg: RunConfig, step: int = 0) -> Path:
    """Create ``out/checkpoints/step_<step>`` (weights only; fresh optimizer) from a safetensors file.

    Checkpoints do not depend on the grid, so the result resumes on any grid of ``cfg``'s model.
    The model is built once on a single process to check names and shapes. An existing checkpoint
    of that step is an error (never replaced), and no checkpoint is pruned.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from axo4d.facts.grid import Grid
    from axo4d.models import build_model
    from axo4d.nn.context import as_context

    if step < 0:
        raise CheckpointError(f"--step {step} must be >= 0")
    final = Path(out) / "checkpoints" / step_dir_name(step)
    if final.exists():
        raise CheckpointError(
            f"{str(final)!r} already exists: import does not replace checkpoints "
            f"(choose another --step or another run folder)"
        )
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
            raise CheckpointError(
                f"{str(in_file)!r}: tensor {name!r} has shape {tuple(sd[name].shape)}, this model needs {shapes[name]}"
            )
        full = p.data.view(placement_of(p).full_shape)
        full.zero_()
        full[tuple(slice(0, n) for n in shapes[name])].copy_(sd[name])
    extra = sorted(set(sd) - set(shapes))
    if extra:
        raise CheckpointError(f"{str(in_file)!r} has tensor {extra[0]!r} that this model lacks")
    ck = Checkpointer(Path(out), cfg, comm, model, None)
    try:
        return ck.save(step, replace=False, keep=0)
    except CheckpointWriteError as e:
        raise CheckpointError(str(e)) from None
