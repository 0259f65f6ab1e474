"""Cross-entropy over a vocabulary split across (x, y) (max and sum-exp reduced over x and y).

The LM head leaves each rank its block ``V/(x*y)`` of the vocabulary: block ``index(x, y)`` (x
fastest), the x-th piece of the y-th slice (docs/design.md section 15).

Memory: the function keeps the logits as they came (bf16 under autocast) and one fp32 log-sum-exp
per row, and recomputes the softmax in backward; fp32 work runs over blocks of rows
(:data:`CHUNK_ELEMENTS` at a time), so neither pass holds a full fp32 ``(N, V/(x*y))`` tensor. (Saving
the fp32 softmax instead costs ``4 N V/(x*y)`` bytes from the end of the forward to the loss's
backward: 3.1 GiB for gpt-1.3b at micro-batch 8 x 2048, twice the bf16 logits.)

Under ``torch.compile`` with ``G_x = G_y = 1`` the loss is plain ``F.cross_entropy`` of the real
vocabulary's columns, so the compiler fuses it with the LM head and chooses what to keep.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from axo4d.dist.comm import Comm
from axo4d.dist.eager import eager

#: fp32 elements per block of rows in the forward and backward passes (64 MiB)
CHUNK_ELEMENTS = 1 << 24
#: the axes that split the vocabulary
TP = ("x", "y")


def _row_blocks(n: int, width: int):
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    return ((r, min(n, r + step)) for r in range(0, n, step))


class _VocabParallelCE(torch.autograd.Function):
    """forward: per-token loss from this rank's logit block (max over (x, y), then sum-exp and the
    target logit summed over (x, y); rows whose ``mask`` is False give 0); backward: softmax - onehot
    on the local block, recomputed from the saved logits and log-sum-exp, 0 on masked rows (no
    collective)."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target: torch.Tensor, comm: Comm, vocab_size: int, mask: torch.Tensor | None
    ):
        lg = logits.reshape(-1, logits.shape[-1])  # (N, V/(x*y)), not copied
        tgt = target.reshape(-1)  # (N,)
        n, nv = lg.shape
        start = comm.index(TP) * nv
        real = max(0, min(nv, vocab_size - start))  # columns past the vocabulary are padding
        m = torch.full((n,), float("-inf"), device=lg.device)  # (N,) local max, then global
        se = torch.zeros(n, device=lg.device)  # (N,) sum of exp(l - local max)
        if real:
            for r0, r1 in _row_blocks(n, real):
                blk = lg[r0:r1, :real].float()
                m[r0:r1] = blk.amax(-1)
                se[r0:r1] = torch.exp(blk - m[r0:r1, None]).sum(-1)
        local_m = m.clone()
        comm.all_reduce(m, TP, op="max")  # no gradient: only stabilises exp
        local = tgt - start
        inside = (local >= 0) & (local < real)
        idx = local.clamp(0, nv - 1)
        tl = torch.where(inside, lg.gather(1, idx[:, None])[:, 0].float(), torch.zeros_like(m))
        se = se * torch.exp(local_m - m) if real else se  # rescaled to the global max
        st = comm.all_reduce(torch.stack([se, tl]), TP)  # (2, N): sum-exp, target logit
        lse = torch.log(st[0]) + m  # (N,)
        keep = None if mask is None else mask.reshape(-1)  # (N,) bool: targets that count
        ctx.save_for_backward(lg, lse, idx, inside, keep)
        ctx.real = real
        loss = lse - st[1]
        if keep is not None:
            loss = torch.where(keep, loss, torch.zeros_like(loss))
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        lg, lse, idx, inside, keep = ctx.saved_tensors
        n, nv = lg.shape
        d = dloss.reshape(-1).float()  # (N,)
        if keep is not None:
            d = torch.where(keep, d, torch.zeros_like(d))
        grad = torch.empty_like(lg)  # (N, V/(x*y)) in the logits' dtype
        if ctx.real < nv:
            grad[:, ctx.real :] = 0
        hit = (inside.to(d.dtype) * d)[:, None]  # (N, 1): the one-hot's weight
        for r0, r1 in _row_blocks(n, ctx.real) if ctx.real else ():
            p = torch.exp(lg[r0:r1, : ctx.real].float() - lse[r0:r1, None]).mul_(d[r0:r1, None])
            p.scatter_add_(1, idx[r0:r1, None].clamp(max=max(ctx.real - 1, 0)), -hit[r0:r1])
            grad[r0:r1, : ctx.real] = p
        return grad.view(*dloss.shape, nv), None, None, None, None


@eager
def _vocab_parallel(
    logits: torch.Tensor, target: torch.Tensor, comm: Comm, vocab_size: int, loss_mask: torch.Tensor | None
) -> torch.Tensor:
    """The autograd function, kept out of torch.compile graphs (collectives)."""
    return _VocabParallelCE.apply(logits, target, comm, vocab_size, loss_mask)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, comm: Comm, vocab_size: int, loss_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token loss ``(B, T)`` from logits ``(B, T, V/(x*y))``; columns >= vocab_size are padding.
    ``loss_mask``: bool ``(B, T)``, the targets that count (others: loss 0 and no gradient)."""
    if comm.size(TP) == 1 and torch.compiler.is_compiling():  # whole vocabulary here: let the compiler fuse it
        lg = logits[..., :vocab_size].float()
        loss = F.cross_entropy(lg.flatten(0, -2), target.reshape(-1), reduction="none").view(target.shape)
        return loss if loss_mask is None else torch.where(loss_mask, loss, torch.zeros_like(loss))
    return _vocab_parallel(logits, target, comm, vocab_size, loss_mask)
