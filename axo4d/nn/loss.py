"""Cross-entropy over a vocabulary split across y (max and sum-exp reduced over y)."""
from __future__ import annotations

import torch

from axo4d.dist.comm import Comm


class _VocabParallelCE(torch.autograd.Function):
    """forward: per-token loss from this rank's logit block (max over y, then sum-exp and the
    target logit summed over y); backward: softmax - onehot on the local block (no collective)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, comm: Comm, vocab_size: int):
        shape = target.shape
        lg = logits.reshape(-1, logits.shape[-1]).float()          # (N, V/y)
        tgt = target.reshape(-1)                                   # (N,)
        nv = lg.shape[-1]
        start = comm.coord("y") * nv
        if start + nv > vocab_size:                                # padding columns here (no host sync)
            lg = lg.masked_fill(torch.arange(start, start + nv, device=lg.device) >= vocab_size, float("-inf"))
        m = lg.max(-1).values                                      # (N,)
        comm.all_reduce(m, "y", op="max")                          # no gradient: only stabilises exp
        e = torch.exp(lg - m[:, None])                             # (N, V/y)
        local = tgt - start
        inside = (local >= 0) & (local < nv)
        tl = torch.where(inside, lg.gather(1, local.clamp(0, nv - 1)[:, None])[:, 0], torch.zeros_like(m))
        st = comm.all_reduce(torch.stack([e.sum(-1), tl]), "y")     # (2, N): sum-exp, target logit
        loss = torch.log(st[0]) + m - st[1]
        ctx.save_for_backward(e.div_(st[0][:, None]), local, inside)
        ctx.logits_dtype = logits.dtype
        return loss.view(shape)

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        softmax, local, inside = ctx.saved_tensors
        grad = softmax                                             # (N, V/y), reused in place
        nv = grad.shape[-1]                                        # minus one-hot; no host sync
        grad.scatter_add_(1, local.clamp(0, nv - 1)[:, None], -inside.to(grad.dtype)[:, None])
        grad.mul_(dloss.reshape(-1, 1).float())
        return grad.to(ctx.logits_dtype).view(*dloss.shape, -1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, comm: Comm,
                                 vocab_size: int) -> torch.Tensor:
    """Per-token loss ``(B, T)`` from logits ``(B, T, V/y)``; columns >= vocab_size are padding."""
    return _VocabParallelCE.apply(logits, target, comm, vocab_size)
