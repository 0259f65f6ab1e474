"""The mixture-of-experts cases of :mod:`bench.bytes_check` (``--moe``): moe-tiny with its experts
over 2 and 4 data ranks, and the exactly balanced routing that makes the facts' uniform-routing
assumption exactly true (the reasons are :mod:`bench.bytes_check`'s docstring)."""

from __future__ import annotations

import argparse
from typing import Any

from axo4d.facts.grid import Grid, all_grids

MOE_CONFIG = "moe-tiny"
#: moe-tiny as it is (hidden 64, 4 heads over 2 K/V heads, 8 experts of width 32, top-2), fp32, a
#: vocabulary padded per x and y rank. Not yet exact in bf16 (autocast): there the dispatched rows
#: and their gradients travel in the residual stream's fp32, the router's logits in bf16 and the
#: gates' gradient in fp32, where the facts count every MoE element at ``act`` or ``stat`` bytes
#: (the dense check's bf16 y all-gathers differ too, on main before the MoE records)
MOE_OVERRIDES: tuple[str, ...] = ("train.global_batch=8", "train.dtype=fp32", "model.vocab_multiple=8")
MOE_GROUPS = (2, 4)
"""Expert-group sizes ``--moe`` runs on each grid whose data axis they divide."""


def balance_routing(model: Any) -> int:
    """Make every MoE layer of ``model`` route exactly balanced (:mod:`bench.bytes_check`'s docstring): the router's
    logits (with their collectives) and softmax as always, then the ``k`` slots of local token
    ``i`` to experts ``(i*k + j) mod E`` (distinct, as ``k <= E``), gated by their scores
    (renormalised where the family does). Layers changed (0 for a dense model)."""
    import types

    from axo4d.nn.experts import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for m in layers:
        m.route = types.MethodType(_balanced_route, m)
    return len(layers)


def _balanced_route(self: Any, flat: Any) -> tuple[Any, Any]:
    """:meth:`axo4d.nn.experts.MoE.route` with the experts of :func:`balance_routing`."""
    import torch

    from axo4d.nn.experts import router_logits

    logits = router_logits(flat, self.router.weight.to(flat.dtype), self.comm)  # (N, E)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    n, k, e = flat.shape[0], self.spec.top_k, self.spec.n_experts
    if (n * k) % e:
        raise ValueError(f"balanced routing: {n} tokens x top-{k} not divisible by {e} experts")
    chosen = (torch.arange(n * k, device=flat.device) % e).view(n, k)  # (N, k)
    top = probs.gather(1, chosen)
    if self.spec.norm_topk:
        top = top / top.sum(-1, keepdim=True)
    self.stats.record(probs, chosen, e)
    return top.to(flat.dtype), chosen


def moe_cases(opts: argparse.Namespace, world: int) -> list[list]:
    """``--moe``: ``[spec, overrides, 'moe-tiny']`` for every grid (of ``--grids``, or every one
    moe-tiny divides on) and expert-group size of :data:`MOE_GROUPS` dividing its data axis (or
    the one ``--set parallel.expert=N`` gives)."""
    import dataclasses

    from axo4d.config import load_config
    from axo4d.facts.archs import model_spec
    from axo4d.training.startup import z_split_of

    base = list(MOE_OVERRIDES) + list(opts.set)
    cfg = load_config(MOE_CONFIG, base)
    given = any(o.startswith("parallel.expert=") for o in opts.set)
    groups = [cfg.parallel.expert] if given else list(MOE_GROUPS)
    given_grids = [s.strip() for s in opts.grids.split(";") if s.strip()]
    grids = all_grids(world) if opts.grids == "all" else [Grid.parse(s) for s in given_grids]
    out = []
    for g in grids:
        for ep in [d for d in groups if g.data % d == 0]:
            ge = dataclasses.replace(g, expert=ep)
            spec = model_spec(cfg.model, ge).with_sequence_split(z_split_of(cfg, ge)[0] == "sequence")
            if opts.grids != "all" or not spec.divisibility_reasons(cfg.train.global_batch // cfg.train.grad_accum):
                out.append([g.spec(), base + ([] if given else [f"parallel.expert={ep}"]), MOE_CONFIG])
    return out
