"""The sequence split over z (``parallel.z_split``; docs/design.md section 14).

With ``z_split='sequence'`` the z axis splits every sample's sequence instead of the batch. The
``T`` positions are cut into ``2*G_z`` equal chunks of ``L = T/(2*G_z)`` tokens and z rank ``i``
holds chunks ``i`` and ``2*G_z-1-i`` (in that order): causal attention then costs every rank the
same (chunk ``c``'s queries see ``(c+1)*L`` keys; ``i + (2*G_z-1-i) + 2 = 2*G_z+1`` chunks of keys on
every rank). Linear layers, norms, the embedding and the loss run unchanged on those rows;
positions (RoPE, learned) are each token's true position (:func:`chunk_positions`).

Attention (:func:`split_attend`) all-gathers K and V over z (:class:`~axo4d.dist.mappings.AllGather`:
forward all-gather, backward reduce-scatter of their gradients; grouped-query heads make them
``H_kv/H`` of the queries' size), puts them in sequence order and runs, per local chunk, SDPA of
the chunk's queries over the keys up to its end with a causal mask offset by the chunk's start
(and, with ``data.document_mask``, inside each document). The mask is an explicit boolean, so on
CUDA SDPA takes its memory-efficient kernel (flash does not accept a mask); not measured on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from axo4d.dist.comm import Comm
from axo4d.dist.eager import eager
from axo4d.dist.mappings import AllGather
from axo4d.facts.run import resolve_z_split, split_reasons  # noqa: F401 (re-exported: the rank arithmetic)

_GQA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
Z_SPLITS = ("batch", "sequence", "auto")

KERNEL = "SDPA with a per-chunk causal mask over all-gathered K/V (CUDA: memory-efficient kernel, not measured on GPU)"
"""The attention kernel of the sequence split, named in the start-up line."""


# ---- rank arithmetic (pure) --------------------------------------------------------------------
def chunks_of(g_z: int, rank: int) -> tuple[int, int]:
    """The two chunks (of ``2*g_z``) z rank ``rank`` holds, in local order."""
    return rank, 2 * g_z - 1 - rank


def chunk_positions(seq_len: int, g_z: int, rank: int) -> torch.Tensor:
    """``(seq_len/g_z,)`` true positions of z rank ``rank``'s tokens, in local order."""
    n = seq_len // (2 * g_z)
    return torch.cat([torch.arange(c * n, (c + 1) * n) for c in chunks_of(g_z, rank)])


def gathered_order(g_z: int) -> torch.Tensor:
    """``(2*g_z,)``: for each chunk in sequence order, its slot in the all-gathered (rank-major) chunks."""
    slot = {c: 2 * r + j for r in range(g_z) for j, c in enumerate(chunks_of(g_z, r))}
    return torch.tensor([slot[c] for c in range(2 * g_z)])


# ---- tensors -----------------------------------------------------------------------------------
def local_part(t: torch.Tensor, comm: Comm, dim: int = 1) -> torch.Tensor:
    """This z rank's tokens of a full-sequence tensor ``t`` (sequence along ``dim``)."""
    g = comm.size("z")
    if g == 1:
        return t
    pos = chunk_positions(t.shape[dim], g, comm.coord("z")).to(t.device)
    return t.index_select(dim, pos)


@eager
def gather_sequence(t: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """The full sequence, in order, from every z rank's ``t`` (sequence along ``dim``);
    differentiable: forward all-gather over z, backward reduce-scatter of the gradient."""
    g = comm.size("z")
    if g == 1:
        return t
    moved = t.movedim(dim, 0)  # (T/z, ...)
    rest = moved.shape[1:]
    flat = moved.reshape(-1)
    full = AllGather.apply(flat, comm, ("z",)) if t.requires_grad else comm.all_gather(flat, "z")
    chunks = full.view(2 * g, moved.shape[0] // 2, *rest)  # (2z, L, ...) rank-major
    ordered = chunks.index_select(0, gathered_order(g).to(t.device))  # sequence order
    return ordered.reshape(-1, *rest).movedim(0, dim)


@dataclass(frozen=True)
class SequenceSplit:
    """This forward pass's sequence split: the z rank's true positions and, with document masks,
    the whole sequence's document ids. Handed to every block in place of ``documents``."""

    comm: Comm
    seq_len: int
    """T: the whole sequence."""
    positions: torch.Tensor
    """(T/z,) true positions of this rank's tokens."""
    documents: torch.Tensor | None = None
    """(B, T) document of every token of the whole sequence, in order (``data.document_mask``)."""
    masks: tuple[torch.Tensor, ...] = ()
    """Per local chunk ``c``: bool ``(L, (c+1) L)`` (or ``(B, 1, L, (c+1) L)`` with documents), True =
    attend: causal with the chunk's offset. Built once per forward pass, shared by every block."""
    _additive: dict = field(default_factory=dict, compare=False, repr=False)

    def additive_mask(self, j: int, dtype: torch.dtype) -> torch.Tensor:
        """Local chunk ``j``'s mask as an additive one (0 / -inf) in ``dtype``, made once per forward
        pass: SDPA would otherwise convert the boolean mask in every block and keep each copy for
        backward (the CPU flash kernel does)."""
        key = (j, dtype)
        if key not in self._additive:
            m = self.masks[j]
            self._additive[key] = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
        return self._additive[key]

    @classmethod
    def of(cls, comm: Comm, local_len: int, documents: torch.Tensor | None, device) -> SequenceSplit:
        g, r = comm.size("z"), comm.coord("z")
        t = local_len * g
        bad = split_reasons(t, g)
        if bad:
            raise ValueError(bad[0])
        d = None if documents is None else gather_sequence(documents, comm, 1)  # (B, T)
        n, masks = t // (2 * g), []
        for c in chunks_of(g, r):
            end = (c + 1) * n
            m = torch.ones(n, end, dtype=torch.bool, device=device).tril(c * n)  # (L, (c+1)L)
            if d is not None:
                m = (d[:, c * n : end, None] == d[:, None, :end]).logical_and_(m)[:, None]  # (B, 1, L, (c+1)L)
            masks.append(m)
        return cls(comm, t, chunk_positions(t, g, r).to(device), d, tuple(masks))


def split_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """Causal attention of the local queries ``q (B, Hq, T/z, D)`` over the whole sequence's keys:
    ``k, v (B, Hkv, T/z, D)`` are all-gathered over z; returns ``(B, Hq, T/z, D)``."""
    comm = split.comm
    g, r = comm.size("z"), comm.coord("z")
    kf, vf = gather_sequence(k, comm, 2), gather_sequence(v, comm, 2)  # (B, Hkv, T, D) in order
    n = split.seq_len // (2 * g)
    kw = {}
    if q.shape[1] != k.shape[1]:
        if _GQA:
            kw = {"enable_gqa": True}
        else:  # older torch: repeat the kv heads
            kf, vf = (u.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for u in (kf, vf))
    out = []
    for j, c in enumerate(chunks_of(g, r)):
        end = (c + 1) * n  # chunk c's queries see keys 0 .. (c+1)L-1
        qc = q[:, :, j * n : (j + 1) * n]  # (B, Hq, L, D)
        out.append(
            F.scaled_dot_product_attention(
                qc, kf[:, :, :end], vf[:, :, :end], attn_mask=split.additive_mask(j, q.dtype), **kw
            )
        )
    return torch.cat(out, dim=2)
