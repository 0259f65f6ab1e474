"""Compute time of the parts of a model on one rank: GEMMs from a measured table, attention at a
measured rate, elementwise traffic at memory bandwidth, operator launches.

**GEMMs.** ``Linear3D`` runs three local GEMMs per layer (docs/design.md section 2), with ``b``
local rows, ``k_in = K/G_in``, ``n_out = N/G_out``:

====  =========================  ==========================  =======
kind  product                    shape (M, N, K)             layout
====  =========================  ==========================  =======
fwd   ``X_blk @ W_blk^T``        ``(b, n_out, k_in)``        ``nt``
dx    ``dY @ W_blk``             ``(b, k_in, n_out)``        ``nn``
dw    ``dY^T @ X_blk``           ``(n_out, k_in, b)``        ``tn``
====  =========================  ==========================  =======

(layout: whether each operand is read as stored, ``n``, or as a transposed view, ``t``). The time
of a GEMM is ``2 M N K / rate``; the rate comes from :class:`GemmModel`:

* a *shape curve* ``rate = R * prod_d f(d) / f(8192)^3`` with ``f(d) = d / (d + d_half)``: small
  dimensions run below the large-shape rate ``R = gemm_tflops * gemm_efficiency``, a dimension of
  ``d_half`` at half speed along that dimension (``gemm_half_dim`` of the machine file; 0 = no
  shape effect);
* a *measured table* (``gemm_table``: ``perfmodel profile`` times the local shapes of the grids a
  job can use, or imports the BLAS tuner's cache, :func:`rows_from_tuner_cache`): a shape in the
  table gets its measured rate exactly; another shape gets the curve times the measured/curve ratio
  of the nearest measured shapes (inverse squared distance in ``log2`` of (M, N, K), same layout
  and dtype first), so between measured shapes the rate is interpolated and outside them it
  follows the curve's shape.

**FP8 GEMMs** (the layers ``LinearSpec.fp8`` marks): from the table's ``float8`` rows where the
machine file has measured some, else at the bf16 rate of the same shape times the machine's stated
``fp8_gemm_ratio`` (0: the machine has none). Their casts (amax and scale of each operand, the
FP8 copy, the transposed copies of the backward) are elementwise traffic (:data:`PASSES_FP8_CAST`).

**Attention** (FLOPs of :meth:`axo4d.facts.spec.AttentionSpec.gemm_flops`, no causal saving; backward
twice the forward): at the machine's measured ``attention_tflops`` (forward + backward of causal
``scaled_dot_product_attention``, softmax included), else at the GEMM rate of the ``(s, s,
head_dim)`` products with the softmax's traffic counted as elementwise (unless fused).

**Elementwise** (norms, residual adds, biases, activations, the attention scores when not fused,
cross-entropy, AdamW) bytes per part at ``memory_gbps``; **operator launches** at
``op_overhead_us`` (CPU ranks; GPU files leave it 0: launches are asynchronous there).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable

from axo4d.facts.parts import layer_pairs
from axo4d.facts.spec import AttentionSpec, CrossEntropySpec, Dtypes, LinearSpec, ModelSpec, NormSpec

REFERENCE_DIM = 8192
"""The shape ``REFERENCE_DIM^3`` runs at exactly ``gemm_tflops * gemm_efficiency`` on the curve."""
LAYOUTS = ("nn", "nt", "tn", "tt")
DTYPES = ("bfloat16", "float32", "float16", "float8")
FP8 = "float8"
"""The GEMM dtype of a layer that runs scaled FP8 GEMMs (``train.fp8``; table rows of ``torch._scaled_mm``)."""
NEIGHBOURS = 8


@dataclass(frozen=True)
class GemmPoint:
    """One measured GEMM: ``(m, k) @ (k, n)`` in ``layout`` and ``dtype`` at ``tflops``."""

    m: int
    n: int
    k: int
    layout: str
    dtype: str
    tflops: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "m": self.m,
            "n": self.n,
            "k": self.k,
            "layout": self.layout,
            "dtype": self.dtype,
            "tflops": self.tflops,
        }


def dtype_name(dt: Dtypes) -> str:
    """The GEMM dtype of a run's element sizes (2-byte activations: bf16, else fp32)."""
    return "bfloat16" if dt.act == 2 else "float32"


def linear_gemms(lin: LinearSpec, grid: Any, rows: float) -> dict[str, tuple[float, float, float, str]]:
    """The three local GEMMs of ``lin`` on ``grid`` with ``rows`` local rows (module docstring)."""
    a_in, a_out = lin.axes()
    k_in, n_out = lin.k / grid.size(a_in), lin.n / grid.size(a_out)
    return {"fwd": (rows, n_out, k_in, "nt"), "dx": (rows, k_in, n_out, "nn"), "dw": (n_out, k_in, rows, "tn")}


