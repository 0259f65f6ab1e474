"""Per-layer costs of the 3D-parallel GPT on one grid: collectives, FLOPs, memory.

Everything here is per rank and per training step (one forward and one
backward over the rank's local rows ``b = B*s/(G_data*G_z)``), and for one
transformer block unless the record says otherwise; :mod:`perfmodel.model`
multiplies block records by the number of layers, so the work per grid does
not grow with depth.

Layout (DESIGN.md section 2): a block is QKV (non-transposed, K=h, N=3h),
attention (heads over y, replicated over x), out-proj (transposed, K=h, N=h),
MLP up (non-transposed, K=h, N=ffn), MLP down (transposed, K=ffn, N=h), and two
LayerNorms over the residual stream (features over x). After the blocks: final
LayerNorm, LM head (non-transposed, K=h, N=V padded to vocab_multiple*G_y),
vocabulary-parallel cross-entropy. Embeddings (token table of the *unpadded*
vocabulary, position table): hidden over x, no collective in the step itself.
Bookkeeping (:func:`bookkeeping_colls`): the reported loss, all-reduced over
``(data, z)``, and one fp64 scalar per distinct set of axes parameters are
split on, for the global gradient norm (as ``axo4d.grads`` does it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from axo4d.config import ModelConfig
from axo4d.grid import Grid

from .collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of what moves and what is stored.

    Defaults: bf16 activations and gathered weights; gradients reduced in
    fp32; LayerNorm / cross-entropy statistics in fp32; training state of
    16 bytes per parameter (fp32 parameters as autocast keeps them, fp32
    gradients, two fp32 Adam moments; the bf16 copy of a weight only exists
    transiently as the gathered block, counted under ``buffers``).
    """

    act: int = 2
    weight: int = 2
    grad: int = 4
    stat: int = 4
    param_state: int = 4
    grad_state: int = 4
    optim_state: int = 8
    scalar: int = 8

    @classmethod
    def for_compute(cls, dtype: str) -> "Dtypes":
        """Element sizes for the trainer's ``train.dtype``: ``'bf16'`` (the
        default above: autocast on GPU) or ``'fp32'`` (CPU runs: activations
        and gathered weights move in fp32)."""
        if dtype == "bf16":
            return cls()
        if dtype == "fp32":
            return cls(act=4, weight=4)
        raise ValueError(f"unknown compute dtype {dtype!r}; valid: bf16, fp32")


@dataclass(frozen=True)
class Linear:
    """A 3D-parallel linear layer ``Y = X W^T``, ``W: (n, k)``."""

    name: str
    k: int
    n: int
    transposed: bool

    def axes(self) -> tuple[str, str]:
        """(axis splitting input features, axis splitting output features)."""
        return ("y", "x") if self.transposed else ("x", "y")


@dataclass(frozen=True)
class Coll:
    """One collective of the step (per call sizes, calls per step per layer).

    ``nbytes`` follows :func:`perfmodel.collectives.counted_bytes`; ``pool``
    says what it can overlap with: ``'blocking'`` (nothing), ``'fwd'``
    (forward compute), ``'bwd'`` (backward compute), ``'dx'`` (the dW GEMM
    of ``layer``; also backward compute).
    """

    layer: str
    phase: str
    axes: tuple[str, ...]
    kind: str
    nbytes: float
    calls: int
    pool: str
    per_block: bool = True


