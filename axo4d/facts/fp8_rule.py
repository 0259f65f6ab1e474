"""Which linear layers run FP8 GEMMs (``train.fp8``, ``train.fp8_layers``): one rule, read by the
models (through :class:`axo4d.nn.fp8_plan.Fp8Plan`) and the performance model alike. No torch here.

``fp8_layers``:

* ``auto`` (default): the blocks' layers whose *local* GEMM pays in FP8, by torchao's thresholds
  measured on H100 for its recipes, applied to the shape one rank multiplies, ``K/G_in x N/G_out``
  (a layer that pays on one GPU can be split below them on a grid):
  tensorwise: FP8 unless ``K <= 4096 and N <= 1024``; rowwise: FP8 unless ``N <= 2048``, or
  ``K <= 1024``, or ``N <= 4096 and K <= 2048``. The LM head stays in the compute dtype: its GEMM
  would pay (the largest of a small model), but its logits feed the loss directly, and every
  recipe we know (Transformer Engine's, torchtitan's) keeps it out.
  An expert of an MoE layer (``mlp.experts.{e}.*``) multiplies only the rows routed to it; when
  the rows are known (``rows``: a rank's local rows per micro-step) it takes FP8 under ``auto``
  only if its ``(K, N)`` pay as above *and* its routed rows ``m = rows * k * G_ep / E`` (balanced
  routing: the ``G_ep`` ranks of an expert group send ``k * rows`` (token, slot) pairs each to
  ``E`` experts, ``E/G_ep`` of them on each rank) reach :data:`EXPERT_MIN_ROWS`. Why a row
  bound: the thresholds above were set for dense layers, whose rows are many; an expert's weight
  is cast to FP8 every micro-step however few rows it multiplies (tensorwise: read for its amax,
  read again and written cast, and a transposed copy for backward: about 6 bytes per element),
  while FP8 saves half of its three GEMMs' time (forward, input and weight gradients:
  ``3 * 2*m*K*N`` FLOPs at the bf16 peak ``P``, FP8's peak twice it), ``3*m*K*N/P``. The saving
  beats the weight's cast (``6*K*N/BW``) when ``m > 2*P/BW``: 591 rows on an H100 SXM
  (989 TFLOP/s dense bf16, 3.35 TB/s). A model, not a measurement, like the thresholds it adds to;
* ``blocks``: every linear layer of the blocks, whatever its shape;
* ``all``: the blocks' layers and the LM head.

A layer that runs FP8 must have every dimension of its three local GEMMs a multiple of 16 (the
GPU kernels'; enforced on the CPU too): ``K/G_in``, ``N/G_out`` and the rows
``micro-batch/(G_data*G_z) * seq_len``; :func:`shape_problems` says which do not.
"""

from __future__ import annotations

import dataclasses
import math

from axo4d.facts.moe_parts import router_of
from axo4d.facts.spec import LinearSpec, ModelSpec

RECIPES = ("tensorwise", "rowwise")
LAYER_RULES = ("auto", "blocks", "all")
MULTIPLE = 16
#: routed rows per micro-step an expert needs for its FP8 GEMMs to pay (module docstring): 2 * P / BW
EXPERT_MIN_ROWS = math.ceil(2 * 989e12 / 3.35e12)
EXPERT_PREFIX = "mlp.experts."


def local_kn(lin: LinearSpec, spec: ModelSpec) -> tuple[int, int]:
    """``(K/G_in, N/G_out)`` of ``lin``'s local GEMMs on ``spec``'s grid."""
    a_in, a_out = lin.axes()
    return lin.k // spec.grid.size(a_in), lin.n // spec.grid.size(a_out)


def pays(recipe: str, k: int, n: int) -> bool:
    """torchao's thresholds (module docstring) for a local GEMM ``(M, k) @ (k, n)``."""
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def expert_rows(spec: ModelSpec, rows: float, g_ep: int = 1) -> float:
    """Rows one expert multiplies per micro-step with balanced routing: ``rows * k * G_ep / E``
    (``rows``: a rank's local rows; a rank's ``E/G_ep`` experts take ``k * rows`` (token, slot)
    pairs); ``rows`` itself for a dense model."""
    r = router_of(spec.block)
    return rows * r.top_k * g_ep / r.n_experts if r else rows