class GemmModel:
    """GEMM rates from the shape curve and a measured table (module docstring)."""

    def __init__(
        self, rate_flops: float, half_dim: float = 0.0, points: Iterable[GemmPoint] = (), fp8_ratio: float = 0.0
    ) -> None:
        self.rate, self.half, self.fp8_ratio = rate_flops, half_dim, fp8_ratio
        self.points = tuple(points)
        self._by: dict[tuple[str, str | None], list[tuple[tuple[float, float, float], float]]] = {}
        for p in self.points:
            key = (math.log2(p.m), math.log2(p.n), math.log2(p.k))
            ratio = p.tflops * 1e12 / self.curve(p.m, p.n, p.k)
            self._by.setdefault((p.dtype, p.layout), []).append((key, ratio))
            self._by.setdefault((p.dtype, None), []).append((key, ratio))
        self._memo: dict[tuple, float] = {}

    def curve(self, m: float, n: float, k: float) -> float:
        """FLOP/s of the shape curve alone."""
        if self.half <= 0:
            return self.rate
        f = lambda d: d / (d + self.half)
        return self.rate * f(m) * f(n) * f(k) / f(REFERENCE_DIM) ** 3

    def flops_per_s(self, m: float, n: float, k: float, layout: str = "nn", dtype: str = "bfloat16") -> float:
        """Achieved FLOP/s of one ``(m, k) @ (k, n)`` GEMM."""
        key = (round(m, 3), round(n, 3), round(k, 3), layout, dtype)
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = self._rate(m, n, k, layout, dtype)
        return v

    def _rate(self, m: float, n: float, k: float, layout: str, dtype: str) -> float:
        m, n, k = max(m, 1.0), max(n, 1.0), max(k, 1.0)
        pts = self._by.get((dtype, layout)) or self._by.get((dtype, None))
        if dtype == FP8 and not pts:  # no FP8 measured: the bf16 rate of the shape times the stated ratio
            if self.fp8_ratio <= 0:
                raise ValueError("this machine has no FP8 GEMMs (fp8_gemm_ratio 0 and no float8 gemm_table rows)")
            return self.fp8_ratio * self._rate(m, n, k, layout, "bfloat16")
        if not pts:
            return self.curve(m, n, k)
        q = (math.log2(m), math.log2(n), math.log2(k))
        near = sorted(((sum((a - b) ** 2 for a, b in zip(q, key)), ratio) for key, ratio in pts))[:NEIGHBOURS]
        if near[0][0] < 1e-12:
            return near[0][1] * self.curve(m, n, k)
        w = [1.0 / d2 for d2, _ in near]
        log_ratio = sum(wi * math.log(r) for wi, (_, r) in zip(w, near)) / sum(w)
        return math.exp(log_ratio) * self.curve(m, n, k)

    def seconds(self, m: float, n: float, k: float, layout: str = "nn", dtype: str = "bfloat16") -> float:
        """Seconds of one GEMM (0 for an empty one)."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        return 2.0 * m * n * k / self.flops_per_s(m, n, k, layout, dtype)


def fit_half_dim(points: Iterable[GemmPoint], candidates: Iterable[float] | None = None) -> tuple[float, float]:
    """The shape curve that fits measured points best in log space: ``(half_dim, rate at
    REFERENCE_DIM^3 in FLOP/s)``; the curve's scale is the geometric mean of measured/curve."""
    pts = list(points)
    if not pts:
        raise ValueError("fit_half_dim: no measured GEMMs")
    cands = list(candidates) if candidates is not None else [0.0] + [2 ** (i / 4) for i in range(0, 53)]
    best = None
    for h in cands:
        model = GemmModel(1.0, h)
        logs = [math.log(p.tflops * 1e12 / model.curve(p.m, p.n, p.k)) for p in pts]
        mean = sum(logs) / len(logs)
        err = sum((x - mean) ** 2 for x in logs)
        if best is None or err < best[0] - 1e-12:
            best = (err, h, math.exp(mean))
    return best[1], best[2]


# ---- the tuner's cache ---------------------------------------------------------------------------
def rows_from_tuner_cache(path: str | os.PathLike, device: str | None = None) -> list[GemmPoint]:
    """GEMM rates from :mod:`axo4d.nn.blas_tuner`'s JSON cache: each key ``kind|MxK@KxN|layouts|dtype|
    device`` with its chosen variant's time (``device``: keep only keys of that device name)."""
    try:
        raw = json.loads(open(path).read())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read tuner cache {str(path)!r}: {e}") from None
    out = []
    variants = ("a@b", "a@b:copy", "(bT@aT)T", "(bT@aT)T:copy")
    for key, entry in (raw.get("entries") or {}).items():
        parts = key.split("|")
        if len(parts) != 5 or (device is not None and parts[4] != device):
            continue
        try:
            a, b = parts[1].split("@")
            m, k = (int(v) for v in a.split("x"))
            _, n = (int(v) for v in b.split("x"))
            ms = entry["ms"][variants.index(entry["variant"])]
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        layout = parts[2][:2].replace("s", "n")
        if ms and ms > 0 and layout in LAYOUTS:
            out.append(GemmPoint(m, n, k, layout, parts[3], round(2 * m * n * k / (ms * 1e-3) / 1e12, 6)))
    return out


