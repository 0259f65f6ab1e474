"""Text generation on the grid: a batch of prompts, KV caches split the way attention is.

Prompts are rows of the batch, split over ``(z, data)`` like training rows (when z splits the
sequence, ``parallel.z_split``: over data, the prefill's sequence over z, :func:`_split_prefill`) (a batch smaller than
``G_data * G_z`` is padded with copies of the first prompt, whose outputs are dropped); each
rank's caches hold its rows and its heads (heads over y). Prompts of different lengths are
left-padded: positions count from each prompt's first token and a mask hides the padding, as
Hugging Face ``generate`` does. Every step gathers the logits over y (the vocabulary), so each
rank picks the same next token: greedy (``argmax``, first of equals) or sampled with temperature
and top-p from a generator seeded per prompt (the same tokens on every grid). Decoding stops
after ``max_new_tokens`` or when every prompt has produced the end-of-text token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from axo4d.models.base import DecoderLM
from axo4d.nn.attention import Decoding
from axo4d.nn.seqsplit import chunk_positions


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen."""

    greedy: bool = True
    """Always the most likely token (ties: the lowest id)."""
    temperature: float = 1.0
    """Logits are divided by this before sampling (ignored when greedy)."""
    top_p: float = 1.0
    """Sample from the smallest set of tokens whose probability reaches this (1 = all)."""
    seed: int = 0
    """Seed of the per-prompt generators (prompt ``i`` uses ``seed * 1000003 + i``)."""

    def describe(self) -> str:
        return (
            "greedy"
            if self.greedy
            else f"sampling, temperature {self.temperature}, top-p {self.top_p}, seed {self.seed}"
        )


def _gather_vocab(logits: torch.Tensor, model: DecoderLM) -> torch.Tensor:
    """``(b, V/(x*y))`` -> ``(b, vocab_size)`` on every rank (all-gather over x and y, x fastest)."""
    comm, g = model.comm, model.comm.size(("x", "y"))
    if g > 1:
        flat = comm.all_gather(logits.float().contiguous(), ("x", "y"))  # (G_x * G_y * b * V/(x*y),)
        logits = flat.view(g, *logits.shape).permute(1, 0, 2).reshape(logits.shape[0], -1)
    return logits.float()[:, : model.spec.vocab_size]


def _choose(logits: torch.Tensor, sampling: Sampling, gens: list[torch.Generator]) -> torch.Tensor:
    if sampling.greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits / sampling.temperature, -1)
    if sampling.top_p < 1.0:
        p, order = probs.sort(-1, descending=True)
        keep = (p.cumsum(-1) - p) < sampling.top_p  # always keeps the first
        probs = torch.zeros_like(probs).scatter_(-1, order, p * keep)
    return torch.stack([torch.multinomial(probs[i].cpu(), 1, generator=g)[0] for i, g in enumerate(gens)]).to(
        logits.device
    )