def expert_pays(spec: ModelSpec, recipe: str, lin: LinearSpec, rows: float | None, g_ep: int = 1) -> bool:
    """Whether ``lin`` passes the rule's row bound: not an expert, rows unknown, or its routed rows
    reach :data:`EXPERT_MIN_ROWS`."""
    if rows is None or not lin.name.startswith(EXPERT_PREFIX):
        return True
    return expert_rows(spec, rows, g_ep) >= EXPERT_MIN_ROWS


def fp8_layer_names(
    spec: ModelSpec, recipe: str, layers: str = "auto", rows: float | None = None, g_ep: int = 1
) -> tuple[str, ...]:
    """Names of the linear layers (block layers by their name in every block, ``lm_head``) that run
    ``recipe`` under the rule ``layers`` (module docstring); () when ``recipe`` is 'off'. ``rows``
    (a rank's rows per micro-step) and ``g_ep`` (the expert group) decide the experts under
    ``auto``; without ``rows`` experts are judged by their shape alone."""
    if recipe in ("", "off"):
        return ()
    if recipe not in RECIPES:
        raise ValueError(f"train.fp8={recipe!r}; valid: off, {', '.join(RECIPES)}")
    if layers not in LAYER_RULES:
        raise ValueError(f"train.fp8_layers={layers!r}; valid: {', '.join(LAYER_RULES)}")
    auto = layers == "auto"
    block = [
        x
        for x in spec.linears()
        if not auto or (pays(recipe, *local_kn(x, spec)) and expert_pays(spec, recipe, x, rows, g_ep))
    ]
    head = [spec.head_linear()] if layers == "all" else []
    return tuple(x.name for x in block + head)


def with_fp8(spec: ModelSpec, recipe: str, layers: str = "auto") -> ModelSpec:
    """``spec`` with its FP8 layers marked (``LinearSpec.fp8``): what they gather and reduce."""
    return mark_fp8(spec, recipe, fp8_layer_names(spec, recipe, layers))


def mark_fp8(spec: ModelSpec, recipe: str, layers: tuple[str, ...] | list[str]) -> ModelSpec:
    """``spec`` with the linear layers named in ``layers`` marked as running ``recipe``."""
    names = set(layers)
    if not names:
        return spec
    mark = lambda parts: tuple(
        dataclasses.replace(p, fp8=recipe) if isinstance(p, LinearSpec) and p.name in names else p for p in parts
    )
    return dataclasses.replace(spec, block=mark(spec.block), head=mark(spec.head))


def shape_problems(spec: ModelSpec, recipe: str, layers: str, rows: int) -> list[str]:
    """Why the FP8 layers cannot run on ``spec``'s grid with ``rows`` local rows per micro-step
    (dimensions not multiples of 16), one line each naming the setting and what would work."""
    out = []
    g = spec.grid
    if rows % MULTIPLE and fp8_layer_names(spec, recipe, layers):
        out.append(
            f"train.fp8={recipe}: {rows} rows per rank and micro-step (micro-batch/(G_data*G_z) * seq_len) "
            f"is not a multiple of {MULTIPLE}, which FP8 GEMMs need; change train.global_batch, "
            "train.grad_accum or model.seq_len, or set train.fp8=off"
        )
    for name in fp8_layer_names(spec, recipe, layers):
        lin = spec.part(name)
        a_in, a_out = lin.axes()
        k, n = local_kn(lin, spec)
        bad = [
            f"{what} {v} (= {full}/G_{ax})"
            for what, v, full, ax in (("K", k, lin.k, a_in), ("N", n, lin.n, a_out))
            if v % MULTIPLE
        ]
        if bad:
            hint = ", train.fp8_layers=blocks (the head in bf16)" if name == spec.head_linear().name else ""
            out.append(
                f"train.fp8={recipe}: layer {name} multiplies {' and '.join(bad)} per rank on grid {g.spec()}, "
                f"not a multiple of {MULTIPLE} as FP8 GEMMs need; choose shapes or a grid where it is{hint}, "
                "or set train.fp8=off"
            )
    return out


__all__ = [
    "RECIPES",
    "LAYER_RULES",
    "EXPERT_MIN_ROWS",
    "pays",
    "local_kn",
    "expert_rows",
    "expert_pays",
    "fp8_layer_names",
    "with_fp8",
    "mark_fp8",
    "shape_problems",
]
