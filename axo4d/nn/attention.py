"""Attention on a rank's heads (heads split over x and y, rows over z and data): no communication.

Training calls :func:`attend` without a cache: causal, or with ``documents`` (B, T) -- the document
of each token of a packed sequence -- block-diagonal causal, so no token attends across a document
boundary (the mask is built here, per call, from the ids: a sequence split elsewhere carries its
ids along). Generation passes a :class:`Decoding`:
each layer appends its new keys and values to its :class:`KVCache` -- split the way attention is,
``(B/(data*z), H_kv/(x*y), T_max, D)`` -- and attends over everything cached, with a mask that is
causal and hides the left padding of shorter prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from axo4d.nn.seqsplit import SequenceSplit, gather_sequence, split_attend

_GQA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


@dataclass
class KVCache:
    """Keys and values of one layer for this rank's rows and heads."""

    k: torch.Tensor  # (B, H_kv/(x*y), T_max, D)
    v: torch.Tensor
    length: int = 0
    gather: object | None = None
    """A :class:`~axo4d.dist.comm.Comm` during a prefill on a sequence split over z: the new keys
    and values are this z rank's chunks, all-gathered over z (in order) before they are cached."""

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gather is not None:
            k, v = gather_sequence(k, self.gather, 2), gather_sequence(v, self.gather, 2)  # (B, H_kv/(x*y), T, D)
        t = k.shape[2]
        if self.length + t > self.k.shape[2]:
            raise ValueError(f"KV cache of {self.k.shape[2]} positions is full ({self.length} + {t})")
        self.k[:, :, self.length : self.length + t] = k
        self.v[:, :, self.length : self.length + t] = v
        self.length += t
        return self.k[:, :, : self.length], self.v[:, :, : self.length]


@dataclass
class Decoding:
    """What a forward pass needs to decode: per-layer caches, the new tokens' positions and the
    attention mask over all cached positions (``None``: plain causal, no padding)."""

    caches: list[KVCache]
    positions: torch.Tensor  # (B, T_new) position of each new token
    mask: torch.Tensor | None = None  # (B, 1, T_new, T_cached) True = attend
    extra: dict = field(default_factory=dict)

    @classmethod
    def allocate(
        cls,
        n_layer: int,
        batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Decoding:
        caches = [
            KVCache(
                torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device),
                torch.zeros(batch, kv_heads, max_len, head_dim, dtype=dtype, device=device),
            )
            for _ in range(n_layer)
        ]
        return cls(caches, torch.zeros(batch, 0, dtype=torch.long, device=device))


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """``(B, 1, T, T)`` bool, True = attend: causal and inside the query's document, from the
    document ids ``(B, T)`` of a packed sequence."""
    t = documents.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, :, None] == documents[:, None, :]).logical_and_(causal)[:, None]


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` position of each token inside its document (0 at each document's first token),
    from the document ids ``(B, T)`` of a packed sequence."""
    t = documents.shape[-1]
    idx = torch.arange(t, device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    start = torch.where(first, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - start


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: KVCache | None = None,
    mask: torch.Tensor | None = None,
    documents: torch.Tensor | SequenceSplit | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of ``q (B, Hq, T, D)`` over ``k, v (B, Hkv, T, D)`` (grouped:
    query head ``h`` uses kv head ``h // (Hq/Hkv)``), appending to ``cache`` first if given;
    ``documents`` (B, T): attention only inside each document (training, no cache); a
    :class:`~axo4d.nn.seqsplit.SequenceSplit`: the sequence is split over z (``T`` is this rank's
    part; K/V are gathered over z; :func:`~axo4d.nn.seqsplit.split_attend`)."""
    if isinstance(documents, SequenceSplit):
        if cache is not None or mask is not None:
            raise ValueError("a sequence split over z is for training: no cache, no explicit mask")
        return split_attend(q, k, v, documents)
    if documents is not None:
        if cache is not None or mask is not None:
            raise ValueError("a document mask is for training: no cache, no explicit mask")
        mask = document_mask(documents)
    if cache is not None:
        k, v = cache.append(k, v)
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv and not _GQA:  # older torch: repeat the kv heads
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    kw = {"enable_gqa": True} if hq != hkv and _GQA else {}
    if mask is None:
        causal = cache is None or q.shape[2] > 1
        if cache is not None and causal and k.shape[2] != q.shape[2]:
            raise ValueError("a multi-token step after a prefill needs an explicit mask")
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **kw)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
