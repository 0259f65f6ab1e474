"""What a run's config asks of the performance model: one function from a :class:`RunConfig` to the
keyword settings of :func:`perfmodel.model.rank_grids` and :func:`perfmodel.model.estimate_auto`.

``--grid auto`` (:mod:`perfmodel.grid_auto`, at the trainer's start-up) and ``launch.job`` (a job
script's grid and prediction) both price a run through :func:`settings_of`, so neither can leave
out a setting the trainer obeys: the optimizer mode (``parallel.shard_optimizer``,
``train.offload``) changes the data-parallel collectives and the memory that decides which grids
fit, ``train.fp8`` / ``train.fp8_layers`` the GEMMs, the gathers and the grids refused (the same
rule as the start-up's, :func:`axo4d.facts.run.fp8_of`), ``parallel.cache_weights`` the z gathers
and the memory. The expert-group size is not among them: a ranking searches it
(:func:`perfmodel.expert_pricing.ep_candidates`) and one grid's estimate takes ``parallel.expert``.
"""

from __future__ import annotations

from typing import Any

from axo4d.config import RunConfig
from axo4d.facts.run import shard_setting
from axo4d.facts.spec import Dtypes


def dtypes_of(cfg: RunConfig, device_type: str) -> Dtypes:
    """Element sizes of this run (``train.dtype``; 'auto' is bf16 on GPU, fp32 on CPU)."""
    d = cfg.train.dtype
    return Dtypes.for_compute("bf16" if d == "bf16" or (d == "auto" and device_type == "cuda") else "fp32")


def settings_of(cfg: RunConfig, device_type: str) -> dict[str, Any]:
    """The run's settings the estimate prices, as the config gives them, on ``device_type``
    ('cuda': bf16 under ``train.dtype=auto`` and fused attention; 'cpu': fp32 and SDPA)."""
    t, p = cfg.train, cfg.parallel
    return {
        "overlap": p.overlap,
        "shard_optimizer": shard_setting(p),
        "offload": t.offload,
        "dtypes": dtypes_of(cfg, device_type),
        "grad_accum": t.grad_accum,
        "dp_bucket_mb": p.dp_bucket_mb,
        "flash_attention": device_type == "cuda",
        "z_split": p.z_split,
        "fp8": t.fp8,
        "fp8_layers": t.fp8_layers,
        "cache_weights": p.cache_weights,
    }


__all__ = ["settings_of", "dtypes_of"]
