"""Memory per rank of a training step, term by term: the device at its peak and host memory
(docs/design.md sections 4 and 9).

Read from the model's parts on a grid (:class:`axo4d.facts.spec.ModelSpec`: placements, linear layers,
attention), so every architecture the spec describes is priced without an edit here. ``b`` is a
rank's rows per micro-step (``B*s/(G_data*G_z)``). Device terms, bytes per rank:

==============  ==================================================================================
params          local parameter elements x weight bytes (fp32; the compute dtype with offload)
grads           the same elements x gradient bytes (they live until the step); with the sharded
                optimizer (no accumulation) a bucket's shrink to its owned slice once reduced
optimizer       Adam moments (8 B) of the elements whose state this rank owns and keeps on the
                device, plus an fp32 master (4 B) when the weights are in a lower dtype; owned =
                ``1/G`` of each piece with the sharded optimizer (``G``: its ``grad_sum`` group)
activations     kept for backward: every block (Korthikanti et al., :func:`block_activation_bytes`,
                scaled to the activation dtype), or with checkpointing each block's input plus
                one block recomputed; the head's inputs and logits
buffers         gathered weight blocks (forward and backward gather and the gradient block); with
                G_z = 1 the cast copies of the weights autocast keeps for backward
transient       the larger of: backward (a bucket's flat gradient, the loss's logit workspace) and
                the optimizer step (fp32 copies of low-precision gradients, the sharded
                optimizer's weight gathers; on CPU ranks gloo's copies of a bucket in
                reduce-scatter and all-gather); AdamW is fused, with no temporaries of its own
workspace       GEMM workspaces (cuBLAS) on a GPU
allocator       CPU ranks: the process's memory beyond live tensors (:data:`CPU_OVERHEAD` of them);
                a GPU's caching allocator instead gets :data:`ALLOCATOR_OVERHEAD` in fit checks
==============  ==================================================================================

Host terms (offload, :mod:`axo4d.training.optim.offload`): the offloaded masters and moments (12 B
per element), gradient copies (gradient bytes; they carry the new weights back too), a bucket's fp32
gradient during the update; ``staging``: with asynchronous checkpoints (``checkpoint.async``), the
host copy of what the rank saves -- its fp32 weights and Adam moments (12 B per element it saves:
every local element, or the owned ones with the sharded optimizer or offload), pinned on a GPU and
kept between saves; ``runtime``: what the process holds before training (given by the caller:
measured at start-up on CPU).

``device_fraction`` (``train.offload: auto``): the share of the owned optimizer state kept on the
device; :func:`auto_fraction` finds the largest that fits a device budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from axo4d.facts.parts import NormSpec, layer_pairs
from axo4d.facts.schedule_rules import DP_LAG, OPTIM_INFLIGHT_GATHERS
from axo4d.facts.spec import Dtypes, ModelSpec

GIB = 2**30
#: the CUDA caching allocator's loss to fragmentation and block rounding, as a share of the peak (fit checks)
ALLOCATOR_OVERHEAD = 0.05
#: CPU ranks: what the process's resident memory holds beyond the live tensors once training runs
#: (the heap, page rounding, Python objects of parameters and state), as a share of the tensors;
#: measured with bench.capacity (peak RSS over live tensors: 1.055-1.07 from 3 to 8M parameters)
CPU_OVERHEAD = 0.07
#: GEMM library workspaces on a GPU (cuBLAS: 4 MiB x 8 per stream, two streams)
GPU_WORKSPACE_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Setup:
    """What besides the model and grid decides memory (the trainer's settings)."""

    checkpointing: bool = False
    flash: bool = True
    """Attention keeps no ``s x s`` scores (SDPA's flash/efficient kernels, on GPU and CPU)."""
    shard: bool | None = None
    """The sharded optimizer (None: 'auto', on when G_data > 1)."""
    offload: str = "none"
    device_fraction: float = 1.0
    """``offload='auto'``: share of the owned optimizer state on the device."""
    bucket_bytes: float = 25 * 2**20
    accumulate: bool = False
    """Gradient accumulation (``grad_accum > 1``): whole gradients live through the micro-steps."""
    gpu: bool = True
    """A GPU (fused AdamW, GEMM workspaces, staging copies) rather than CPU ranks."""
    runtime_bytes: float = 0.0
    staging: bool = False
    """Asynchronous checkpoints: the host copy of the saved state (``staging``, module docstring)."""


@dataclass
class Memory:
    """Predicted bytes per rank: ``device`` and ``host`` terms, each with its ``total``."""

    device: dict[str, float]
    host: dict[str, float]
    owned_elements: float
    device_fraction: float
    setup: Setup = field(repr=False, default_factory=Setup)

    @property
    def device_state_bytes(self) -> float:
        """Bytes of optimizer state kept on the device."""
        return self.device["optimizer"]

    def largest(self) -> tuple[str, float]:
        """The largest device term."""
        return max(((k, v) for k, v in self.device.items() if k != "total"), key=lambda kv: kv[1])

    def reserved(self) -> float:
        """What the device allocator reserves at the peak (a GPU's fragmentation included)."""
        return self.device["total"] * (1 + ALLOCATOR_OVERHEAD * self.setup.gpu)


def shard_on_grid(g_data: int, shard: bool | None) -> bool:
    """``parallel.shard_optimizer`` on a grid of ``G_data`` data ranks: ``None`` is 'auto' (on when
    G_data > 1). The one rule: the trainer (:func:`axo4d.facts.run.shard_optimizer_on`), the memory
    model and ``perfmodel`` all resolve the setting here."""
    return g_data > 1 if shard is None else bool(shard)


def shard_on(spec: ModelSpec, shard: bool | None) -> bool:
    """:func:`shard_on_grid` on ``spec``'s grid."""
    return shard_on_grid(spec.grid.size("data"), shard)


def weight_dtypes(dt: Dtypes, offload: str) -> Dtypes:
    """Element sizes with offload: the weights and their gradients in the compute dtype."""
    if offload == "none":
        return dt
    return replace(dt, param_state=dt.weight, grad_state=dt.weight, grad=dt.weight)


def owned_elements(spec: ModelSpec, shard: bool | None) -> float:
    """Elements whose optimizer state one rank owns: each piece divided by its ``grad_sum``
    group when sharded."""
    sharded = shard_on(spec, shard)
    out = 0.0
    for _, pl, per_block in spec.placements():
        n = math.prod(pl.full_shape) / (spec.grid.size(*pl.split) if pl.split else 1)
        g = spec.grid.size(*pl.grad_sum) if sharded else 1
        out += n / g * (spec.n_layer if per_block else 1)
    return out


def _sharded(spec: ModelSpec) -> tuple[float, float]:
    """Local elements of the parameters a sharded optimizer splits, and of their owned slices."""
    local = owned = 0.0
    for _, pl, per_block in spec.placements():
        g = spec.grid.size(*pl.grad_sum)
        if g > 1:
            n = (
                math.prod(pl.full_shape)
                / (spec.grid.size(*pl.split) if pl.split else 1)
                * (spec.n_layer if per_block else 1)
            )
            local, owned = local + n, owned + n / g
    return local, owned


def activation_bytes(spec: ModelSpec, b: float, dt: Dtypes, checkpointing: bool, flash: bool) -> float:
    """Activations kept for backward at its start (module docstring)."""
    block = block_activation_bytes(spec, b, flash) * dt.act / 2
    head = head_activation_bytes(spec, b, dt) + split_mask_bytes(spec, dt)
    if checkpointing:
        return spec.n_layer * checkpoint_bytes(spec, b, dt) + block + head
    return spec.n_layer * block + head


def _buffers(spec: ModelSpec, dt: Dtypes, checkpointing: bool) -> float:
    g = spec.grid
    lins = spec.all_linears()
    wmax = max(x.weight_block(g) for x in lins)
    out = wmax * (2 * dt.weight + dt.grad)
    if g.z == 1 and dt.param_state != dt.weight:  # autocast's cast weights, saved per layer
        per_block = sum(x.weight_block(g) for x in spec.linears())
        layers = 1 if checkpointing else spec.n_layer
        out += (layers * per_block + spec.head_linear().weight_block(g)) * dt.weight
    return out


def memory(spec: ModelSpec, b: float, dt: Dtypes, setup: Setup = Setup()) -> Memory:
    """Device and host bytes per rank of one training step of ``spec`` (module docstring)."""
    d = weight_dtypes(dt, setup.offload)
    pc = spec.local_params()
    n = pc["linear"] + pc["other"]
    owned = owned_elements(spec, setup.shard)
    frac = {"none": 1.0, "optimizer": 0.0, "auto": setup.device_fraction}[setup.offload]
    own_master = d.param_state != 4
    on_dev, on_host = owned * frac, owned * (1 - frac)
    sharded = shard_on(spec, setup.shard)
    bucket = min(setup.bucket_bytes / 4, n)  # elements (buckets are planned on fp32 sizes)
    grads = n * d.grad_state
    if sharded and not setup.accumulate:  # a sharded bucket's gradients shrink to the owned slice once
        split, owned_slices = _sharded(spec)  # reduced, DP_LAG buckets behind the newest one in flight
        grads = (n - split + owned_slices + min(split, (DP_LAG + 1) * bucket)) * d.grad_state
    backward = bucket * d.grad_state + 2 * dt.stat * b * spec.vocab / (spec.grid.x * spec.grid.y)
    step = 4 * on_dev if d.grad_state != 4 else 0.0
    if sharded:
        step += (OPTIM_INFLIGHT_GATHERS + 1) * bucket * d.param_state
        if not setup.gpu:  # gloo's reduce-scatter and all-gather work on a copy of the bucket
            backward += bucket * d.grad_state
            step += bucket * d.param_state
    dev = {
        "params": n * d.param_state,
        "grads": grads,
        "optimizer": on_dev * (8 + 4 * own_master),
        "activations": activation_bytes(spec, b, dt, setup.checkpointing, setup.flash),
        "buffers": _buffers(spec, d, setup.checkpointing),
        "transient": max(backward, step),
        "workspace": GPU_WORKSPACE_BYTES if setup.gpu else 0.0,
    }
    host = {
        "optimizer": on_host * 12,
        "grad_copies": on_host * d.grad_state,
        "transient": min(on_host, bucket) * 4,
        "staging": staging_bytes(n, owned, sharded or setup.offload != "none", d) if setup.staging else 0.0,
        "runtime": setup.runtime_bytes,
    }
    if not setup.gpu:  # one memory: counted with the device (where the check looks)
        dev["allocator"] = CPU_OVERHEAD * (sum(dev.values()) + sum(host.values()) - setup.runtime_bytes)
    dev["total"] = sum(dev.values())
    host["total"] = sum(host.values())
    return Memory(dev, host, owned, frac, setup)


def staging_bytes(local: float, owned: float, owned_state: bool, d: Dtypes) -> float:
    """The host copy an asynchronous checkpoint keeps: each saved element's weight and two fp32 Adam
    moments -- the owned slices' fp32 masters when the optimizer owns slices (sharded or offload),
    else every local weight in its stored dtype."""
    return owned * 12 if owned_state else local * (d.param_state + 8)


def auto_fraction(spec: ModelSpec, b: float, dt: Dtypes, setup: Setup, device_budget: float) -> float:
    """The largest share of the owned optimizer state that keeps the device's reserved bytes
    within ``device_budget`` (0 when not even none fits; 1 when all does)."""

    def fits(f: float) -> bool:
        return memory(spec, b, dt, replace(setup, offload="auto", device_fraction=f)).reserved() <= device_budget

    if fits(1.0):
        return 1.0
    if not fits(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def device_memory(
    spec: ModelSpec,
    b: float,
    dt: Dtypes,
    checkpointing: bool,
    flash: bool,
    shard: bool | None = None,
    offload: str = "none",
    bucket_bytes: float = 25 * 2**20,
    device_budget: float = math.inf,
) -> dict[str, float]:
    """The device terms of :func:`memory` on a GPU (what :func:`perfmodel.model.estimate` reports);
    'auto' offload keeps on the device what fits ``device_budget``."""
    setup = Setup(checkpointing, flash, shard, offload, bucket_bytes=bucket_bytes)
    if offload == "auto":
        setup = replace(setup, device_fraction=auto_fraction(spec, b, dt, setup, device_budget))
    return memory(spec, b, dt, setup).device


# ---- activations --------------------------------------------------------------------
def block_activation_bytes(spec: ModelSpec, b: float, flash: bool) -> float:
    """Activation bytes one block keeps for backward (Korthikanti et al. 2022).

    Their ``s*b*h*(34 + 5*a*s/h)`` bytes per layer, placed on this layout (``b`` local rows;
    docs/design.md section 2.1: what lies between the GEMMs is split over x and y, each linear
    layer keeps its input as gathered for its GEMM, ``K/G_in``): norm inputs 4 and the two dropout
    masks 2 on the residual stream (``h/(G_x G_y)``); QKV and MLP-up inputs 2 each (``h/G_x``, or
    ``h/G_y`` where the pairs are turned, docs/design.md 2.2); Q, K 4, V 2 on this rank's heads
    (``h/(G_x G_y)``, or ``h/G_y`` in the fallback of
    :meth:`~axo4d.facts.parts.AttentionSpec.whole_heads`); out-proj input 2 (``h/G_y``, turned
    ``h/G_x``); the MLP activation's input 8 on its block (``F/(G_x G_y)``) and MLP-down's input 8
    (``F/G_y``, turned ``F/G_x``; both scaled by the MLP's width relative to 4h); the ``5*a*s`` bytes
    per token of softmax output, its dropout mask and output per local head. With ``flash`` the score
    terms become 4 bytes per head and token (the log-sum-exp). With the sequence split over z, the
    gathered K and V (:func:`kv_gather_bytes`).
    """
    g, h, s = spec.grid, spec.hidden, spec.seq_len
    att = spec.attention()
    a, heads = att.n_head, g.size(*att.head_axes(g))
    tp, f = g.x * g.y, spec.ffn_width() / 4
    (qkv, proj), (up, down) = layer_pairs(spec.block)[:2]
    gin = lambda lin: g.size(lin.axes()[0])  # a layer keeps its input gathered: K / G_in wide
    stream = 6 * b * h / tp + 2 * b * h / gin(qkv) + 2 * b * h / gin(up)  # norm inputs, masks; QKV, MLP-up inputs
    stream += 4 * b * h / tp * split_layer_norms(spec, spec.block)
    inner = 6 * b * h / heads + 2 * b * h / gin(proj) + 8 * f * b / tp + 8 * f * b / gin(down)
    flash = flash or att.splits(g)  # the sequence split's kernel (SDPA with a mask) keeps no scores
    scores = (4 * b * a if flash else 5 * b * a * s) / heads
    return stream + inner + scores + kv_gather_bytes(spec, b)


def split_layer_norms(spec: ModelSpec, parts: tuple) -> int:
    """LayerNorms among ``parts`` that run on a feature block (G_x*G_y > 1): composed of autograd
    operators (statistics summed over x and y), each keeps two more copies of its block than the
    fused kernel -- its centred input and its normalised output (:class:`axo4d.nn.norms.LayerNorm`)."""
    if spec.grid.x * spec.grid.y == 1:
        return 0
    return sum(1 for p in parts if isinstance(p, NormSpec) and not p.rms)


def kv_gather_bytes(spec: ModelSpec, b: float) -> float:
    """With the sequence split over z (:mod:`axo4d.nn.seqsplit`): the whole sequence's K and V one
    block's attention keeps for backward beyond its own rows' (2 bytes each per element, like
    :func:`block_activation_bytes`): ``4 b (G_z - 1) H_kv D / (G_x G_y)`` (``/ G_y`` in the heads'
    fallback); 0 otherwise."""
    att, g = spec.attention(), spec.grid
    if not att.splits(g):
        return 0.0
    return 4 * b * (g.z - 1) * att.n_kv_head * att.head_dim / g.size(*att.head_axes(g))


def split_mask_bytes(spec: ModelSpec, dt: Dtypes) -> float:
    """With the sequence split over z: the two chunks' causal masks (``L x (c+1) L`` for chunk
    ``c``, ``L = s/(2 G_z)``: ``L^2 (2 G_z + 1)`` elements), boolean and additive in the activation
    dtype, built once per forward pass and shared by every block (without document masks); 0
    otherwise."""
    g = spec.grid
    if not spec.attention().splits(g):
        return 0.0
    n = spec.seq_len / (2 * g.z)
    return n * n * (2 * g.z + 1) * (1 + dt.act)


def head_activation_bytes(spec: ModelSpec, b: float, dt: Dtypes) -> float:
    """Final norm input (activation dtype, split over x and y), LM-head input (gathered over y: split
    over x) and the logits kept for the softmax backward (statistics dtype, fp32; split over x and y)."""
    g = spec.grid
    norm = 1 + 2 * split_layer_norms(spec, spec.head)  # the final norm's input (and copies, see above)
    return dt.act * b * spec.hidden * (norm / (g.x * g.y) + 1 / g.x) + dt.stat * b * spec.vocab / (g.x * g.y)


def checkpoint_bytes(spec: ModelSpec, b: float, dt: Dtypes) -> float:
    """A checkpointed block keeps only its input (residual stream, over x and y)."""
    return dt.act * b * spec.hidden / (spec.grid.x * spec.grid.y)


__all__ = [
    "Setup",
    "Memory",
    "memory",
    "auto_fraction",
    "device_memory",
    "owned_elements",
    "staging_bytes",
    "activation_bytes",
    "kv_gather_bytes",
    "split_mask_bytes",
    "split_layer_norms",
    "weight_dtypes",
    "ALLOCATOR_OVERHEAD",
    "GIB",
]
