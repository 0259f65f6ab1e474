"""Many small expert GEMMs as one grouped GEMM (docs/design.md section 16).

The tokens a rank's ``E_local`` experts multiply arrive sorted by expert: rows
``offsets[e-1]:offsets[e]`` of ``x (N, K)`` go to expert ``e``, ``counts (E_local,)`` rows each
(zero allowed). :func:`grouped_matmul` multiplies each group by its expert's ``(K, M)`` weight;
:func:`swiglu_experts` runs the SwiGLU expert set (gate|up, silu(gate) * up, down) on them.

Two kernels, one result: ``torch._grouped_mm`` (one call for every expert; on CPU too in torch
2.13, for float32, bfloat16 and float16) where this torch has it for the dtype and device, else a
loop of one ``matmul`` per expert. :func:`grouped_mm_supported` probes once per (device type,
dtype) and caches the answer; ``bench/moe_gemm.py`` times both. The grouped kernel runs inside
:class:`GroupedMM` (forward: one grouped GEMM; backward: two -- ``dx = g @ w^T`` per group, and
``dw = x^T g`` per group): torch's own backward of ``_grouped_mm`` rejects a gradient with zero
strides (the gradient of a ``sum``), so the gradient is made contiguous first.

Weights are stacked ``(E_local, K, M)``: the layout ``_grouped_mm`` multiplies. On the grid these
are the local blocks of each expert's 3D layer (``K = C/(x*y)`` style local widths); the
collectives between the GEMMs (the all-reduce over x after gate|up, over y after down) are the
caller's, passed as ``between``/``after`` functions, so this module holds no communication.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_SUPPORTED: dict[tuple[str, torch.dtype], bool] = {}
KERNELS = ("auto", "grouped", "loop")


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """End row of every group: ``cumsum(counts)`` as int32 (what ``_grouped_mm`` takes)."""
    return torch.cumsum(counts.to(torch.int64), 0).to(torch.int32)


def grouped_mm_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward for ``dtype`` on ``device``'s type
    and matches a loop of matmuls (probed once on a tiny problem with an empty group, cached)."""
    key = (torch.device(device).type, dtype)
    if key not in _SUPPORTED:
        _SUPPORTED[key] = _probe(torch.device(device), dtype)
    return _SUPPORTED[key]


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(24, 16, generator=gen).to(device, dtype)  # (N, K)
        w = torch.randn(3, 16, 16, generator=gen).to(device, dtype)  # (E, K, M)
        counts = torch.tensor([8, 0, 16], device=device)
        g = torch.randn(24, 16, generator=gen).to(device, dtype)
        y, dx, dw = _grouped_fwd_bwd(x, w, counts, g)
        ry = _loop(x, counts, w)
        rdx = _loop(g, counts, w.transpose(-2, -1))
        ok = all(torch.allclose(a.float(), b.float(), atol=0.1, rtol=0.05) for a, b in ((y, ry), (dx, rdx)))
        return ok and bool(dw[1].abs().max() == 0) and dw.shape == w.shape
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _grouped_fwd_bwd(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, g: torch.Tensor) -> tuple:
    offs = _offsets(counts)
    y = torch._grouped_mm(x, w, offs=offs)
    dx = torch._grouped_mm(g, w.transpose(-2, -1), offs=offs)
    dw = torch._grouped_mm(x.t(), g, offs=offs)
    return y, dx, dw


class GroupedMM(torch.autograd.Function):
    """forward: ``y[group e] = x[group e] @ w[e]`` in one grouped GEMM; backward: ``dx[group e] =
    g[group e] @ w[e]^T`` and ``dw[e] = x[group e]^T g[group e]`` (zero for an empty group), two
    grouped GEMMs. No communication."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)  # (N, M)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w, offs = ctx.saved_tensors
        g = g.contiguous()
        dx = torch._grouped_mm(g, w.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0] else None
        dw = torch._grouped_mm(x.t(), g, offs=offs) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def _loop(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """One matmul per expert (an empty group gives no rows, and its weight a zero gradient)."""
    parts = torch.split(x, [int(c) for c in counts.tolist()])
    return torch.cat([p @ w[e] for e, p in enumerate(parts)])  # (N, M)


def kernel_for(device: torch.device, dtype: torch.dtype, k: int, n: int, kernel: str = "auto") -> str:
    """'grouped' or 'loop' for a grouped GEMM of rows ``k`` wide by ``(k, n)`` weights: ``kernel``
    itself, or for 'auto' the grouped GEMM where :func:`grouped_mm_supported` says this torch runs
    it for ``device`` and ``dtype`` and (off the CPU) ``k`` and ``n`` are whole 16-byte units, as
    the GPU kernels need."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; valid: {', '.join(KERNELS)}")
    if kernel != "auto":
        return kernel
    size = torch.empty((), dtype=dtype).element_size()
    aligned = device.type == "cpu" or all((d * size) % 16 == 0 for d in (k, n))
    return "grouped" if aligned and grouped_mm_supported(device, dtype) else "loop"


def pick_kernel(x: torch.Tensor, w: torch.Tensor, kernel: str = "auto") -> str:
    """:func:`kernel_for` rows ``x (N, K)`` and weights ``w (E, K, M)``."""
    return kernel_for(x.device, x.dtype, x.shape[1], w.shape[-1], kernel)


def grouped_matmul(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, kernel: str = "auto") -> torch.Tensor:
    """``x (N, K)`` sorted by group, ``counts (E,)`` rows per group summing to N, ``w (E, K, M)``:
    ``(N, M)``, every group by its own weight. ``kernel``: 'auto', 'grouped' or 'loop'."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or counts.shape != (w.shape[0],):
        raise ValueError(f"grouped_matmul: x {tuple(x.shape)}, counts {tuple(counts.shape)}, w {tuple(w.shape)}")
    if pick_kernel(x, w, kernel) == "grouped":
        return GroupedMM.apply(x, w, _offsets(counts))
    return _loop(x, counts, w)


def swiglu_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    kernel: str = "auto",
    between: Callable[[torch.Tensor], torch.Tensor] | None = None,
    after: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``E`` SwiGLU experts on tokens sorted by expert: ``x (N, C)``, ``counts (E,)``,
    ``gate_up (E, C, 2F)`` (columns interleaved gate/up per feature, as the experts' ``gate_up``
    layers), ``down (E, F, C)``: ``down_e(silu(gate_e x) * up_e x)`` for each token's expert,
    ``(N, C)``. ``between`` (on the ``(N, 2F)`` gate|up output) and ``after`` (on the output) are
    the caller's collectives on a grid; identity by default."""
    gu = grouped_matmul(x, counts, gate_up, kernel)  # (N, 2F)
    gu = (between(gu) if between else gu).unflatten(-1, (-1, 2))  # (N, F, 2): gate, up
    y = grouped_matmul(F.silu(gu[..., 0]) * gu[..., 1], counts, down, kernel)  # (N, C)
    return after(y) if after else y


def swiglu_flops(n_rows: int, c: int, f: int) -> float:
    """FLOPs of one forward of a SwiGLU expert set on ``n_rows`` routed rows (gate, up and down:
    three ``C x F`` GEMMs): ``2 * n_rows * C * F * 3``."""
    return 2.0 * n_rows * c * f * 3


__all__ = [
    "KERNELS",
    "GroupedMM",
    "grouped_mm_supported",
    "pick_kernel",
    "kernel_for",
    "grouped_matmul",
    "swiglu_experts",
    "swiglu_flops",
]
