"""Scoring token sequences on the grid: the log-likelihood of a continuation given its context, and
whether it is the greedy one (what an evaluation harness asks of a model).

A batch of requests is split like training rows, over ``(z, data)`` (a batch that does not fill
``G_data * G_z`` rows is padded with copies of its first request, whose results are dropped); each
rank runs the forward of its rows (right-padded to the batch's longest; causal attention, so the
padding changes no real position), takes each target's log-probability from the vocabulary-parallel
cross-entropy (:func:`axo4d.nn.loss.vocab_parallel_cross_entropy`: max and sum-exp reduced over y)
and whether the target is the most likely token (max over y), and the rows' results are all-gathered
over ``(z, data)``, so every rank returns every request's. Collective: every rank of the grid calls
it with the same requests. A request longer than the context keeps its last ``seq_len + 1`` tokens
(the continuation must fit), as Hugging Face's harness model truncates.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from axo4d.models.base import DecoderLM
from axo4d.nn.loss import vocab_parallel_cross_entropy


def _is_greedy(logits: torch.Tensor, targets: torch.Tensor, model: DecoderLM) -> torch.Tensor:
    """bool ``(b, T)``: the target's logit is the largest of the real vocabulary (max over y)."""
    comm, vocab = model.comm, model.spec.vocab_size
    nv = logits.shape[-1]
    start = comm.coord("y") * nv
    real = max(0, min(nv, vocab - start))  # columns past the vocabulary are padding
    lg = logits.float()  # (b, T, V/y)
    top = lg[..., :real].amax(-1) if real else torch.full(targets.shape, -math.inf, device=lg.device)  # (b, T)
    comm.all_reduce(top, "y", op="max")
    local = targets - start
    inside = (local >= 0) & (local < real)
    hit = lg.gather(-1, local.clamp(0, nv - 1)[..., None])[..., 0]  # (b, T)
    hit = torch.where(inside, hit, torch.zeros_like(hit))
    comm.all_reduce(hit, "y")
    return hit >= top


def _window(context: Sequence[int], continuation: Sequence[int], seq_len: int) -> tuple[list[int], int]:
    """The request's tokens as the model sees them (the last ``seq_len + 1``) and the continuation's length."""
    if not continuation:
        raise ValueError("a continuation needs at least one token")
    if len(continuation) > seq_len:
        raise ValueError(f"continuation of {len(continuation)} tokens exceeds the model's context of {seq_len}")
    toks = (list(context) + list(continuation))[-(seq_len + 1) :]
    if len(toks) < 2:
        raise ValueError("a request needs a context of at least one token")
    return toks, len(continuation)


def _score_batch(model: DecoderLM, batch: list[tuple[list[int], int]]) -> torch.Tensor:
    """``(len(batch), 2)`` float64 on every rank: each request's log-likelihood and greedy flag."""
    comm, device = model.comm, next(model.parameters()).device
    axes = ("z", "data")
    shards, shard = comm.size(axes), comm.index(axes)
    n = len(batch)
    total = math.ceil(n / shards) * shards
    per = total // shards
    rows = (batch + [batch[0]] * (total - n))[shard * per : (shard + 1) * per]
    T = max(len(toks) for toks, _ in batch) - 1
    x = torch.zeros(per, T, dtype=torch.long, device=device)  # (b, T) right-padded
    y = torch.zeros(per, T, dtype=torch.long, device=device)
    cont = torch.zeros(per, T, dtype=torch.bool, device=device)  # the continuation's targets
    for i, (toks, k) in enumerate(rows):
        t = torch.tensor(toks, device=device)
        x[i, : len(toks) - 1], y[i, : len(toks) - 1] = t[:-1], t[1:]
        cont[i, len(toks) - 1 - k : len(toks) - 1] = True
    logits = model(x)  # (b, T, V/y)
    logp = -vocab_parallel_cross_entropy(logits, y, comm, model.spec.vocab_size, cont).double()  # (b, T)
    greedy = _is_greedy(logits, y, model) | ~cont  # (b, T)
    mine = torch.stack([logp.sum(-1), greedy.all(-1).double()], -1)  # (b, 2)
    if shards > 1:
        mine = comm.all_gather(mine.contiguous(), axes).view(total, 2)
    return mine[:n]


@torch.no_grad()
def score_continuations(
    model: DecoderLM, requests: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 16
) -> list[tuple[float, bool]]:
    """``(log P(continuation | context), continuation is greedy)`` of each ``(context, continuation)``
    request, ``batch_size`` requests a forward (module docstring); collective over the model's grid."""
    seq_len = model.spec.seq_len
    items = [_window(c, k, seq_len) for c, k in requests]
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))  # similar lengths batched together
    out: list[tuple[float, bool]] = [(0.0, False)] * len(items)
    was_training = model.training
    model.eval()
    try:
        for b in range(0, len(order), max(1, batch_size)):
            ids = order[b : b + max(1, batch_size)]
            res = _score_batch(model, [items[i] for i in ids]).tolist()
            for i, (lp, g) in zip(ids, res):
                out[i] = (lp, bool(g))
    finally:
        model.train(was_training)
    return out


__all__ = ["score_continuations"]