def padded_vocab(model: ModelConfig, grid: Grid) -> int:
    """Vocabulary padded up to a multiple of ``vocab_multiple * G_y``."""
    m = model.vocab_multiple * grid.y
    return -(-model.vocab_size // m) * m


def block_linears(model: ModelConfig) -> tuple[Linear, ...]:
    h, f = model.n_embd, model.ffn_mult * model.n_embd
    return (Linear("qkv", h, 3 * h, False), Linear("attn_out", h, h, True),
            Linear("mlp_up", h, f, False), Linear("mlp_down", f, h, True))


def head_linear(model: ModelConfig, grid: Grid) -> Linear:
    return Linear("lm_head", model.n_embd, padded_vocab(model, grid), False)


def local_rows(model: ModelConfig, grid: Grid, global_batch: int) -> float:
    """Rows (tokens) of X on one rank: ``B*s/(G_data*G_z)``."""
    return global_batch * model.seq_len / grid.size("data", "z")


def weight_block(lin: Linear, grid: Grid) -> float:
    """Elements of the gathered weight block ``N*K/(G_x*G_y)``."""
    return lin.n * lin.k / (grid.x * grid.y)


# ---- collectives ---------------------------------------------------------------
def linear_colls(lin: Linear, grid: Grid, b: float, dt: Dtypes, recompute: bool,
                 per_block: bool = True) -> list[Coll]:
    """Collectives of one linear layer (tensor-parallel part; no data parallel)."""
    ax_in, ax_out = lin.axes()
    g = grid.sizes
    wblk = weight_block(lin, grid)
    y_fwd = b * lin.n / g[ax_out] * dt.act        # partial Y summed over the input axis
    dx_bwd = b * lin.k / g[ax_in] * dt.act        # partial dX summed over the output axis
    out = [Coll(lin.name, "fwd", ("z",), ALL_GATHER, wblk * dt.weight, 1, "fwd", per_block),
           Coll(lin.name, "fwd", (ax_in,), ALL_REDUCE, y_fwd, 1, "blocking", per_block),
           Coll(lin.name, "bwd", ("z",), ALL_GATHER, wblk * dt.weight, 1, "bwd", per_block),
           Coll(lin.name, "bwd", (ax_out,), ALL_REDUCE, dx_bwd, 1, "dx", per_block),
           Coll(lin.name, "bwd", ("z",), REDUCE_SCATTER, wblk * dt.grad, 1, "bwd", per_block)]
    if recompute:
        out += [Coll(lin.name, "recompute", ("z",), ALL_GATHER, wblk * dt.weight, 1, "bwd", per_block),
                Coll(lin.name, "recompute", (ax_in,), ALL_REDUCE, y_fwd, 1, "blocking", per_block)]
    return out


def block_colls(model: ModelConfig, grid: Grid, b: float, dt: Dtypes, recompute: bool) -> list[Coll]:
    """All collectives of one transformer block (tensor-parallel axes only)."""
    out: list[Coll] = []
    for lin in block_linears(model):
        out += linear_colls(lin, grid, b, dt, recompute)
    stats = 2 * b * dt.stat  # sum and sum of squares per local row
    for ln in ("ln1", "ln2"):
        out.append(Coll(ln, "fwd", ("x",), ALL_REDUCE, stats, 1, "blocking"))
        out.append(Coll(ln, "bwd", ("x",), ALL_REDUCE, stats, 1, "blocking"))
        if recompute:
            out.append(Coll(ln, "recompute", ("x",), ALL_REDUCE, stats, 1, "blocking"))
    return out


def head_colls(model: ModelConfig, grid: Grid, b: float, dt: Dtypes) -> list[Coll]:
    """Final LayerNorm, LM head and vocabulary-parallel cross-entropy (never recomputed)."""
    stats = 2 * b * dt.stat
    out = [Coll("ln_f", "fwd", ("x",), ALL_REDUCE, stats, 1, "blocking", False),
           Coll("ln_f", "bwd", ("x",), ALL_REDUCE, stats, 1, "blocking", False)]
    out += linear_colls(head_linear(model, grid), grid, b, dt, recompute=False, per_block=False)
    out += [Coll("cross_entropy", "fwd", ("y",), ALL_REDUCE, b * dt.stat, 1, "blocking", False),
            Coll("cross_entropy", "fwd", ("y",), ALL_REDUCE, 2 * b * dt.stat, 1, "blocking", False)]
    return out


def param_counts(model: ModelConfig, grid: Grid) -> dict[str, float]:
    """Parameters held by one rank: ``linear`` (z-sharded weight pieces) and
    ``other`` (LayerNorms, biases, embeddings: replicated over data and z)."""
    h, gx, gz = model.n_embd, grid.x, grid.z
    lins = block_linears(model)
    head = head_linear(model, grid)
    linear = model.n_layer * sum(weight_block(l, grid) for l in lins) / gz + weight_block(head, grid) / gz
    per_block = 0.0
    if model.bias:
        per_block += 4 * h / gx                                   # two LayerNorms, weight + bias
        per_block += sum(l.n / grid.sizes[l.axes()[1]] for l in lins)  # biases live with output features
        final_ln = 2 * h / gx
    else:
        per_block += 2 * h / gx
        final_ln = h / gx
    embed = (model.vocab_size + model.seq_len) * h / gx           # token (unpadded) + position tables
    return {"linear": linear, "other": model.n_layer * per_block + final_ln + embed}


def dp_colls(model: ModelConfig, grid: Grid, dt: Dtypes, bucket_bytes: float) -> list[Coll]:
    """Data-parallel gradient reductions: weight pieces over ``data``, the
    rest over ``(data, z)``; bucketed (calls = buckets, for latency)."""
    p = param_counts(model, grid)
    out = []
    for key, axes in (("linear", ("data",)), ("other", ("data", "z"))):
        n = p[key] * dt.grad
        buckets = max(1, math.ceil(n / bucket_bytes))
        out.append(Coll(f"grads_{key}", "bwd", axes, ALL_REDUCE, n / buckets, buckets, "bwd", False))
    return out


def norm_split_axes(model: ModelConfig) -> tuple[tuple[str, ...], ...]:
    """Distinct ``split`` axes of the parameters (``axo4d.sharding``): linear
    weight pieces over (x, y, z); LayerNorms, embeddings and the biases of
    transposed layers over x; biases of non-transposed layers over y."""
    return (("x", "y", "z"), ("x",)) + ((("y",),) if model.bias else ())


def bookkeeping_colls(model: ModelConfig, dt: Dtypes) -> list[Coll]:
    """Scalar all-reduces of a step: the global gradient norm (one fp64 sum of
    squares per distinct split-axes set) and the reported loss over (data, z)."""
    out = [Coll("grad_norm", "step", axes, ALL_REDUCE, dt.scalar, 1, "blocking", False)
           for axes in norm_split_axes(model)]
    out.append(Coll("loss", "step", ("data", "z"), ALL_REDUCE, dt.scalar, 1, "blocking", False))
    return out


# ---- compute -------------------------------------------------------------------
def gemm_flops(lin: Linear, grid: Grid, b: float) -> float:
    """FLOPs of one local GEMM of ``lin`` (forward, or dX, or dW)."""
    return 2.0 * b * lin.k * lin.n / (grid.x * grid.y)


def attention_flops(model: ModelConfig, grid: Grid, b: float) -> float:
    """Forward FLOPs of local attention (QK^T and AV, no causal saving): heads
    over y, replicated over x, so each rank does ``4*b*s*h/G_y`` -- G_x times
    its share of the model's ``4*s*h`` per token."""
    return 4.0 * b * model.seq_len * model.n_embd / grid.y


#: Elementwise passes (reads + writes of one element) per forward; backward ~2x.
#: Residual stream (split over x): two LayerNorms ~5 each, two residual adds 3 each,
#: the biases of the two transposed layers 2 each.
PASSES_X = 20
#: Feature-split over y: QKV output (bias, head split copy) 4 x 3h, attention output copy 2 x h,
#: MLP-up output (bias, GELU) 4 x 4h: per row, in units of h.
PASSES_Y_H = 4 * 3 + 2 + 4 * 4
#: Attention scores (b x s per local head): QK^T write, scale/mask, softmax read+write, AV read.
PASSES_SCORES = 6
#: AdamW (foreach) per parameter: p, grad, two moments read and written, temporaries; norm, clip.
PASSES_OPTIM = 14
#: Operators launched per block (forward + backward) and for head, loss and bookkeeping.
OPS_BLOCK = 110
OPS_HEAD = 60
#: Operators per parameter tensor in the step (gradient norm, clipping, foreach optimizer share).
OPS_PER_PARAM = 4


def elementwise_bytes(model: ModelConfig, grid: Grid, b: float, dt: Dtypes) -> dict[str, float]:
    """Bytes of non-GEMM traffic per rank: ``blocks`` and ``head`` per micro-step (forward
    and backward), ``optimizer`` per step. Tensors replicated over x (split over y only)
    are processed by every x-rank: that redundancy is why it matters."""
    h, s, a = model.n_embd, model.seq_len, model.n_head
    fwd = b * (PASSES_X * h / grid.x + PASSES_Y_H * h / grid.y + PASSES_SCORES * s * a / grid.y) * dt.act
    head = b * (5 * h / grid.x * dt.act + 12 * padded_vocab(model, grid) / grid.y * dt.stat)
    pc = param_counts(model, grid)
    return {"blocks": 3 * model.n_layer * fwd, "head": 3 * head,
            "optimizer": PASSES_OPTIM * (pc["linear"] + pc["other"]) * dt.param_state}


def op_count(model: ModelConfig) -> tuple[int, int]:
    """Operators launched per micro-step and per optimizer step (grid-independent estimate)."""
    tensors = model.n_layer * (12 if model.bias else 8) + (5 if model.bias else 4)
    return model.n_layer * OPS_BLOCK + OPS_HEAD, tensors * OPS_PER_PARAM


# ---- memory --------------------------------------------------------------------
def block_activation_bytes(model: ModelConfig, grid: Grid, b: float, flash: bool) -> float:
    """Activation bytes one block keeps for backward (Korthikanti et al. 2022).

    Their ``s*b*h*(34 + 5*a*s/h)`` bytes per layer, placed on this layout
    (``b`` local rows): LayerNorm inputs 4, QKV input 2, out-proj dropout mask
    1, MLP-up input 2, MLP dropout mask 1 -- 10 bytes/element on tensors split
    over x (``h/G_x``); Q, K 4, V 2, out-proj input 2, GELU input 8, MLP-down
    input 8 -- 24 bytes/element split over y; the ``5*a*s`` bytes per token of
    softmax output, its dropout mask and output per local head (``a/G_y``).
    With ``flash`` (fused attention) the score terms become 4 bytes per head
    and token (the log-sum-exp).
    """
    h, a, s = model.n_embd, model.n_head, model.seq_len
    x_part = 10 * b * h / grid.x
    y_part = 24 * b * h / grid.y
    scores = (4 * b * a if flash else 5 * b * a * s) / grid.y
    return x_part + y_part + scores


def head_activation_bytes(model: ModelConfig, grid: Grid, b: float, dt: Dtypes) -> float:
    """Final LayerNorm and LM-head inputs (activation dtype, split over x) and
    the logits kept for the softmax backward (statistics dtype, fp32; split over y)."""
    return 2 * dt.act * b * model.n_embd / grid.x + dt.stat * b * padded_vocab(model, grid) / grid.y


def checkpoint_bytes(model: ModelConfig, grid: Grid, b: float, dt: Dtypes) -> float:
    """A checkpointed block keeps only its input (residual stream, over x)."""
    return dt.act * b * model.n_embd / grid.x


def divisibility_reasons(model: ModelConfig, grid: Grid, global_batch: int) -> list[str]:
    """Why the layout cannot be built on ``grid`` ('' reasons list if it can)."""
    h, f = model.n_embd, model.ffn_mult * model.n_embd
    out = []
    if model.n_head % grid.y:
        out.append(f"G_y={grid.y} does not divide heads={model.n_head}")
    for name, v in (("hidden", h), ("ffn", f)):
        for ax in ("x", "y"):
            if v % grid.sizes[ax]:
                out.append(f"G_{ax}={grid.sizes[ax]} does not divide {name}={v}")
    dz = grid.size("data", "z")
    if global_batch % dz:
        out.append(f"batch={global_batch} not divisible by data*z={dz}")
    if not out:
        for lin in block_linears(model) + (head_linear(model, grid),):
            wblk = weight_block(lin, grid)
            if wblk % grid.z:
                out.append(f"{lin.name} weight block ({int(wblk)} elements) not divisible by G_z={grid.z}")
    return out
