"""A mixture-of-experts layer on the grid (docs/design.md section 16): router, dropless top-k
routing, ``E`` SwiGLU experts, a gated dense shared expert where the family has one
(:class:`SharedExpertMoE`, Qwen2-MoE), and the router's load-balancing loss as ``transformers``
computes it.

Shapes: N = local tokens (B*T of this rank), C = hidden, E = experts, k = experts per token,
F = one expert's width. The input ``(B, T, C/(x*y))`` is the residual stream (features over x and
y, section 2.1). The router's partial logits from this rank's features are summed over
(x, y) (:class:`RouterLogits`), so every x and y rank of a batch shard routes its tokens alike; each
expert is a pair of :class:`~axo4d.nn.linear.Linear3D` (gate|up non-transposed, down transposed)
that multiplies the rows routed to it -- any number, none included: every expert runs every
step, so the layers' collectives stay matched across ranks. Nothing is dropped (no capacity).
Where the experts are whole on the rank, they may run as grouped GEMMs instead
(:class:`GroupedExperts`, ``train.expert_gemm``).

Expert parallelism (``parallel.expert`` = ``G_ep`` > 1): a rank holds the ``E/G_ep`` experts of
its position in its expert group (``G_ep`` consecutive data ranks, the ``ep`` sub-axis,
:mod:`axo4d.facts.grid`); each rank routes its own tokens, sorts the (token, slot) pairs by expert,
exchanges the per-expert counts and sends the rows to their experts' ranks by an all-to-all over
``ep``, which multiply them and send them back by the reverse one (:meth:`MoE.dispatch`); the
gates weigh them where the token lives. Every x and y rank of a batch shard sends the same rows
(its feature slice), so the experts' 3D layers run as without expert parallelism.

Load-balancing loss (``transformers``' ``load_balancing_loss_func`` over every layer's router
logits, all tokens counting): with ``c_e`` the (token, slot) pairs routed to expert ``e`` and
``P_e`` the sum of its softmax scores, both summed over the layers and over the micro-batch's
tokens on every rank of ``(data, z)``, and ``n`` = layers x tokens::

    aux = E * sum_e (c_e / n) * (P_e / n)

``c`` carries no gradient, so each rank adds ``E * sum_e c_e P_e(local) / n^2`` -- the sum over
the batch ranks is ``aux``, its gradient the one-process gradient (:meth:`RouterStats.loss`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from axo4d.dist.comm import Comm
from axo4d.dist.eager import eager
from axo4d.dist.mappings import all_to_all, slice_features
from axo4d.facts.moe_parts import RouterSpec
from axo4d.facts.placement import constant, normal, place
from axo4d.facts.spec import ModelSpec
from axo4d.nn.context import LayerContext
from axo4d.nn.grouped_gemm import kernel_for, swiglu_experts
from axo4d.nn.linear import Linear3D, compute_dtype

BATCH_AXES = ("z", "data")
TP = ("x", "y")  # the axes splitting the residual stream's features (docs/design.md section 2.1)


class RouterLogits(torch.autograd.Function):
    """forward: all-reduce (sum) over (x, y) of the partial logits; backward: identity (every rank
    consumes the whole logits alike and holds their whole gradient)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: Comm) -> torch.Tensor:
        return comm.all_reduce(t.clone(), TP)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def router_logits(x: torch.Tensor, weight: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``x (N, C/(x*y)) @ weight (E, C/x)[y block]^T`` summed over (x, y): (N, E). The group's size
    is read before the compiler-disabled call, so a compiled graph on a group of one has no break."""
    part = F.linear(x, slice_features(weight, comm, "y"))
    return part if comm.size(TP) == 1 else _router_sum(part, comm)


@eager
def _router_sum(part: torch.Tensor, comm: Comm) -> torch.Tensor:
    return RouterLogits.apply(part, comm)


class GradSum(torch.autograd.Function):
    """forward: identity; backward: all-reduce (sum) over ``axis`` of the gradient. For a tensor
    replicated over the axis whose consumers each contribute part of its gradient: the gates of
    the experts (their product with an expert's output, whose features are split over x), the
    per-head norms' weights (used on the heads of one y rank)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: Comm, axis: str | tuple[str, ...]) -> torch.Tensor:
        ctx.comm, ctx.axis = comm, axis
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.comm.all_reduce(g.contiguous().clone(), ctx.axis), None, None


def grad_sum(t: torch.Tensor, comm: Comm, axis: str | tuple[str, ...]) -> torch.Tensor:
    """``t``, its gradient summed over ``axis`` (identity when the axis has one rank: decided before
    the compiler-disabled call, so a compiled graph on a group of one has no break)."""
    return t if comm.size(axis) == 1 else _grad_sum(t, comm, axis)


@eager
def _grad_sum(t: torch.Tensor, comm: Comm, axis: str | tuple[str, ...]) -> torch.Tensor:
    return GradSum.apply(t, comm, axis)


class HeadNorm(nn.Module):
    """RMSNorm over the last dimension (one head's features), local to this y rank's heads
    (Qwen3's ``q_norm``/``k_norm``; part :class:`~axo4d.facts.moe_parts.HeadNormSpec`)."""

    def __init__(self, s: ModelSpec, name: str, eps: float, comm: Comm) -> None:
        super().__init__()
        pl = s.part(name).placements()["weight"]
        self.weight = place(nn.Parameter(torch.ones(pl.local_shape(comm.grid))), pl, constant(1.0))
        self.eps, self.comm, self.axes = eps, comm, s.part(name).axes

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:  # (..., D)
        """``weight``: :meth:`used_weight`, taken earlier by a caller that must keep its compiled
        graph from breaking here (a break between views of one tensor, as attention's q, k, v of
        its QKV output, makes torch's compiled code replay the views wrongly)."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.used_weight() if weight is None else weight) * y.to(x.dtype)

    def used_weight(self) -> torch.Tensor:
        """The weight, its gradient summed over the head axes (:func:`grad_sum`)."""
        return grad_sum(self.weight, self.comm, self.axes)


def expert_counts(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(token, slot) pairs per expert of ``chosen`` (indices < ``n_experts``): ``(E,)`` int64, as
    ``bincount(minlength=E)`` counts them, but of a shape known before the values (a compiled graph
    does not break on it)."""
    flat = chosen.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=chosen.device).index_add_(0, flat, torch.ones_like(flat))


class RouterStats:
    """What the routers of one forward saw: per layer the sum of the softmax scores over the
    local tokens (with its graph) and the (token, slot) counts per expert; the load-balancing loss
    and the step's tokens per expert come from it."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.probs: list[torch.Tensor] = []
        self.counts: list[torch.Tensor] = []
        self.tokens = 0
        self.step_counts: torch.Tensor | None = None

    def clear(self) -> None:
        """Forget the last forward (a new forward begins)."""
        self.probs, self.counts, self.tokens = [], [], 0

    def record(self, probs: torch.Tensor, chosen: torch.Tensor, n_experts: int) -> None:
        """``probs``: (N, E) softmax scores; ``chosen``: (N, k) the experts each token goes to."""
        self.probs.append(probs.sum(0))  # (E,)
        self.counts.append(expert_counts(chosen, n_experts).to(probs.dtype))  # (E,)
        self.tokens = probs.shape[0]  # local tokens (every layer routes them all)

    def loss(self) -> torch.Tensor | None:
        """This rank's part of the load-balancing loss of the last forward (module docstring;
        summed over ``(data, z)`` it is ``transformers``' value); adds the forward's global counts
        to the step's (:meth:`take_counts`). One all-reduce over the batch axes. None without MoE."""
        if not self.probs:
            return None
        counts = torch.stack(self.counts)  # (L, E)
        n = torch.tensor([float(self.tokens)], dtype=counts.dtype, device=counts.device)
        both = self.comm.all_reduce(torch.cat([counts.reshape(-1), n]), BATCH_AXES)  # global counts, tokens
        counts, n = both[:-1].view_as(counts), both[-1] * counts.shape[0]
        self.step_counts = counts if self.step_counts is None else self.step_counts + counts
        p = torch.stack(self.probs).sum(0)  # (E,) this rank's score sums over layers
        return counts.shape[1] * (counts.sum(0) * p).sum() / (n * n)

    def take_counts(self) -> torch.Tensor | None:
        """(layers, E) global (token, slot) counts per expert since the last call (None if none)."""
        out, self.step_counts = self.step_counts, None
        return out


class Expert(nn.Module):
    """One SwiGLU expert: gate|up (non-transposed, rows interleaved gate/up), down (transposed).
    Where its layers run FP8 (``train.fp8``, the rule of :mod:`axo4d.facts.fp8_rule` with the
    routed rows), its layers pad the rows it is given (any number) with zero rows to a multiple of
    16 for the GEMMs (:meth:`~axo4d.nn.linear.Linear3D._fp8_forward`)."""

    def __init__(self, s: ModelSpec, ctx: LayerContext, e: int) -> None:
        super().__init__()
        ctx = dataclasses.replace(ctx, tuner=None)  # rows change every step: nothing for the tuner to keep
        self.gate_up = Linear3D.from_spec(s.part(f"mlp.experts.{e}.gate_up"), ctx)
        self.down = Linear3D.from_spec(s.part(f"mlp.experts.{e}.down"), ctx)
        for lin in (self.gate_up, self.down):  # the spec's placement: who holds it, where it is summed
            place(lin.weight, s.part(lin.name).placements()["weight"], lin.weight.init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (n_e, C/(x*y))
        gu = self.gate_up(x).unflatten(-1, (-1, 2))  # (n_e, F/(x*y), 2): gate, up
        return self.down(F.silu(gu[..., 0]) * gu[..., 1])  # (n_e, F/(x*y)) -> (n_e, C/(x*y))


class MoE(nn.Module):
    """The MoE layer of a block (parts ``mlp.router`` and ``mlp.experts.{e}.*`` of the spec)."""

    def __init__(self, s: ModelSpec, ctx: LayerContext, stats: RouterStats) -> None:
        super().__init__()
        r: RouterSpec = s.part("mlp.router")
        self.spec, self.comm = r, ctx.comm
        object.__setattr__(self, "stats", stats)  # shared by the model's layers, not a child
        pl = r.placements()["weight"]
        self.router = nn.Module()
        self.router.weight = place(nn.Parameter(torch.empty(pl.local_shape(ctx.grid))), pl, normal(r.init_std))
        #: the experts this rank holds: the ``E/G_ep`` of its position in the expert group
        self.group = ctx.comm.size("ep")
        m = r.n_experts // self.group
        first = ctx.comm.index("ep") * m
        self.experts: ExpertSet = ExpertSet({str(e): Expert(s, ctx, e) for e in range(first, first + m)})

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gates (N, k) in ``flat``'s dtype, chosen experts (N, k)) of the tokens ``flat``."""
        logits = router_logits(flat, self.router.weight.to(flat.dtype), self.comm)  # (N, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (N, E)
        top, chosen = torch.topk(probs, self.spec.top_k, dim=-1)  # (N, k)
        if self.spec.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        self.stats.record(probs, chosen, self.spec.n_experts)
        return top.to(flat.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C/(x*y))
        flat = x.reshape(-1, x.shape[-1])  # (N, C/(x*y))
        gates, chosen = self.route(flat)  # (N, k), (N, k)
        gates = grad_sum(gates, self.comm, TP)  # each rank's outputs hold C/(x*y) of the features
        k = chosen.shape[1]
        order = torch.argsort(chosen.reshape(-1), stable=True)  # (N k,) the (token, slot) pairs by expert
        token = order // k  # (N k,)
        counts = expert_counts(chosen, self.spec.n_experts)  # (E,)
        y = self.dispatch(flat[token], counts)  # (N k, C/(x*y)) each pair's expert output
        y = y * gates.reshape(-1)[order, None]
        return torch.zeros_like(flat).index_add(0, token, y.to(flat.dtype)).view_as(x)

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The expert outputs of ``rows`` (``(M, C/(x*y))``, sorted by expert, ``counts[e]`` rows for
        expert ``e``), in their order. With expert parallelism (``G_ep`` > 1; rank ``i`` of the
        expert group, ``ep`` index ``i``, holds experts ``i*m .. (i+1)*m - 1``, ``m = E/G_ep``): the
        per-expert counts are exchanged first, the rows sent to their experts' rank, sorted there
        by local expert, multiplied, unsorted and sent back (:func:`~axo4d.dist.mappings.all_to_all`
        both ways; backward the reverse)."""
        if self.group == 1:
            return run_experts(self.experts, rows, counts)
        g, m = self.group, self.spec.n_experts // self.group
        got_counts, _ = self.comm.all_to_all(counts, "ep", [m] * g, [m] * g)  # (g m,): per source, per local expert
        got_counts = got_counts.view(g, m)
        send, recv = counts.view(g, m).sum(1).tolist(), got_counts.sum(1).tolist()
        got = all_to_all(rows, self.comm, "ep", send, recv)  # (R, C/(x*y)) by source, then local expert
        local = torch.arange(m, device=rows.device).repeat(g).repeat_interleave(got_counts.reshape(-1))  # (R,)
        by_expert = torch.argsort(local, stable=True)  # (R,)
        y = run_experts(self.experts, got[by_expert], got_counts.sum(0))  # (R, C/(x*y)) by local expert
        y = y[torch.argsort(by_expert)]  # (R, C/(x*y)) back in the received order
        return all_to_all(y, self.comm, "ep", recv, send)  # (M, C/(x*y))


class SharedExpert(nn.Module):
    """The dense SwiGLU shared expert (parts ``mlp.shared_expert.gate_up``/``.down``): a 3D pair
    like the dense MLP's, on every batch rank, in the orientation the spec gives it."""

    def __init__(self, s: ModelSpec, ctx: LayerContext) -> None:
        super().__init__()
        self.gate_up = Linear3D.from_spec(s.part("mlp.shared_expert.gate_up"), ctx)
        self.down = Linear3D.from_spec(s.part("mlp.shared_expert.down"), ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, C/(x*y))
        gu = self.gate_up(x).unflatten(-1, (-1, 2))  # (N, F_s/(x*y), 2): gate, up
        return self.down(F.silu(gu[..., 0]) * gu[..., 1])  # (N, C/(x*y))


class SharedExpertMoE(MoE):
    """An MoE layer with a gated shared expert (Qwen2-MoE): the routed experts' output plus
    ``sigmoid(x . w) * shared_expert(x)``. The gate's weight ``w (1, C)`` is placed as the router's
    (:class:`~axo4d.facts.moe_parts.SharedGateSpec`: split over x, each rank's y block of its
    features; the partial dot products summed over (x, y) by :func:`router_logits`), and its output,
    replicated over x and y, takes its gradient summed over (x, y) (:func:`grad_sum`), as each
    rank's shared-expert output holds ``C/(x*y)`` of the features."""

    def __init__(self, s: ModelSpec, ctx: LayerContext, stats: RouterStats) -> None:
        super().__init__(s, ctx, stats)
        self.shared_expert = SharedExpert(s, ctx)
        g = s.part("mlp.shared_expert_gate")
        pl = g.placements()["weight"]
        self.shared_expert_gate = nn.Module()
        w = nn.Parameter(torch.empty(pl.local_shape(ctx.grid)))
        self.shared_expert_gate.weight = place(w, pl, normal(g.init_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C/(x*y))
        routed = super().forward(x)  # (B, T, C/(x*y))
        flat = x.reshape(-1, x.shape[-1])  # (N, C/(x*y))
        logit = router_logits(flat, self.shared_expert_gate.weight.to(flat.dtype), self.comm)  # (N, 1)
        gate = grad_sum(torch.sigmoid(logit), self.comm, TP)  # (N, 1)
        return routed + (gate * self.shared_expert(flat)).view_as(x)


@eager
def run_experts(experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``experts(rows, counts)`` outside any compiled graph: how many rows each expert gets is known
    only at run time (each new split would compile again), the loop's collectives stay eager, and
    torch's grouped GEMM has no traceable fp32 form (its meta function asks for bf16)."""
    return experts(rows, counts)


def apply_experts(experts: list[Expert], rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``experts[j]`` applied to its ``counts[j]`` consecutive rows of ``rows`` (``(M, C/(x*y))``,
    sorted by expert), outputs in the same order. Every expert runs, with its rows or none, so the
    layers' collectives stay matched across ranks."""
    pieces = torch.split(rows, counts)
    return torch.cat([expert(piece) for expert, piece in zip(experts, pieces)])


class ExpertSet(nn.ModuleDict):
    """The experts a rank holds, by global index (parameters ``experts.{e}.gate_up.weight``, ...),
    called on rows sorted by local expert: one expert after the other (:func:`apply_experts`), each
    :class:`~axo4d.nn.linear.Linear3D` with its own collectives -- the way wherever the experts'
    layers are split over x, y or z, or run FP8."""

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:  # (M, C/(x*y)), (E_local,)
        return apply_experts(list(self.values()), rows, counts.tolist())

    def whole(self) -> bool:
        """Whether every expert's layers are whole on this rank and plain ``F.linear`` (x, y and z of
        one rank for them, no FP8: :attr:`~axo4d.nn.linear.Linear3D.trivial`): no collective inside."""
        return all(lin.trivial for e in self.values() for lin in (e.gate_up, e.down))


class GroupedExperts(ExpertSet):
    """The same experts (same children, same parameter names, checkpoints and Hugging Face layout)
    run as one grouped GEMM per projection (:func:`~axo4d.nn.grouped_gemm.swiglu_experts`): the
    local experts' weights stacked at every forward (``torch.stack`` of the parameters, so each
    expert's gradient flows to its own parameter), ``gate_up (E_local, C, 2F)`` and ``down
    (E_local, F, C)``, in the compute dtype. Only for experts :meth:`ExpertSet.whole` says are whole
    (:func:`axo4d.models.moe.apply_expert_gemm`); ``kernel`` 'grouped' always, 'auto' where
    :func:`~axo4d.nn.grouped_gemm.kernel_for` says this torch runs it for the rows' dtype and
    device, else the loop of :class:`ExpertSet`."""

    #: the forward reads its descendants' parameters without calling them: whoever waits for a
    #: parameter before a module's forward (the sharded optimizer's all-gathers) waits for all of them
    reads_descendants = True

    def __init__(self, experts: ExpertSet, kernel: str = "auto") -> None:
        super().__init__(experts)
        self.kernel = kernel

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:  # (M, C), (E_local,)
        dtype = compute_dtype(rows)
        x = rows.to(dtype)  # (M, C)
        if not self.grouped(x):
            return super().forward(rows, counts)
        # contiguous (E_l, K, N), the layout the probe runs (grouped_gemm._probe)
        gu = torch.stack([e.gate_up.weight.view(e.gate_up.block_shape).t() for e in self.values()])  # (E_l, C, 2F)
        dn = torch.stack([e.down.weight.view(e.down.block_shape).t() for e in self.values()])  # (E_l, F, C)
        return swiglu_experts(x, counts.to(rows.device), gu.to(dtype), dn.to(dtype), "grouped")  # (M, C)

    def grouped(self, x: torch.Tensor) -> bool:
        """Whether the grouped GEMM runs on rows ``x`` (in the compute dtype): always for 'grouped';
        for 'auto' where :func:`~axo4d.nn.grouped_gemm.kernel_for` picks it for both GEMMs."""
        e = next(iter(self.values()))
        dims = ((e.gate_up.in_features, e.gate_up.out_features), (e.down.in_features, e.down.out_features))
        return all(kernel_for(x.device, x.dtype, k, n, self.kernel) == "grouped" for k, n in dims)


__all__ = [
    "GradSum",
    "grad_sum",
    "HeadNorm",
    "RouterLogits",
    "router_logits",
    "RouterStats",
    "Expert",
    "MoE",
    "SharedExpert",
    "SharedExpertMoE",
    "apply_experts",
    "run_experts",
    "ExpertSet",
    "GroupedExperts",
]
