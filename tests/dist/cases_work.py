"""Rank-side work counting (run by test_work.py): one training step's non-GEMM work on each rank of a
grid, to be summed over the ranks and compared with one process's (docs/design.md section 15).

Counted per rank, forward and backward of one step (no recomputation, eager schedule):

* ``attention``: FLOPs of the attention kernels (torch's ``FlopCounterMode``: the CPU SDPA kernel
  and its backward, or the batched matmuls of a math fallback; the linear layers run ``mm``/``addmm``
  and are not counted here);
* ``activation``: elements written by ``gelu``/``silu`` and their backward kernels (a
  ``TorchDispatchMode`` sees every operator below autograd);
* ``norm``: elements a norm module writes: its output in forward, its input gradient in backward;
* ``saved_bytes``: bytes of the storages autograd keeps for backward (parameters not counted), and
  ``predicted_bytes``, the memory model's activations for this rank (:func:`activation_bytes`).

A rank that repeats a replica's work adds it again, so on a grid whose tensor axes replicate the
in-between work the sums are ``G_x`` (attention, activation) or ``G_y`` (norms) times one process's.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.colls import Dtypes
from axo4d.facts.grid import Grid
from axo4d.facts.memory import activation_bytes
from axo4d.models import build_model
from axo4d.nn.context import LayerContext
from axo4d.nn.norms import _Norm
from axo4d.nn.schedule import Schedule
from axo4d.nn.seqsplit import local_part

ACTIVATIONS = ("gelu", "gelu_backward", "silu", "silu_backward")
BATCH = 8


class _Elements(TorchDispatchMode):
    """Elements written by the activation operators."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in ACTIVATIONS:
            self.n += sum(t.numel() for t in (out if isinstance(out, (tuple, list)) else [out]))
        return out


def _pairs(q: torch.Tensor, k: torch.Tensor, is_causal: bool, mask: torch.Tensor | None) -> int:
    """(query, key) pairs attended per batch row and head: causal ``T (T + 1) / 2``; with a mask, its
    entries that are not masked out (additive 0, or boolean True); else every pair."""
    tq, tk = q.shape[-2], k.shape[-2]
    if mask is not None:
        keep = mask if mask.dtype == torch.bool else mask == 0
        return int(keep.expand(*keep.shape[:-2], tq, tk)[(0,) * (keep.dim() - 2)].sum())
    return tq * (tq + 1) // 2 if is_causal else tq * tk


def _sdpa(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None, out_val=None, **kw) -> int:
    """Forward FLOPs of attention ``q (B, Hq, Tq, D)`` over ``k, v``: QK^T and AV on the pairs attended."""
    b, h, _, d = q.shape
    return 4 * b * h * d * _pairs(q, k, is_causal, attn_mask)


def _sdpa_backward(dout, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *, attn_mask=None, **kw) -> int:
    """Backward FLOPs: dV, dP, dQ and dK, twice the forward."""
    return 2 * _sdpa(q, k, v, dropout_p, is_causal, attn_mask=attn_mask)


_sdpa._get_raw = _sdpa_backward._get_raw = True  # the formulas read the mask's values
#: torch counts no FLOPs for the CPU attention kernels: their formulas (causal pairs only, so the
#: sequence split's chunked attention counts what one process's causal kernel does)
ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward,
}


def _attention_flops(fc: FlopCounterMode) -> int:
    counts = fc.get_flop_counts().get("Global", {})
    return int(sum(v for k, v in counts.items() if "attention" in str(k) or str(k).split(".")[-1] == "bmm"))


def count_step(config: str, comm: Comm, split: str, overrides: list[str] = ()) -> dict:
    """One step's counts on this rank of ``comm``'s grid (``split``: what z splits)."""
    cfg = load_config(config, list(overrides))
    ctx = LayerContext(comm, Schedule(comm), z_split=split)
    model = build_model(cfg.model, ctx)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.model.vocab_size, (BATCH, cfg.model.seq_len + 1), generator=gen)
    x, y = idx[:, :-1], idx[:, 1:]
    seq = split == "sequence" and comm.size("z") > 1
    rows = ("data",) if seq else ("z", "data")  # the axes that split the batch
    shards, shard = comm.size(rows), comm.index(rows)
    x, y = x.chunk(shards)[shard], y.chunk(shards)[shard]
    if seq:
        x, y = local_part(x, comm), local_part(y, comm)
    norm = [0]

    def fwd_hook(_m, _i, out):
        norm[0] += out.numel()

    def bwd_hook(_m, gin, _gout):
        norm[0] += sum(g.numel() for g in gin if g is not None)

    hooks = []
    for m in model.modules():
        if isinstance(m, _Norm):
            hooks += [m.register_forward_hook(fwd_hook), m.register_full_backward_hook(bwd_hook)]
    act = _Elements()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:  # every storage autograd keeps for backward, once
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with FlopCounterMode(display=False, custom_mapping=ATTENTION) as fc, act:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x, y).mean()
        loss.backward()
    model.finish_gradients()
    for h in hooks:
        h.remove()
    # the memory model's activations of this step on this rank (fp32, no recomputation, the CPU kernel)
    spec = model.spec.with_sequence_split() if seq else model.spec
    predicted = activation_bytes(spec, x.numel(), Dtypes.for_compute("fp32"), False, True)
    counts = {"attention": _attention_flops(fc), "activation": act.n, "norm": norm[0]}
    return counts | {"saved_bytes": sum(saved.values()), "predicted_bytes": predicted}


def run(info, cases: list[list]) -> list[dict]:
    """``cases``: ``[config, grid spec, z split, overrides]``; each gives this rank's counts and, on
    rank 0, the one-process counts of the same step."""
    out, refs = [], {}
    for config, spec, split, overrides in cases:
        key = (config, *overrides)
        if info.rank == 0 and key not in refs:
            refs[key] = count_step(config, Comm(Grid(), 0, init_groups=False), "batch", overrides)
        ref = refs.get(key)
        comm = Comm(Grid.parse(spec), info.rank, timeout_s=60)
        got = count_step(config, comm, split, overrides)
        out.append({"case": f"{config} {spec} z={split}", "ref": ref, "got": got})
    return out
