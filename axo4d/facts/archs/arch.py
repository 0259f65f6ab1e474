"""What the registry holds per architecture (:class:`Arch`), and the helpers entries share."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from axo4d.config.errors import CheckpointError

if TYPE_CHECKING:
    from axo4d.config import ModelConfig
    from axo4d.facts.archs.layout import RowMap
    from axo4d.facts.grid import Grid
    from axo4d.facts.spec import ModelSpec


def _load(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Arch:
    """One architecture: everything the library, the tests and the performance model look up by
    ``model.arch``. The registry lives with the model facts (no torch): the model class and its
    plain reference are named ``"module:Class"`` in the models layer and imported when asked for
    (:meth:`model_class`, :meth:`plain_class`), so the performance model can read the spec of an
    architecture without importing a model."""

    name: str
    """The value of ``model.arch``."""
    spec: Callable[[ModelConfig, Grid], ModelSpec]
    """The model's parts on a grid (:class:`axo4d.facts.spec.ModelSpec`): shapes, placements, collectives."""
    model: str
    """``"module:Class"`` of the model on the grid (:class:`axo4d.models.base.DecoderLM`)."""
    plain: str
    """``"module:Class"`` of the single-device PyTorch reference with the same parameter names."""
    hf_architectures: tuple[str, ...]
    """Values of ``config.json``'s ``architectures`` this entry reads."""
    from_hf: Callable[[dict, Path], dict]
    """``config.json`` (and its folder, for messages) -> :class:`~axo4d.config.ModelConfig` fields;
    an unsupported field is a :class:`~axo4d.config.errors.CheckpointError` (:func:`unsupported`)."""
    to_hf: Callable[[ModelConfig, dict, str, bool], dict]
    """``(config, the source folder's config.json or {}, dtype name, tied head)`` -> the
    ``config.json`` written on export (the source's, with this model's fields set)."""
    layout: Callable[[ModelConfig], dict[str, RowMap]]
    """axo4d parameter name -> where its rows live in the Hugging Face tensors (:mod:`axo4d.facts.archs.layout`)."""
    hf_tied_head: tuple[str, str] | None = None
    """``(head, embedding)`` parameter names when a Hugging Face folder may omit the head's tensor
    because it is tied to the embedding (GPT-2): read from the embedding then, and left out on
    export while the two are equal."""

    def model_class(self) -> type:
        return _load(self.model)

    def plain_class(self) -> type:
        return _load(self.plain)


def unsupported(folder: Path, field: str, value: Any, valid: str) -> CheckpointError:
    """The error of a ``config.json`` field axo4d does not implement."""
    return CheckpointError(f"{str(folder / 'config.json')!r}: unsupported {field}={value!r}; axo4d supports {valid}")


__all__ = ["Arch", "unsupported"]