# ---- elementwise traffic and operator launches ------------------------------------------------
#: passes (reads + writes of one element) in a forward, per part; backward counts twice these
PASSES_NORM = 5  # statistics, normalise, scale (and shift)
PASSES_RESIDUAL = 3  # the residual add after a transposed layer (read two, write one)
PASSES_BIAS = 2
PASSES_FEATURES_Y = 4  # a non-transposed layer's output: bias, activation or head split
PASSES_ATTN_OUT = 2  # attention output copy into (B, T, C/y)
PASSES_SCORES = 6  # unfused attention scores: QK^T write, scale/mask, softmax, AV read
PASSES_LOSS = 12  # vocabulary-parallel cross-entropy over the logits (statistics dtype)
PASSES_OPTIM = 14  # AdamW (foreach) per parameter element, norm and clipping
PASSES_FP8_CAST = 2  # an FP8 cast of an operand: read for the amax, read again to scale and cast
OPS_BLOCK = 110  # operators launched per block, forward + backward
OPS_HEAD = 60  # head, loss and bookkeeping per micro-step
OPS_PER_PARAM = 4  # per parameter tensor in the optimizer step


def part_bytes(part: Any, spec: ModelSpec, rows: float, dt: Dtypes, in_block: bool, scores: bool) -> float:
    """Elementwise bytes of one forward of ``part`` on one rank: what lies between the GEMMs is split
    over x and y (docs/design.md section 2.1); attention over its head axes (y alone in the fallback
    of ``AttentionSpec.whole_heads``, where every x rank attends alike)."""
    g, out = spec.grid, 0.0
    tp = g.x * g.y
    if isinstance(part, NormSpec):
        return PASSES_NORM * rows * part.dim / tp * dt.act
    if isinstance(part, LinearSpec):
        if part.fp8:
            out += fp8_cast_bytes(part, g, rows, dt)
        if not in_block:
            return out  # the LM head's logits: the loss counts them
        if any(part.name == b.name for _, b in layer_pairs(spec.block)):  # a pair's second: adds into the residual
            return out + (PASSES_RESIDUAL + PASSES_BIAS * part.bias) * rows * part.n / tp * dt.act
        return out + PASSES_FEATURES_Y * rows * part.n / tp * dt.act
    if isinstance(part, AttentionSpec):
        heads = g.size(*part.head_axes(g))
        out = PASSES_ATTN_OUT * rows * part.n_head * part.head_dim / heads
        if scores:
            out += PASSES_SCORES * rows * part.seq_len * part.n_head / heads
        return out * dt.act
    if isinstance(part, CrossEntropySpec):
        return PASSES_LOSS * rows * spec.vocab / tp * dt.stat
    return 0.0


def fp8_cast_bytes(lin: LinearSpec, grid: Any, rows: float, dt: Dtypes) -> float:
    """Elementwise bytes of one forward's FP8 casts of ``lin`` (its X and weight piece; the
    backward's, dY, the block again and the transposed copies, count twice these as every part's
    backward does): each operand read :data:`PASSES_FP8_CAST` times and written once in FP8."""
    a_in, a_out = lin.axes()
    x = rows * lin.k / grid.size(a_in)
    w = lin.weight_block(grid) / grid.z
    return x * (PASSES_FP8_CAST * dt.act + 1) + w * (PASSES_FP8_CAST * dt.param_state + 1)


def optimizer_bytes(spec: ModelSpec, dt: Dtypes) -> float:
    """AdamW traffic of one step on one rank."""
    pc = spec.local_params()
    return PASSES_OPTIM * (pc["linear"] + pc["other"]) * dt.param_state


def step_ops(spec: ModelSpec) -> int:
    """Operators of the optimizer step (per parameter tensor)."""
    per_block = sum(len(p.placements()) for p in spec.block)
    rest = sum(len(p.placements()) for p in spec.embeddings + spec.head)
    return (spec.n_layer * per_block + rest) * OPS_PER_PARAM


__all__ = [
    "GemmPoint",
    "GemmModel",
    "fit_half_dim",
    "rows_from_tuner_cache",
    "linear_gemms",
    "part_bytes",
    "optimizer_bytes",
    "step_ops",
    "dtype_name",
    "fp8_cast_bytes",
    "REFERENCE_DIM",
    "FP8",
]
