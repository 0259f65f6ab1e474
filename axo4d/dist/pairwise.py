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


def _pieces(runs: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """Each flat run of ``runs`` cut into pieces of at most ``step`` elements, in order."""
    return [r[lo : lo + step] for r in runs for lo in range(0, r.numel(), step)]


def exchange_runs(
    send: list[torch.Tensor], recv: list[torch.Tensor], peer: int, group, timeout_s: float | None, post=None
) -> Exchange:
    """:func:`exchange` from and into lists of flat runs, with no staging copy: each run is sent
    (received) in pieces of at most :data:`CHUNK_BYTES`. The peer must cut its matching lists the
    same way (its ``recv`` runs of the same lengths as these ``send`` runs, and so on): the
    sharded optimizer's all-gather sends this rank's half of a bucket from the parameters and
    receives the other half into them, and both ranks cut a half at the same parameters."""
    step = max(1, CHUNK_BYTES // max(1, send[0].element_size()))
    out, inn = _pieces(send, step), _pieces(recv, step)
    works = []
    for i in range(max(len(out), len(inn))):
        if i < len(out):
            works.append(dist.isend(out[i], peer, group=group, tag=TAG))
        if i < len(inn):
            works.append(dist.irecv(inn[i], peer, group=group, tag=TAG))
    return Exchange(works, (*send, *recv), timeout_s, post)


def reduce_scatter_runs(
    keep: list[torch.Tensor],
    send: list[torch.Tensor],
    out: torch.Tensor,
    peer: int,
    group,
    timeout_s: float | None,
    pool=None,
) -> Exchange:
    """:func:`reduce_scatter` from runs, with no flat built: send the runs ``send`` (the peer's
    piece), receive the peer's addend of this rank's piece into a buffer (of ``pool`` when given)
    cut as ``keep`` is, and once waited for, ``out`` = the runs ``keep`` + what was received."""
    got = pool.take(out.numel(), out.dtype, out.device) if pool is not None else torch.empty_like(out)
    cuts, o = [], 0
    for r in keep:
        cuts.append((r, o))
        o += r.numel()

    def post() -> None:
        for r, at in cuts:
            torch.add(r, got[at : at + r.numel()], out=out[at : at + r.numel()])
        if pool is not None:
            pool.give(got)

    return exchange_runs(send, [got[at : at + r.numel()] for r, at in cuts], peer, group, timeout_s, post)


def all_gather(t: torch.Tensor, out: torch.Tensor, pair: tuple[int, int], group, timeout_s: float | None) -> Exchange:
    """``out`` (twice the flat ``t``) becomes both ranks' ``t`` in group order once waited for;
    ``pair``: :func:`pair_of` the group."""
    me, peer = pair
    halves = out.view(2, -1)
    if halves[me].data_ptr() != t.data_ptr():  # else ``t`` is already this rank's half of ``out``
        halves[me].copy_(t)
    return exchange(t, halves[1 - me], peer, group, timeout_s)


def reduce_scatter(
    t: torch.Tensor, out: torch.Tensor, pair: tuple[int, int], group, timeout_s: float | None, pool=None
) -> Exchange:
    """``out`` (half the flat ``t``) becomes the sum over both ranks of this rank's half of ``t``
    once waited for: its own half plus the one the peer sent (received into a buffer of ``pool``,
    an :class:`axo4d.dist.buffers.BufferPool`, when given)."""
    me, peer = pair
    halves = t.view(2, -1)
    got = pool.take(out.numel(), out.dtype, out.device) if pool is not None else torch.empty_like(out)

    def post() -> None:
        torch.add(halves[me], got, out=out)
        if pool is not None:
            pool.give(got)

    return exchange(halves[1 - me], got, peer, group, timeout_s, post=post)


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
