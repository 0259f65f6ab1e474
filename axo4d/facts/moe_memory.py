"""Expert parallelism's numbers per rank (docs/design.md section 16): which expert-group sizes a
grid allows, the experts' share of memory with ``E/G_ep`` experts a rank, the routed tokens'
activations with a routing imbalance, and the all-to-all's volume on the expert group's links.
No torch here; read by the performance model (``perfmodel/expert_pricing.py``) and the trainer's
memory check (``axo4d/training/memory_plan.py``).

The expert group: ``G_ep`` consecutive ranks of the ``data`` axis (``G_ep`` divides ``G_data``
and ``E``); each rank holds ``E/G_ep`` experts, each still split over x, y (and z) as a 3D layer.
``G_ep = 1`` is today's layout (every expert on every batch rank).

Per MoE layer and micro-step, with ``b`` the rank's local tokens (rows), ``k`` experts per token,
``C_l = C/(G_x G_y)`` the residual stream's features a rank holds (the tokens are exchanged as
they lie, each (x, y) rank with its peers of the expert group) and ``imb >= 1`` the routing
imbalance (the busiest rank's routed rows over the mean):

* all-to-all, forward: dispatch and combine, ``2 * k * b * C_l * (G_ep-1)/G_ep`` elements a rank
  sends (and receives) over the expert group's links; backward the same again (their transposes);
  with activation checkpointing the recomputed forward repeats the forward's;
* dispatch buffers: ``k * b * C_l`` elements sent and ``imb * k * b * C_l`` received on the
  busiest rank, one layer's at a time (transient);
* routed activations: the experts' kept inputs and intermediates scale with the rows a rank's
  experts multiply, ``imb * k * b`` (``k * b`` balanced or with ``G_ep = 1``), where
  :func:`axo4d.facts.memory.memory` counts ``b`` (it prices one MLP per token, a dense block's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from axo4d.facts.memory import Memory, Setup, memory, shard_on, weight_dtypes
from axo4d.facts.moe_parts import router_of
from axo4d.facts.spec import Dtypes, ModelSpec

EXPERT_PREFIX = "mlp.experts."
#: routed rows of the busiest rank over the mean on an expert-parallel grid, assumed by the memory
#: check and the performance model (a load-balanced router; nothing is dropped, so a badly balanced
#: one can need more)
IMBALANCE = 1.1


@dataclass(frozen=True)
class ExpertParallel:
    """The expert group's size and the routing imbalance assumed for the busiest rank."""

    g_ep: int = 1
    """``parallel.expert``: ranks of an expert group (consecutive along ``data``)."""
    imbalance: float = 1.0
    """Routed rows of the busiest rank over the mean (1: balanced routing)."""


def n_experts(spec: ModelSpec) -> int:
    """Experts of the MoE layers (0 for a dense model)."""
    r = router_of(spec.block)
    return r.n_experts if r else 0


def ep_problems(spec: ModelSpec, ep: ExpertParallel) -> list[str]:
    """Why ``ep`` cannot run on ``spec``'s grid (empty when it can), one line each."""
    e, g_data = n_experts(spec), spec.grid.size("data")
    out = []
    if ep.g_ep < 1:
        out.append(f"parallel.expert={ep.g_ep} must be >= 1")
    elif ep.g_ep > 1 and not e:
        out.append(f"parallel.expert={ep.g_ep} needs an MoE model; this one is dense (use 1)")
    elif g_data % ep.g_ep or (e and e % ep.g_ep):
        out.append(f"parallel.expert={ep.g_ep} must divide G_data={g_data} and n_experts={e}")
    if ep.imbalance < 1:
        out.append(f"routing imbalance {ep.imbalance} must be >= 1 (the busiest rank over the mean)")
    return out


def ep_sizes(spec: ModelSpec) -> list[int]:
    """Every valid expert-group size on ``spec``'s grid: divisors of G_data dividing E."""
    e, g_data = n_experts(spec), spec.grid.size("data")
    return [d for d in range(1, g_data + 1) if g_data % d == 0 and e and e % d == 0] or [1]


def expert_elements(spec: ModelSpec) -> tuple[float, float]:
    """(local elements of every expert's weights on a rank in today's layout, summed over the
    blocks; the elements whose optimizer state it owns when sharded over their ``grad_sum`` group)."""
    local = owned = 0.0
    for name, pl, per_block in spec.placements():
        if name.startswith(EXPERT_PREFIX):
            n = math.prod(pl.full_shape) / (spec.grid.size(*pl.split) if pl.split else 1) * spec.n_layer
            local += n
            owned += n / spec.grid.size(*pl.grad_sum)
    return local, owned


