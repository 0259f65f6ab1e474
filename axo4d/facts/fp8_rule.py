"""Which linear layers run FP8 GEMMs (``train.fp8``, ``train.fp8_layers``): one rule, read by the
models (through :class:`axo4d.nn.fp8.Fp8Plan`) and the performance model alike. No torch here.

``fp8_layers``:

* ``auto`` (default): the blocks' layers whose *local* GEMM pays in FP8, by torchao's thresholds
  measured on H100 for its recipes, applied to the shape one rank multiplies, ``K/G_in x N/G_out``
  (a layer that pays on one GPU can be split below them on a grid):
  tensorwise: FP8 unless ``K <= 4096 and N <= 1024``; rowwise: FP8 unless ``N <= 2048``, or
  ``K <= 1024``, or ``N <= 4096 and K <= 2048``. The LM head stays in the compute dtype: its GEMM
  would pay (the largest of a small model), but its logits feed the loss directly, and every
  recipe we know (Transformer Engine's, torchtitan's) keeps it out;
* ``blocks``: every linear layer of the blocks, whatever its shape;
* ``all``: the blocks' layers and the LM head.

A layer that runs FP8 must have every dimension of its three local GEMMs a multiple of 16 (the
GPU kernels'; enforced on the CPU too): ``K/G_in``, ``N/G_out`` and the rows
``micro-batch/(G_data*G_z) * seq_len``; :func:`shape_problems` says which do not.
"""

from __future__ import annotations

import dataclasses

from axo4d.facts.spec import LinearSpec, ModelSpec

RECIPES = ("tensorwise", "rowwise")
LAYER_RULES = ("auto", "blocks", "all")
MULTIPLE = 16


def local_kn(lin: LinearSpec, spec: ModelSpec) -> tuple[int, int]:
    """``(K/G_in, N/G_out)`` of ``lin``'s local GEMMs on ``spec``'s grid."""
    a_in, a_out = lin.axes()
    return lin.k // spec.grid.size(a_in), lin.n // spec.grid.size(a_out)


def pays(recipe: str, k: int, n: int) -> bool:
    """torchao's thresholds (module docstring) for a local GEMM ``(M, k) @ (k, n)``."""
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def fp8_layer_names(spec: ModelSpec, recipe: str, layers: str = "auto") -> tuple[str, ...]:
    """Names of the linear layers (block layers by their name in every block, ``lm_head``) that run
    ``recipe`` under the rule ``layers`` (module docstring); () when ``recipe`` is 'off'."""
    if recipe in ("", "off"):
        return ()
    if recipe not in RECIPES:
        raise ValueError(f"train.fp8={recipe!r}; valid: off, {', '.join(RECIPES)}")
    if layers not in LAYER_RULES:
        raise ValueError(f"train.fp8_layers={layers!r}; valid: {', '.join(LAYER_RULES)}")
    block = [x for x in spec.linears() if layers != "auto" or pays(recipe, *local_kn(x, spec))]
    head = [spec.head_linear()] if layers == "all" else []
    return tuple(x.name for x in block + head)


def with_fp8(spec: ModelSpec, recipe: str, layers: str = "auto") -> ModelSpec:
    """``spec`` with its FP8 layers marked (``LinearSpec.fp8``): what they gather and reduce."""
    names = set(fp8_layer_names(spec, recipe, layers))
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


__all__ = ["RECIPES", "LAYER_RULES", "pays", "local_kn", "fp8_layer_names", "with_fp8", "shape_problems"]
