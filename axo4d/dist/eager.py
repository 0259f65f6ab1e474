"""``@eager``: keep a function out of ``torch.compile`` graphs without importing the compiler.

``torch.compiler.disable`` imports ``torch._dynamo`` (about one CPU-second per process) at the
moment a module is imported, and every rank of every run paid it although almost no run compiles.
:func:`eager` defers it: called eagerly, the function runs as it is; called while a graph is
traced (``torch.compiler.is_compiling()``, a plain flag), it runs through its
``torch.compiler.disable`` wrapper, made at that point or before by :func:`prepare_for_compile`
(which :func:`axo4d.models.base.apply_compile` calls, so the first trace breaks the graph once, at
the call, as a decorated function would).
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)
_HELD: list[list] = []  # per decorated function: [fn, its disabled wrapper once made]


def _disabled(held: list) -> Callable:
    if len(held) == 1:
        held.append(torch.compiler.disable(held[0]))
    return held[1]


def eager(fn: F) -> F:
    """``fn`` kept out of compiled graphs (``torch.compiler.disable``, applied when first needed)."""
    held = [fn]
    _HELD.append(held)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return _disabled(held)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def prepare_for_compile() -> None:
    """Make every ``@eager`` function's ``torch.compiler.disable`` wrapper now (before a trace)."""
    for held in _HELD:
        _disabled(held)


__all__ = ["eager", "prepare_for_compile"]