def a2a_elements(spec: ModelSpec, b: float, ep: ExpertParallel) -> float:
    """Elements one rank sends in one direction of a forward's all-to-alls of one MoE layer
    (dispatch + combine): ``2 * k * b * C_l * (G_ep-1)/G_ep`` (module docstring)."""
    r = router_of(spec.block)
    if not r or ep.g_ep == 1:
        return 0.0
    c_l = spec.hidden / (spec.grid.x * spec.grid.y)
    return 2 * r.top_k * b * c_l * (ep.g_ep - 1) / ep.g_ep


def a2a_bytes_per_step(spec: ModelSpec, b: float, dt: Dtypes, ep: ExpertParallel, micro: int, ckpt: bool) -> float:
    """Bytes a rank sends over the expert group's links in one step: every MoE layer's forward
    and backward (and recomputed forward) all-to-alls in every micro-step."""
    passes = 2 + (1 if ckpt else 0)
    return a2a_elements(spec, b, ep) * dt.act * spec.n_layer * passes * micro


def routed_block_bytes(spec: ModelSpec, b: float) -> float:
    """Activation bytes (2-byte activations) one block's MLP keeps per ``b`` rows in the dense
    count of :func:`axo4d.facts.memory.block_activation_bytes`: the up layer's input gathered over
    y, the activation's input on its block, the down layer's input gathered over x."""
    g, f = spec.grid, spec.ffn_width() / 4
    return 2 * b * spec.hidden / g.x + 8 * f * b / (g.x * g.y) + 8 * f * b / g.y


def expert_setting(g_ep: int, imbalance: float = IMBALANCE) -> ExpertParallel:
    """The expert group of ``G_ep`` ranks with ``imbalance`` (none within one rank: ``G_ep = 1``)."""
    return ExpertParallel(g_ep, imbalance if g_ep > 1 else 1.0)


def memory_with_experts(spec: ModelSpec, b: float, dt: Dtypes, setup: Setup, ep: ExpertParallel) -> Memory:
    """:func:`~axo4d.facts.memory.memory` with ``E/G_ep`` experts a rank: their weights, their
    gradients (where whole: a sharded optimizer's reduced buckets keep only owned slices, which
    expert parallelism does not change) and unsharded optimizer state divided by ``G_ep``
    (sharded, a rank owns ``1/G_data`` of an expert either way); the experts' activations for the
    rows they multiply, ``imb * k * b`` (``k * b`` with ``G_ep = 1``: the rank's own tokens) where
    ``memory`` counts ``b`` (one MLP per token); one layer's dispatch buffers. Dense: ``memory``.
    ``spec`` may be of a grid with or without its expert group (``spec.grid.expert``: the trainer's
    is, the performance model's is not); only the experts not yet divided out are."""
    m = memory(spec, b, dt, setup)
    r = router_of(spec.block)
    if not r:
        return m
    d = weight_dtypes(dt, setup.offload)
    sharded = shard_on(spec, setup.shard)
    local, _ = expert_elements(spec)  # on a spec of an expert-parallel grid: its E/G_ep experts already
    gone = local - local * spec.grid.expert / ep.g_ep  # expert elements this rank no longer holds
    own_gone = 0.0 if sharded else gone
    imb = ep.imbalance if ep.g_ep > 1 else 1.0
    layers = 1 if setup.checkpointing else spec.n_layer
    extra_act = (imb * r.top_k - 1) * routed_block_bytes(spec, b) * dt.act / 2 * layers
    c_l = spec.hidden / (spec.grid.x * spec.grid.y)
    dispatch = (1 + imb) * r.top_k * b * c_l * dt.act if ep.g_ep > 1 else 0.0
    dev = dict(m.device)
    dev["params"] -= gone * d.param_state
    dev["grads"] -= 0.0 if (sharded and not setup.accumulate) else gone * d.grad_state
    dev["optimizer"] -= own_gone * m.device_fraction * (8 + 4 * (d.param_state != 4))
    dev["activations"] += extra_act
    dev["transient"] += dispatch
    dev["total"] = sum(v for k, v in dev.items() if k != "total")
    return replace(m, device=dev, owned_elements=m.owned_elements - own_gone)


__all__ = [
    "ExpertParallel",
    "n_experts",
    "ep_problems",
    "ep_sizes",
    "expert_elements",
    "a2a_elements",
    "a2a_bytes_per_step",
    "routed_block_bytes",
    "memory_with_experts",
    "expert_setting",
    "IMBALANCE",
]
