"""Mixture-of-experts parts (docs/design.md section 16): the router, the per-head norms of
Qwen3's attention, the shared expert and its gate (Qwen2-MoE), and the MoE layer's parts
assembled for a Llama-like block.

Experts are 3D linear layers like any other (:class:`~axo4d.facts.parts.LinearSpec`), named
``mlp.experts.{e}.gate_up`` (rows interleaved gate/up per feature) and ``mlp.experts.{e}.down``
(transposed); each is marked with the fraction of the tokens that pass through it on average
(``k / E``), so the FLOP formula counts the active parameters only. The router is a linear layer
over the hidden features whose weight ``(E, C)`` is split over x on its input features: a rank
computes partial logits from its ``C/x`` features and sums them over x; its output (every
expert's score of every local token) is replicated over x and y. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from axo4d.facts.colls import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, COUNT_BYTES, Coll, Dtypes
from axo4d.facts.grid import Grid
from axo4d.facts.parts import LinearSpec
from axo4d.facts.placement import Block3D, ExpertBlock3D, Placement, Replicated, Split


@dataclass(frozen=True)
class RouterSpec:
    """The router of an MoE layer: ``logits = X W^T``, ``W: (n_experts, dim)`` split over x on its
    input features (like a norm's weight; each rank uses its y block, as the residual stream is split
    over x and y: docs/design.md section 2.1), logits summed over (x, y) (forward; backward none:
    the logits are replicated; the weight gradient's y blocks all-gathered over y); softmax over
    all experts, top-``top_k``, optionally renormalised."""

    name: str
    dim: int
    n_experts: int
    top_k: int
    norm_topk: bool = True
    init_std: float = 0.02

    def placements(self) -> dict[str, Placement]:
        return {"weight": Split((self.n_experts, self.dim), axis="x", dim=1, weight_decay=True)}

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        return 2.0 * rows * self.dim / (grid.x * grid.y) * self.n_experts

    def collectives(self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool) -> list[Coll]:
        """The logits' sum over (x, y) (forward, recompute) and, in backward, the gates' gradient's
        (``rows x top_k``: each rank's expert outputs hold ``C/(x*y)`` of the features) and the
        weight gradient's y blocks gathered over y."""
        nbytes = rows * self.n_experts * dt.stat
        phases = ("fwd",) + (("recompute",) if recompute else ())
        tp = ("x", "y")
        out = [Coll(self.name, ph, tp, ALL_REDUCE, nbytes, 1, "blocking", per_block) for ph in phases]
        gw = self.n_experts * self.dim / grid.x * dt.param_state
        return out + [
            Coll(self.name, "bwd", tp, ALL_REDUCE, rows * self.top_k * dt.act, 1, "blocking", per_block),
            Coll(self.name, "bwd", ("y",), ALL_GATHER, gw, 1, "blocking", per_block),
        ]

    def divisibility(self, grid: Grid) -> list[str]:
        if self.n_experts % grid.expert:
            return [
                f"n_experts={self.n_experts} not divisible by parallel.expert={grid.expert} (each rank of "
                f"an expert group holds n_experts/G_ep experts)"
            ]
        return []


@dataclass(frozen=True)
class SharedGateSpec:
    """The one-output gate of a shared expert (Qwen2-MoE's ``shared_expert_gate``): ``g = sigmoid(X
    w^T)``, ``w: (1, dim)``, the expert's output times ``g``. Its output width 1 divides no tensor
    axis, so it is placed as the router's weight is: split over x on its input features, each rank
    using its y block of them (the residual stream's ``C/(x*y)``), the partial dot products summed
    over (x, y) (forward; backward none: ``g`` is replicated over x and y). Its gradient: ``g``'s
    over (x, y), as each rank's shared-expert output holds ``C/(x*y)`` of the features; the
    weight's y blocks all-gathered over y, then summed over the batch axes as any x-split weight's."""

    name: str
    dim: int
    init_std: float = 0.02

    def placements(self) -> dict[str, Placement]:
        return {"weight": Split((1, self.dim), axis="x", dim=1, weight_decay=True)}

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        return 2.0 * rows * self.dim / (grid.x * grid.y)

    def collectives(self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool) -> list[Coll]:
        """The gate logits' sum over (x, y) (forward, recompute); in backward the gate's gradient's
        sum over (x, y) and the weight gradient's y blocks gathered over y."""
        phases = ("fwd",) + (("recompute",) if recompute else ())
        tp = ("x", "y")
        out = [Coll(self.name, ph, tp, ALL_REDUCE, rows * dt.act, 1, "blocking", per_block) for ph in phases]
        return out + [
            Coll(self.name, "bwd", tp, ALL_REDUCE, rows * dt.act, 1, "blocking", per_block),
            Coll(self.name, "bwd", ("y",), ALL_GATHER, self.dim / grid.x * dt.param_state, 1, "blocking", per_block),
        ]

    def divisibility(self, grid: Grid) -> list[str]:
        return []


@dataclass(frozen=True)
class HeadNormSpec:
    """RMSNorm over each attention head's ``head_dim`` features (Qwen3's ``q_norm``, ``k_norm``),
    local to the heads a rank holds: its weight is replicated, and its gradient, a sum over heads,
    is summed over the head axes in backward (one all-reduce per use, :func:`axo4d.nn.experts.grad_sum`) and
    over the batch axes as every replicated parameter's."""

    name: str
    dim: int
    axes: tuple[str, ...] = ("y",)
    """The axes splitting the heads (:meth:`~axo4d.facts.parts.AttentionSpec.head_axes`)."""

    def placements(self) -> dict[str, Placement]:
        return {"weight": Replicated((self.dim,))}

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        return 0.0

    def collectives(self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool) -> list[Coll]:
        if grid.size(*self.axes) == 1:
            return []
        return [Coll(self.name, "bwd", self.axes, ALL_REDUCE, self.dim * dt.grad, 1, "blocking", per_block)]

    def divisibility(self, grid: Grid) -> list[str]:
        return []


@dataclass(frozen=True)
class ExpertLinearSpec(LinearSpec):
    """A linear layer of expert ``expert`` of ``n_experts``; with expert parallelism (``group`` =
    ``G_ep`` > 1) its weight is an :class:`~axo4d.facts.placement.ExpertBlock3D`, held by one
    position of every expert group, else a plain Block3D (every batch rank holds every expert)."""

    expert: int = 0
    n_experts: int = 1
    group: int = 1
    held: bool = False
    """A spec of the experts one rank holds (the performance model's, :func:`held_experts`): its
    weight the rank's own Block3D piece (split over x, y, z, not ``ep``), summed over ``edp``."""

    def placements(self) -> dict[str, Placement]:
        out = LinearSpec.placements(self)
        w: Block3D = out["weight"]  # type: ignore[assignment]
        if self.group > 1 and self.held:
            out["weight"] = dataclasses.replace(w, grad_sum=("edp",))
        elif self.group > 1:
            out["weight"] = ExpertBlock3D(
                w.full_shape,
                in_axis=w.in_axis,
                out_axis=w.out_axis,
                logical_rows=w.logical_rows,
                expert=self.expert,
                n_experts=self.n_experts,
            )
        return out


def moe_checks(n_experts: int, top_k: int, ffn: int, grid: Grid) -> list[str]:
    """Why an MoE layer of these numbers cannot be built (empty when it can)."""
    out = []
    if n_experts < 1:
        out.append(f"n_experts={n_experts} must be >= 1 for an MoE architecture")
    elif not 1 <= top_k <= n_experts:
        out.append(f"experts_per_token={top_k} must be between 1 and n_experts={n_experts}")
    if ffn % grid.y:
        out.append(f"ffn_hidden={ffn} (one expert's width) not divisible by G_y={grid.y}")
    return out


def moe_parts(
    hidden: int, n_experts: int, top_k: int, ffn: int, norm_topk: bool, std: float, res_std: float, group: int = 1
) -> tuple:
    """The MoE layer's parts in call order: ``mlp.router``, then per expert ``e`` its
    ``mlp.experts.{e}.gate_up`` and ``mlp.experts.{e}.down`` (``group``: ``G_ep``)."""
    active = min(top_k, n_experts) / max(1, n_experts)
    out: list = [RouterSpec("mlp.router", hidden, n_experts, top_k, norm_topk, std)]
    ex = {"active": active, "n_experts": n_experts, "group": group}
    for e in range(n_experts):
        out += [
            ExpertLinearSpec(f"mlp.experts.{e}.gate_up", hidden, 2 * ffn, init_std=std, expert=e, **ex),
            ExpertLinearSpec(f"mlp.experts.{e}.down", ffn, hidden, transposed=True, init_std=res_std, expert=e, **ex),
        ]
    return tuple(out)


def shared_expert_parts(hidden: int, ffn: int, std: float, res_std: float) -> tuple:
    """A dense shared expert (Qwen2-MoE): ``mlp.shared_expert.gate_up`` (rows interleaved gate/up),
    ``mlp.shared_expert.down`` -- a 3D pair like the dense MLP, split over x and y on every batch
    rank (not over the expert group) -- and its gate ``mlp.shared_expert_gate``."""
    return (
        LinearSpec("mlp.shared_expert.gate_up", hidden, 2 * ffn, init_std=std),
        LinearSpec("mlp.shared_expert.down", ffn, hidden, transposed=True, init_std=res_std),
        SharedGateSpec("mlp.shared_expert_gate", hidden, std),
    )


def shared_checks(ffn: int, grid: Grid) -> list[str]:
    """Why a shared expert of width ``ffn`` cannot be built on ``grid`` (empty when it can)."""
    if ffn < 1:
        return [f"shared_expert_ffn={ffn} must be >= 1 for an architecture with a shared expert"]
    if ffn % (grid.x * grid.y):  # gate/up pairs whole in every rank's block, as the dense MLP's
        return [f"shared_expert_ffn={ffn} not divisible by G_x*G_y={grid.x * grid.y}"]
    return []


def a2a_collectives(r: RouterSpec, grid: Grid, rows: float, dt: Dtypes, recompute: bool) -> list[Coll]:
    """The expert group's all-to-alls of one MoE layer and micro-step on ``grid`` (none unless
    ``grid.expert`` = ``G_ep`` > 1; :meth:`axo4d.nn.experts.MoE.dispatch`), per block, over ``ep``:
    in forward (and a recomputed forward) the per-expert counts (``E`` int64), the dispatch of the
    rank's ``k * rows`` (token, slot) rows of ``C/(G_x G_y)`` features and the combine sending back
    the rows its experts multiplied; in backward the two transposed. ``nbytes`` is the whole input
    of a call (rows a rank keeps included, as :class:`~axo4d.dist.comm.Comm` counts). Uniform
    routing assumed: a rank's experts multiply ``k * rows`` rows (the mean; with a real router the
    combine's rows vary per rank and step: the busiest rank's are ``imbalance`` times more)."""
    if grid.expert == 1:
        return []
    ep, nb = ("ep",), r.top_k * rows * r.dim / (grid.x * grid.y) * dt.act
    out = []
    for ph in ("fwd",) + (("recompute",) if recompute else ()):
        out += [
            Coll(r.name, ph, ep, ALL_TO_ALL, r.n_experts * COUNT_BYTES, 1, "blocking"),
            Coll(r.name, ph, ep, ALL_TO_ALL, nb, 2, "blocking"),
        ]
    return out + [Coll(r.name, "bwd", ep, ALL_TO_ALL, nb, 2, "blocking")]


def router_stats_coll(r: RouterSpec, n_layer: int, dt: Dtypes) -> Coll:
    """The routers' statistics of one forward summed over the batch axes
    (:meth:`axo4d.nn.experts.RouterStats.loss`): every layer's tokens per expert and the token
    count, ``(n_layer * E + 1)`` fp32 values, one all-reduce over ``(data, z)`` per micro-step
    (whatever the expert group)."""
    return Coll(r.name, "fwd", ("data", "z"), ALL_REDUCE, (n_layer * r.n_experts + 1) * dt.stat, 1, "blocking", False)


def held_experts(block: tuple, g_ep: int, share: float) -> tuple:
    """``block`` with only the experts a rank holds with ``g_ep`` ranks an expert group (the first
    ``E/G_ep``: every rank holds as many, of the same shapes), each marked ``held``
    (:class:`ExpertLinearSpec`) and with ``active = share`` (the rows it multiplies over the rank's
    rows); a block without experts unchanged."""
    r = router_of(block)
    if not r:
        return block
    keep, out = r.n_experts // g_ep, []
    for p in block:
        if isinstance(p, ExpertLinearSpec):
            if p.expert < keep:
                out.append(dataclasses.replace(p, active=share, held=g_ep > 1))
        else:
            out.append(p)
    return tuple(out)


def router_of(block: tuple) -> RouterSpec | None:
    """The block's router (None for a dense block)."""
    return next((p for p in block if isinstance(p, RouterSpec)), None)


__all__ = [
    "RouterSpec",
    "SharedGateSpec",
    "HeadNormSpec",
    "ExpertLinearSpec",
    "moe_checks",
    "moe_parts",
    "shared_expert_parts",
    "shared_checks",
    "router_of",
    "a2a_collectives",
    "router_stats_coll",
    "held_experts",
]
