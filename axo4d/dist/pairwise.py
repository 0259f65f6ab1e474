"""A reduce-scatter or all-gather over a group of two gloo ranks as one exchange of halves, sent in
chunks (what :class:`axo4d.dist.comm.Comm` runs for such groups on CPU tensors).

Over two ranks both collectives are one exchange: each rank sends the other the half it does not
keep (the reduce-scatter then adds its own half to the one received; the all-gather places it).
gloo's own ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` send each half as one message
over the pair's single TCP socket, and on a shaped link (``launch.vcluster``, 1 Gbit) such a pair
of opposite messages runs at full duplex only some of the time: 25 MB each way took 211 ms or
400-418 ms, by turns, where one way alone took 193 ms. gloo's own all-reduce moves its bytes in
chunks and kept both directions full every time (210-214 ms for the same 25 MB each way), and so
did the same exchange sent in 1 MiB chunks, all in flight at once (210-236 ms; ``python -m
bench.gloo_reduce_scatter --vcluster`` times the forms side by side). So a two-rank reduce-scatter
or all-gather now costs half an all-reduce of the same buffer on gloo, as it does on NCCL.

The sum of two addends is the same in either order, so the results equal gloo's bit for bit.
Point-to-point waits do not follow a process group's timeout (``Comm.set_timeout``): every wait
here is given the time left of the Comm's timeout (torch's default group timeout when it has
none, as its groups then have), so that a peer that never sends still ends in
an error naming the group and the rank (:class:`axo4d.dist.comm.Handle`).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

#: bytes of one send (and of the matching receive); every chunk is in flight at once
CHUNK_BYTES = 1 << 20
#: the tag of the exchanges' sends and receives (apart from any other point-to-point traffic)
TAG = 0x6178


class Exchange:
    """The sends and receives of one exchange in flight; :meth:`wait` waits for all of them, then
    runs ``post`` (the reduce-scatter's sum)."""

    def __init__(self, works: list, keep: tuple[torch.Tensor, ...], timeout_s: float | None, post=None) -> None:
        self._works, self._keep, self._timeout_s, self._post = works, keep, timeout_s, post

    def wait(self) -> bool:
        limit = self._timeout_s or dist.default_pg_timeout.total_seconds()  # a group's own default
        deadline = time.monotonic() + limit
        for w in self._works:
            w.wait(datetime.timedelta(seconds=max(1e-3, deadline - time.monotonic())))
        if self._post is not None:
            self._post()
        self._works, self._keep, self._post = [], (), None
        return True


def exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group, timeout_s: float | None, post=None) -> Exchange:
    """Send the flat ``send`` to global rank ``peer`` of ``group`` and receive as many elements into
    the flat ``recv``, chunk by chunk (:data:`CHUNK_BYTES`), every chunk in flight at once."""
    step = max(1, CHUNK_BYTES // max(1, send.element_size()))
    works = []
    for lo in range(0, send.numel(), step):
        works.append(dist.isend(send[lo : lo + step], peer, group=group, tag=TAG))
        works.append(dist.irecv(recv[lo : lo + step], peer, group=group, tag=TAG))
    return Exchange(works, (send, recv), timeout_s, post)


def all_gather(t: torch.Tensor, out: torch.Tensor, pair: tuple[int, int], group, timeout_s: float | None) -> Exchange:
    """``out`` (twice the flat ``t``) becomes both ranks' ``t`` in group order once waited for;
    ``pair``: :func:`pair_of` the group."""
    me, peer = pair
    halves = out.view(2, -1)
    halves[me].copy_(t)
    return exchange(t, halves[1 - me], peer, group, timeout_s)


def reduce_scatter(
    t: torch.Tensor, out: torch.Tensor, pair: tuple[int, int], group, timeout_s: float | None
) -> Exchange:
    """``out`` (half the flat ``t``) becomes the sum over both ranks of this rank's half of ``t``
    once waited for: its own half plus the one the peer sent."""
    me, peer = pair
    halves, got = t.view(2, -1), torch.empty_like(out)
    return exchange(halves[1 - me], got, peer, group, timeout_s, post=lambda: torch.add(halves[me], got, out=out))


def pair_of(group) -> tuple[int, int] | None:
    """``(this rank's index, the peer's global rank)`` where ``group`` is two gloo ranks holding this
    one; None otherwise (another backend, another size, or not a process group torch knows)."""
    try:
        if "gloo" not in str(dist.get_backend(group)).lower() or dist.get_world_size(group) != 2:
            return None
        me = dist.get_rank(group)
    except Exception:  # not a process group torch knows (a test's stand-in)
        return None
    return (me, dist.get_global_rank(group, 1 - me)) if me in (0, 1) else None
