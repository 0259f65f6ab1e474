"""Subnormal floats on a benchmark's CPU ranks: flushed to zero or kept, and what the thread does.

A few steps into training some values become subnormal, and on a CPU every operation on one takes
a slow path (GPUs do not): :mod:`bench.overlap` and :mod:`bench.peers` flush them on every rank
unless asked to keep them, and report what a product of a subnormal gives on the computing thread,
not what was asked for (``torch.set_flush_denormal`` sets the calling thread's flags only, and is
not supported everywhere).
"""

from __future__ import annotations

import torch

SUBNORMAL = 1e-39  # below float32's smallest normal, 1.18e-38


def set_subnormals(flush: bool) -> str:
    """Flush (``flush``) or keep subnormal floats on this thread; returns ``'flushed'`` when a
    subnormal times one now gives zero here, else ``'kept'``."""
    torch.set_flush_denormal(flush)
    return observed()


def observed() -> str:
    """``'flushed'`` or ``'kept'``: what this thread does with a float32 subnormal now."""
    probe = torch.full((64,), SUBNORMAL, dtype=torch.float32) * 1.0  # vectorised, as the kernels are
    return "flushed" if float(probe[0]) == 0.0 else "kept"
