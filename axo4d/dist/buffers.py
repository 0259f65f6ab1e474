"""Flat buffers that CPU ranks reuse from step to step for their bucket collectives.

A CPU rank's large allocations come from the C library's allocator, which often maps fresh pages
for them: every page is then faulted in and zeroed by the kernel on first write. The collectives
of the data-parallel buckets allocate the same few sizes every step (a bucket's flat gradient for
its reduce-scatter, the half a peer sends, a gathered flat of new weights), and writing 4 MB into
a fresh buffer took 1.9 ms on this machine's CPU where writing it into a reused one took 0.3 ms
(``torch.cat`` of two gradients, one thread). :class:`BufferPool` keeps the buffers given back
and hands the smallest that fits to the next request, so a step reuses the last step's. It holds
at most what was in use at once (the in-flight limits bound that: ``DP_LAG`` buckets,
``OPTIM_INFLIGHT_GATHERS`` gathers). A GPU's caching allocator already does this: on any other
device :meth:`take` allocates and :meth:`give` drops.
"""

from __future__ import annotations

import torch


class BufferPool:
    """Reusable flat CPU buffers, per dtype (module docstring)."""

    def __init__(self) -> None:
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A flat tensor of ``numel`` elements (contents undefined); :meth:`give` it back when done."""
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        free = self._free.setdefault(dtype, [])
        fits = [i for i, b in enumerate(free) if b.numel() >= numel]
        if not fits:
            return torch.empty(numel, dtype=dtype)[:numel]
        return free.pop(min(fits, key=lambda i: free[i].numel()))[:numel]

    def give(self, t: torch.Tensor) -> None:
        """``t`` (from :meth:`take`) is no longer read or written: the next :meth:`take` may reuse it."""
        if t.device.type == "cpu":
            self._free.setdefault(t.dtype, []).append(t._base if t._base is not None else t)

    def held_bytes(self) -> int:
        """Bytes of the buffers waiting for reuse."""
        return sum(b.nbytes for free in self._free.values() for b in free)


__all__ = ["BufferPool"]
