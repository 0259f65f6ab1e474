"""Goldfish loss's hashed mask (Hans et al., 2024; docs/design.md section 8).

Target token ``i`` of a sample is dropped from the loss when a hash of the ``h`` tokens before it,
``tokens[i-h:i]``, is ``0 mod k``: about ``1/k`` of the targets. The decision depends on nothing
but those token ids, so a passage is masked the same way wherever it appears, on every grid, in
every rerun and after a resume; a model trained on it never gets a gradient for the dropped tokens
in that context and cannot learn to reproduce the passage verbatim.

The first ``h`` tokens of a sample are never dropped: token 0 is never a target, and tokens
``1..h-1`` have fewer than ``h`` tokens before them inside the sample (their context would depend
on where the sample was cut, so they are simply kept).

The hash (integers below 2**62 throughout, so int64 never overflows):

    mix(t)   = (t mod P) * A + B                    mod P        P = 2**31 - 1, per token
    H(c)     = sum_d mix(c_d) * M**(h-1-d)          mod P        Horner over the h context tokens
    f(H)     = two rounds of  x ^= x >> 15;  x = x * C mod P    avalanche
    dropped  = f(H) mod k == 0

Vectorised over the whole batch with ``h`` passes of elementwise integer ops, on the tensors' own
device, with no host synchronisation.
"""

from __future__ import annotations

import torch

P = 2**31 - 1
"""Modulus of every step of the hash (a Mersenne prime)."""
A, B, M, C = 1_103_515_245, 12_345, 1_000_003, 1_597_334_677
"""Token multiplier and offset, Horner base, avalanche multiplier (all below P)."""


def check_goldfish(k: int, h: int) -> None:
    """``ValueError`` naming a bad ``k`` or ``h`` (k=0 is off)."""
    if k == 1:
        raise ValueError("goldfish_k=1 would drop every token; use 0 (off) or k >= 2 (drops about 1/k)")
    if k < 0:
        raise ValueError(f"goldfish_k={k} must be 0 (off) or >= 2 (drops about 1/k of the tokens)")
    if h < 1:
        raise ValueError(f"goldfish_h={h} must be >= 1 (tokens hashed before each target)")


def _avalanche(x: torch.Tensor) -> torch.Tensor:
    for _ in range(2):
        x = x ^ (x >> 15)
        x = (x * C) % P
    return x


def goldfish_keep(inputs: torch.Tensor, targets: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """Boolean ``(B, T)``: whether each target counts in the loss (``False`` = dropped).

    ``inputs``, ``targets``: ``(B, T)`` int token ids of samples with ``targets[:, j] = inputs[:, j+1]``
    (a window ``w`` of ``T + 1`` tokens: ``inputs = w[:-1]``, ``targets = w[1:]``). Target ``j`` is
    window token ``j + 1``; its context is ``w[j+1-h : j+1]``.
    """
    check_goldfish(k, h)
    if k == 0:
        return torch.ones_like(targets, dtype=torch.bool)
    window = torch.cat([inputs[:, :1], targets], dim=1).long()  # (B, T+1)
    mixed = ((window % P) * A + B) % P  # (B, T+1), each < P
    t = targets.shape[1]
    n = t - h + 1  # targets with a full context: j = h-1 .. T-1
    keep = torch.ones_like(targets, dtype=torch.bool)  # (B, T)
    if n <= 0:
        return keep
    acc = torch.zeros_like(mixed[:, :n])  # (B, n)
    for d in range(h):  # context token d of target j: w[j+1-h+d]
        acc = (acc * M + mixed[:, d : d + n]) % P
    keep[:, h - 1 :] = _avalanche(acc) % k != 0
    return keep
