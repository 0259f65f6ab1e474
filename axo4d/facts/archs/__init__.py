"""The registry of model architectures (like torchtitan's ``TrainSpec``): per architecture its
spec builder (the parts on a grid), model class, plain PyTorch reference, Hugging Face config
translation and tensor layout (:class:`~axo4d.facts.archs.arch.Arch`). Every lookup by ``model.arch``
or by a ``config.json``'s ``architectures`` goes through :func:`get_arch` / :func:`arch_for_hf`.

Adding an architecture: a module here with its ``ARCH`` entry (and its part records, where it
needs new kinds of parts), listed in :data:`ARCHS`, and its tests. The registry sits with the model
facts (no torch, nothing above :mod:`axo4d.facts.spec`), so the performance model reads it too.
"""

from __future__ import annotations

from pathlib import Path

from axo4d.config import ModelConfig
from axo4d.config.errors import ConfigError
from axo4d.facts.archs import (
    gpt_family,
    llama_family,
    mixtral_family,
    qwen2_family,
    qwen2_moe_family,
    qwen3_moe_family,
)
from axo4d.facts.archs.arch import Arch, unsupported
from axo4d.facts.grid import Grid
from axo4d.facts.orientation import orient
from axo4d.facts.spec import ModelSpec

ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        gpt_family.ARCH,
        llama_family.ARCH,
        qwen2_family.ARCH,
        qwen3_moe_family.ARCH,
        mixtral_family.ARCH,
        qwen2_moe_family.ARCH,
    )
}


def get_arch(name: str) -> Arch:
    """The entry of ``model.arch`` ``name``; one :class:`ConfigError` naming the known ones."""
    arch = ARCHS.get(name)
    if arch is None:
        raise ConfigError(f"model.arch={name!r} is not a known architecture; known: {', '.join(sorted(ARCHS))}")
    return arch


def arch_for_hf(architectures: list[str], folder: Path) -> Arch:
    """The entry that reads a ``config.json`` whose ``architectures`` are these."""
    for a in ARCHS.values():
        if any(x in a.hf_architectures for x in architectures):
            return a
    known = ", ".join(x for a in ARCHS.values() for x in a.hf_architectures)
    raise unsupported(folder, "architectures", architectures, known)


def model_spec(cfg: ModelConfig, grid: Grid) -> ModelSpec:
    """The parts of ``cfg``'s model on ``grid`` (:attr:`Arch.spec` of ``cfg.arch``), each pair of
    linear layers oriented for the grid (:func:`~axo4d.facts.orientation.orient`)."""
    return orient(get_arch(cfg.arch).spec(cfg, grid))


__all__ = ["ARCHS", "Arch", "get_arch", "arch_for_hf", "model_spec"]