def _shard_prompts(
    model: DecoderLM, prompts: list[list[int]], max_new_tokens: int
) -> tuple[list, int, bool, int, tuple[str, ...]]:
    """This rank's prompts (the list padded with copies of the first to a multiple of the shards),
    the padded prompt length, whether z splits each prompt's sequence, this rank's shard index and
    the axes the prompts are sharded over.
    With the sequence split, prompts go over data and each prompt's sequence over z (left-padded to a
    multiple of ``2*G_z``) when the context leaves room; else whole prompts over ``(z, data)``."""
    comm = model.comm
    longest = max(len(p) for p in prompts)
    gz, split = comm.size("z"), model.split_sequence
    if split:
        longest = math.ceil(longest / (2 * gz)) * 2 * gz
        split = longest + max_new_tokens <= model.spec.seq_len  # else: whole prompts, as below
        longest = longest if split else max(len(p) for p in prompts)
    axes = ("data",) if split else ("z", "data")
    shards, shard = comm.size(axes), comm.index(axes)
    n = len(prompts)
    total = math.ceil(n / shards) * shards
    rows = (prompts + [prompts[0]] * (total - n))[shard * (total // shards) : (shard + 1) * (total // shards)]
    return rows, longest, split, shard, axes


def _prefill_decoding(
    model: DecoderLM, pad: torch.Tensor, ar: torch.Tensor, longest: int, masked: bool, dtype: torch.dtype | None
) -> Decoding:
    """The KV cache of ``len(pad)`` rows of up to ``len(ar)`` tokens, the prompts' positions (each
    row left-padded by ``pad``) and, when ``masked``, the prefill's mask: causal, padding hidden, a
    padding query seeing itself."""
    comm, device = model.comm, ar.device
    a = model.spec.attention()
    heads = a.n_kv_head // comm.size(a.head_axes(comm.grid))
    b, limit = len(pad), len(ar)
    dec = Decoding.allocate(
        model.spec.n_layer, b, heads, limit, a.head_dim, dtype or next(model.parameters()).dtype, device
    )
    dec.positions = (torch.arange(longest, device=device)[None] - pad[:, None]).clamp_min(0)
    if masked:
        valid = ar[None, :longest] >= pad[:, None]  # (b, T)
        causal = ar[:longest, None] >= ar[None, :longest]  # (T, T)
        dec.mask = (causal[None] & valid[:, None]) | torch.eye(longest, dtype=torch.bool, device=device)[None]
        dec.mask = dec.mask[:, None]  # (b, 1, T, T)
    return dec


@torch.no_grad()
def generate(
    model: DecoderLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_id: int | None = None,
    pad_id: int = 0,
    dtype: torch.dtype | None = None,
) -> list[list[int]]:
    """The continuation (new tokens only) of each prompt; collective over the model's grid."""
    comm, device = model.comm, next(model.parameters()).device
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    rows, longest, split, shard, axes = _shard_prompts(model, prompts, max_new_tokens)
    b = len(rows)
    limit = longest + max_new_tokens
    if limit > model.spec.seq_len:
        raise ValueError(
            f"prompt of {longest} tokens + {max_new_tokens} new ones exceeds the model's context "
            f"of {model.spec.seq_len} tokens"
        )
    lens = torch.tensor([len(p) for p in rows], device=device)
    pad = longest - lens  # (b,) left padding
    idx = torch.full((b, longest), pad_id, dtype=torch.long, device=device)
    for i, p in enumerate(rows):
        idx[i, longest - len(p) :] = torch.tensor(p, device=device)
    ar = torch.arange(limit, device=device)
    padded = bool((pad > 0).any())
    dec = _prefill_decoding(model, pad, ar, longest, padded or split, dtype)
    gens = [torch.Generator().manual_seed(sampling.seed * 1000003 + shard * b + i) for i in range(b)]
    model.eval()
    if split:
        logits = _split_prefill(model, idx, dec)  # (b, V/(x*y))
    else:
        logits = model(idx, decoding=dec)[:, -1]  # (b, V/(x*y))
    out = torch.zeros(b, max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    steps = 0
    for t in range(max_new_tokens):
        nxt = _choose(_gather_vocab(logits, model), sampling, gens)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        out[:, t], steps = nxt, t + 1
        if eos_id is not None:
            done |= nxt == eos_id
            left = comm.all_reduce((~done).sum().reshape(1).float(), ("z", "data"))
            if float(left[0]) == 0:
                break
        if t == max_new_tokens - 1:
            break
        dec.positions = (lens + t)[:, None]
        if padded:
            dec.mask = (ar[None, : longest + t + 1] >= pad[:, None])[:, None, None]  # (b, 1, 1, T_cached)
        logits = model(nxt[:, None], decoding=dec)[:, -1]
    return _collect(model, out[:, :steps], len(prompts), eos_id, axes)


def _split_prefill(model: DecoderLM, idx: torch.Tensor, dec: Decoding) -> torch.Tensor:
    """The prefill on a sequence split over z (:mod:`axo4d.nn.seqsplit`): each z rank runs its
    chunks of every prompt (true positions, its rows of the mask), each layer's cache all-gathers
    K and V over z so every z rank then holds the whole prompt's, and decoding goes on as without
    the split (the z ranks decode the same rows). Returns the last position's logits (b, V/(x*y)):
    chunk ``2*G_z-1`` is z rank 0's, sent to every z rank."""
    comm = model.comm
    pos = chunk_positions(idx.shape[1], comm.size("z"), comm.coord("z")).to(idx.device)
    for c in dec.caches:
        c.gather = comm
    dec.positions, dec.mask = dec.positions[:, pos], dec.mask[:, :, pos]  # (b, T/z), (b, 1, T/z, T)
    try:
        last = model(idx[:, pos], decoding=dec)[:, -1]  # (b, V/(x*y)): the last position on z rank 0
    finally:
        for c in dec.caches:
            c.gather = None
    return comm.all_gather(last.contiguous(), "z").view(comm.size("z"), *last.shape)[0]


def _collect(
    model: DecoderLM, out: torch.Tensor, n: int, eos_id: int | None, axes: tuple[str, ...] = ("z", "data")
) -> list[list[int]]:
    """Every rank's rows (split over ``axes``), in prompt order, trimmed after the end-of-text token."""
    comm = model.comm
    if comm.size(axes) > 1:
        flat = comm.all_gather(out.contiguous(), axes)
        out = flat.view(comm.size(axes), *out.shape).reshape(-1, out.shape[1])
    res = []
    for row in out[:n].tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        res.append(row)
    return res
