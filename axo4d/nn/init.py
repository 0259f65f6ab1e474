"""Grid-independent initialisation: every parameter's full tensor is drawn from its own seed,
and each rank writes just the chunks its piece holds (:meth:`Placement.chunks`).

A tensor of up to :data:`WHOLE_DRAW` elements is one draw of its whole logical shape (a rank
materialises it once, then copies its chunks); a larger one (an LM head of a 400B model, say) is
drawn in slabs of about :data:`SLAB` elements, each from its own seed, and a rank draws only the
slabs its chunks touch -- so no rank ever holds a full large tensor.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from axo4d.dist.comm import Comm
from axo4d.facts.placement import Init, chunk_view, placement_of

#: tensors up to this many elements are drawn whole (the draw of axo4d 0.1)
WHOLE_DRAW = 1 << 28
#: elements per slab of a larger tensor (rounded to whole rows)
SLAB = 1 << 24


def param_seed(base: int, name: str) -> int:
    """A per-parameter seed; ``name`` is the parameter name without a trailing ``.weight``
    (the module's name for a layer's weight, the parameter's own name otherwise)."""
    key = name[: -len(".weight")] if name.endswith(".weight") else name
    return int.from_bytes(hashlib.sha256(f"{base}:{key}".encode()).digest()[:8], "little") % (2**63)


def _draw(shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


def _rows(full: tuple[int, ...], init: Init, seed: int, r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of a constant or a slab-drawn logical tensor ``full``."""
    if init.constant is not None:
        return torch.full((r1 - r0, *full[1:]), float(init.constant))
    per = max(1, SLAB // math.prod(full[1:]))  # rows per slab
    parts = []
    for s in range(r0 // per, (r1 - 1) // per + 1):
        a, b = s * per, min(full[0], (s + 1) * per)
        slab = _draw((b - a, *full[1:]), init.std, seed * 1_000_003 + s)
        parts.append(slab[max(r0, a) - a : min(r1, b) - a])
    return torch.cat(parts)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, comm: Comm) -> None:
    """Initialise every parameter of ``module`` from its ``init`` and placement; padding stays 0."""
    cache: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        init: Init | None = getattr(p, "init", None)
        if init is None:
            continue
        pl = placement_of(p)
        full = pl.logical_shape
        s = param_seed(seed, name)
        local = torch.zeros(p.shape, dtype=torch.float32)
        whole = init.constant is None and (math.prod(full) <= WHOLE_DRAW or len(full) < 2)
        for ch in pl.chunks(comm.grid, comm.rank):
            r0, r1 = ch.offsets[0], ch.offsets[0] + ch.sizes[0]
            if whole:  # draw once, reuse for every chunk
                if name not in cache:
                    cache = {name: _draw(full, init.std, s)}
                rows = cache[name][r0:r1]
            else:
                rows = _rows(full, init, s, r0, r1)
            rect = rows[(slice(None),) + tuple(slice(o, o + n) for o, n in zip(ch.offsets[1:], ch.sizes[1:]))]
            chunk_view(local, ch).copy_(rect)
        p.copy_(local.to(p.dtype))
