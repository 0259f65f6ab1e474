"""Which layers of a run cast to FP8 (:class:`Fp8Plan`, handed to every layer at construction),
where a model keeps its plan, and whether a device can run FP8 GEMMs. The casts, the weight
scales and the GEMM are in :mod:`axo4d.nn.fp8`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from axo4d.nn.fp8 import RECIPES, Fp8Stats, Recipe, WeightScales


@dataclass(frozen=True)
class Fp8Plan:
    """Given to every layer at construction (:class:`~axo4d.nn.context.LayerContext`): the
    recipe, the names of the layers that run it (``None``: every one; the rest keep the compute
    dtype, rule in :mod:`axo4d.facts.fp8_rule`), and the run's scale counters."""

    recipe: Recipe
    layers: frozenset[str] | None = None
    stats: Fp8Stats = field(default_factory=Fp8Stats, compare=False, hash=False)
    weight_scales: WeightScales = field(default_factory=WeightScales, compare=False, hash=False)

    def recipe_for(self, name: str) -> Recipe | None:
        return self.recipe if self.layers is None or name in self.layers else None


def plan(recipe: str, layers: Sequence[str] | None = None) -> Fp8Plan:
    """An :class:`Fp8Plan` of recipe ``recipe`` ('tensorwise' or 'rowwise') for ``layers`` (None: all)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; valid: {', '.join(RECIPES)}")
    return Fp8Plan(RECIPES[recipe], None if layers is None else frozenset(layers))


def device_problem(device: torch.device) -> str:
    """Why FP8 GEMMs cannot run on ``device`` ('' when they can): CPU always can (torch's
    ``_scaled_mm``); CUDA needs compute capability 8.9 or newer (Ada, Hopper, Blackwell)."""
    if device.type == "cpu":
        return ""
    if device.type != "cuda":
        return f"device {device.type!r} has no FP8 GEMMs here"
    if getattr(torch.version, "hip", None):
        return f"ROCm device {torch.cuda.get_device_name(device)} is not supported for FP8 by axo4d yet"
    cc = torch.cuda.get_device_capability(device)
    if cc < (8, 9):
        return (
            f"GPU {torch.cuda.get_device_name(device)} (compute capability {cc[0]}.{cc[1]}) has no FP8 GEMMs; "
            "they need compute capability 8.9 or newer (L40S, H100, H200, B200)"
        )
    return ""


def plan_of(model: torch.nn.Module) -> Fp8Plan | None:
    """The :class:`Fp8Plan` of ``model``'s FP8 layers (one per model), or None when none runs FP8."""
    for m in model.modules():
        p = getattr(m, "fp8_plan", None)
        if p is not None:
            return p
    return None


def stats_of(model: torch.nn.Module) -> Fp8Stats | None:
    """The scale counters of ``model``'s FP8 layers, or None when none runs FP8."""
    p = plan_of(model)
    return p.stats if p is not None else None


def weights_restored(model: torch.nn.Module, updates: int) -> None:
    """``model``'s weights were replaced (a checkpoint of step ``updates``; 0: ``--init-from``): its
    FP8 weight scales are recomputed at the next use (:meth:`WeightScales.restore`)."""
    p = plan_of(model)
    if p is not None:
        p.weight_scales.restore(updates)


__all__ = ["Fp8Plan", "plan", "device_problem", "plan_of", "stats_of", "weights_restored"]
