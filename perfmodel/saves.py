"""How long a checkpoint save takes, and how early a job must be warned to save before its end.

A checkpoint holds every parameter in fp32 and AdamW's two fp32 moments: 12 bytes per parameter
(4 without the optimizer). Every rank writes its own chunks in parallel (each element once), so
the file system's write rate per node, ``fs_write_gbps`` of the machine file (default
:data:`DEFAULT_FS_WRITE_GBPS`, an assumption, not a measurement: parallel file systems give a
node a few GB/s to tens of GB/s), bounds the time: ``bytes / (nodes * rate)``, plus a fixed
:data:`SAVE_OVERHEAD_S` for metadata, checksums of the small files, fsync and the rename.

:func:`warning_seconds` is the lead time a job asks Slurm for (``--signal=B:USR1@T``): after the
signal the ranks finish the step they are in, wait for a background save in flight, save, and
leave -- ``step + 2 x save + EXIT_MARGIN_S``, times :data:`WARNING_FACTOR`, and never less than
:data:`WARNING_FLOOR_S`.
"""

from __future__ import annotations

import math

from axo4d.config import ModelConfig
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid

DEFAULT_FS_WRITE_GBPS = 2.0
SAVE_OVERHEAD_S = 5.0
EXIT_MARGIN_S = 30.0
WARNING_FACTOR = 1.5
WARNING_FLOOR_S = 120
#: Slurm's --signal takes at most this many seconds (a 16-bit field)
WARNING_CAP_S = 65535


def checkpoint_bytes(model: ModelConfig, optimizer: bool = True) -> float:
    """Bytes of one checkpoint of ``model``: 12 per parameter with AdamW's moments, else 4."""
    return model_spec(model, Grid()).param_count() * (12 if optimizer else 4)


def save_seconds(model: ModelConfig, nodes: int, machine, optimizer: bool = True) -> float:
    """Predicted seconds of one save on ``nodes`` nodes of ``machine`` (module docstring)."""
    rate = (getattr(machine, "fs_write_gbps", None) or DEFAULT_FS_WRITE_GBPS) * 1e9
    return checkpoint_bytes(model, optimizer) / (max(1, nodes) * rate) + SAVE_OVERHEAD_S


def warning_seconds(step_s: float, save_s: float) -> int:
    """Seconds before the end a job should be signalled (module docstring)."""
    t = WARNING_FACTOR * (step_s + 2 * save_s + EXIT_MARGIN_S)
    return int(min(WARNING_CAP_S, max(WARNING_FLOOR_S, math.ceil(t))))


__all__ = ["checkpoint_bytes", "save_seconds", "warning_seconds", "DEFAULT_FS_WRITE_GBPS", "WARNING_FLOOR_S"]
