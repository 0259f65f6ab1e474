"""Measurements behind the compute and overlap fields of a machine file (``perfmodel profile``).

Every function runs on all ranks at once (shared cores and links are part of the figure) and
returns the slowest rank's view where ranks could differ:

* :func:`measure_gemm_table`: the local GEMM shapes a job's grids produce
  (:func:`gemm_shapes`, from the model's parts), each timed in its layout (and
  :func:`measure_fp8_table`: the same shapes as FP8 layers multiply them);
* :func:`measure_attention`: causal ``scaled_dot_product_attention`` forward + backward, as a rate
  in axo4d's attention FLOPs (:meth:`axo4d.facts.spec.AttentionSpec.gemm_flops`, x3 for both passes);
* :func:`measure_memory`: streaming bandwidth (elementwise work);
* :func:`measure_overlap`: a GEMM loop and a collective at once -> the ``compute_slowdown`` and
  ``comm_slowdown`` of the fluid model in :mod:`perfmodel.engine` (one figure for both);
* :func:`measure_concurrency`: two collectives of different groups at once, both inside a node or
  both across nodes -> ``concurrent_slowdown``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterable

from axo4d.facts.fp8_rule import MULTIPLE
from axo4d.facts.grid import Grid, all_grids

from .compute import GemmPoint, linear_gemms

DTYPE_NAMES = {"bfloat16": "bfloat16", "float32": "float32"}


def _dtype(device: Any) -> Any:
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, device: Any) -> float:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _time(fn: Callable[[], Any], device: Any, iters: int, warmup: int = 1, min_s: float = 0.0) -> float:
    """Mean seconds per call on this rank (at least ``iters`` calls and ``min_s`` seconds)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    n = 0
    while n < iters or time.perf_counter() - t0 < min_s:
        fn()
        n += 1
    _sync(device)
    return (time.perf_counter() - t0) / n


# ---- GEMMs --------------------------------------------------------------------------------------
def gemm_shapes(
    model_cfg: Any, world: int, micro_batch: int, limit: int = 24, grids: Iterable[Grid] | None = None
) -> list[tuple[int, int, int, str]]:
    """Distinct local GEMM shapes ``(m, n, k, layout)`` of every grid of ``world`` ranks the model
    builds on (or of ``grids``), at most ``limit`` of them spread evenly over their FLOPs (log)."""
    from axo4d.facts.archs import model_spec

    shapes: set[tuple[int, int, int, str]] = set()
    for g in grids if grids is not None else all_grids(world):
        spec = model_spec(model_cfg, g)
        if spec.divisibility_reasons(micro_batch):
            continue
        rows = micro_batch * spec.seq_len // g.size("data", "z")
        for lin in spec.linears() + (spec.head_linear(),):
            for m, n, k, lay in linear_gemms(lin, g, rows).values():
                shapes.add((int(m), int(n), int(k), lay))
    out = sorted(shapes, key=lambda s: (s[0] * s[1] * s[2], s))
    if len(out) <= limit:
        return out
    step = (len(out) - 1) / (limit - 1)
    return [out[round(i * step)] for i in range(limit)]


def measure_gemm_table(
    device: Any, shapes: Iterable[tuple[int, int, int, str]], iters: int = 5, min_s: float = 0.05, repeats: int = 1
) -> list[GemmPoint]:
    """Each shape's achieved TFLOP/s in its layout and the device's training dtype; with
    ``repeats`` > 1 the shapes are timed in turn that many times and each keeps its median (a
    burst of load elsewhere spoils one timing, not a shape)."""
    import statistics

    import torch

    dt = _dtype(device)
    shapes = list(shapes)
    ops = []
    for m, n, k, lay in shapes:
        a = (
            torch.randn(m, k, device=device, dtype=dt)
            if lay[0] == "n"
            else torch.randn(k, m, device=device, dtype=dt).t()
        )
        b = (
            torch.randn(k, n, device=device, dtype=dt)
            if lay[1] == "n"
            else torch.randn(n, k, device=device, dtype=dt).t()
        )
        ops.append((lambda a=a, b=b: a @ b))
    secs: list[list[float]] = [[] for _ in shapes]
    for _ in range(max(1, repeats)):
        for i, op in enumerate(ops):
            secs[i].append(_slowest(_time(op, device, iters, 1, min_s), device))
    name = str(dt).replace("torch.", "")
    return [
        GemmPoint(m, n, k, lay, name, round(2 * m * n * k / statistics.median(t) / 1e12, 6))
        for (m, n, k, lay), t in zip(shapes, secs)
    ]


def measure_fp8_table(
    device: Any, shapes: Iterable[tuple[int, int, int, str]], iters: int = 5, min_s: float = 0.05
) -> list[GemmPoint]:
    """Each shape's achieved TFLOP/s as the FP8 layers run it (``torch._scaled_mm`` of e4m3
    operands, the first row-major and the second column-major, one scale each, the compute dtype
    out: :func:`axo4d.nn.fp8.scaled_mm`'s tensorwise call), as ``float8`` rows in the shape's
    layout; shapes with a dimension that is not a multiple of
    :data:`~axo4d.facts.fp8_rule.MULTIPLE` are left out (no FP8 layer has one:
    :func:`axo4d.facts.fp8_rule.shape_problems`)."""
    import torch

    out_dtype = _dtype(device)
    one = torch.ones((), device=device)
    kept, ops = [], []
    for m, n, k, lay in shapes:
        if m % MULTIPLE or n % MULTIPLE or k % MULTIPLE:
            continue
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
        kept.append((m, n, k, lay))
        ops.append(lambda a=a, b=b: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=out_dtype))
    secs = [_slowest(_time(op, device, iters, 1, min_s), device) for op in ops]
    return [
        GemmPoint(m, n, k, lay, "float8", round(2 * m * n * k / t / 1e12, 6)) for (m, n, k, lay), t in zip(kept, secs)
    ]


# ---- attention, memory ----------------------------------------------------------------------------
def measure_attention(device: Any, batch: int, heads: int, seq: int, head_dim: int, iters: int = 3) -> float:
    """TFLOP/s of causal attention forward + backward in axo4d's count (``3 * 4 * B s^2 H d``)."""
    import torch
    import torch.nn.functional as F

    dt = _dtype(device)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dt)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    sec = _slowest(_time(step, device, iters, 1, 0.05), device)
    return 3 * 4 * batch * seq * seq * heads * head_dim / sec / 1e12


def measure_memory(device: Any, mb: float = 64.0, iters: int = 5) -> float:
    """Streaming GB/s of ``c = a + b`` (three tensors of ``mb`` MB: two read, one written)."""
    import torch

    n = int(mb * 1e6 // 4)
    a, b, c = (torch.randn(n, device=device) for _ in range(3))
    sec = _slowest(_time(lambda: torch.add(a, b, out=c), device, iters, 1, 0.05), device)
    return 3 * n * 4 / sec / 1e9


# ---- overlap ----------------------------------------------------------------------------------------
def _gemm_loop(device: Any, n: int, count: int) -> Callable[[], None]:
    import torch

    dt = _dtype(device)
    a = torch.randn(n, n, device=device, dtype=dt)

    def run() -> None:
        for _ in range(count):
            a @ a

    return run


def _stream_time(fn: Callable[[], None], device: Any) -> float:
    """Seconds of ``fn`` on the compute stream (CUDA events on GPU, the clock on CPU)."""
    import torch

    if device.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_overlap(device: Any, group: Any, nbytes: int, gemm_n: int, repeats: int = 3) -> float:
    """The slowdown ``s`` of a GEMM loop and an all-reduce of ``nbytes`` on ``group`` run at once
    (every rank of the world in one group of the shape): the all-reduce alone takes ``c``, a loop
    of GEMMs about as long ``g``; issued async together they end after ``T``; fluid sharing of one
    resource, each at ``1/s`` while both run, gives ``T = s * min(g, c) + |g - c|``. ``s = 1``:
    the collective hides for free; ``s = 2``: they take turns (nothing hides). Median over
    ``repeats``; used for both ``compute_slowdown`` and ``comm_slowdown``."""
    import statistics

    import torch
    import torch.distributed as dist

    x = torch.ones(max(1, nbytes // 4), device=device)

    def allreduce() -> None:
        dist.all_reduce(x, group=group)

    c = _slowest(_time(allreduce, device, 3, 1), device)
    one = _slowest(_time(_gemm_loop(device, gemm_n, 1), device, 3, 1), device)
    loop = _gemm_loop(device, gemm_n, max(1, round(c / max(one, 1e-9))))
    g = _slowest(_time(loop, device, 2, 1), device)
    out = []
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        work = dist.all_reduce(x, group=group, async_op=True)
        loop()
        work.wait()
        _sync(device)
        total = _slowest(time.perf_counter() - t0, device)
        lo, hi = min(g, c), max(g, c)
        out.append(min(2.5, max(1.0, (total - (hi - lo)) / lo)))
    return statistics.median(out)


def measure_concurrency(device: Any, group_a: Any, group_b: Any, nbytes: int, repeats: int = 3) -> float:
    """Slowdown ``s`` of each of two all-reduces on two different groups run at once: the faster
    group's message is scaled (up to 64x) so that both take about as long alone (``a``, ``b``);
    together they take ``T``; fluid sharing gives ``T = s * min + (max - min)``."""
    import statistics

    import torch
    import torch.distributed as dist

    def alone(x: Any, g: Any) -> float:
        return _slowest(_time(lambda: dist.all_reduce(x, group=g), device, 3, 1), device)

    n = max(1, nbytes // 4)
    xa, xb = torch.ones(n, device=device), torch.ones(n, device=device)
    a, b = alone(xa, group_a), alone(xb, group_b)
    scale = max(1, min(64, round(max(a, b) / max(min(a, b), 1e-9))))
    if a < b:
        xa = torch.ones(n * scale, device=device)
        a = alone(xa, group_a)
    elif b < a:
        xb = torch.ones(n * scale, device=device)
        b = alone(xb, group_b)
    out = []
    for _ in range(repeats):
        dist.barrier()

        def both() -> None:
            wa = dist.all_reduce(xa, group=group_a, async_op=True)
            wb = dist.all_reduce(xb, group=group_b, async_op=True)
            wa.wait()
            wb.wait()

        t = _slowest(_time(both, device, 2, 0), device)
        lo, hi = min(a, b), max(a, b)
        out.append(min(2.5, max(1.0, (t - hi + lo) / lo)))
    return statistics.median(out)


def measure_compute(opts: Any, world: int, device: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """GEMM table (model shapes or a generic set, plus a tuner cache), its fitted shape curve,
    attention rate and streaming bandwidth, as machine-file keys."""
    from .compute import fit_half_dim, rows_from_tuner_cache

    if opts.model:
        from axo4d.config import load_config

        cfg = load_config(opts.model)
        batch = opts.batch or cfg.train.global_batch
        shapes = gemm_shapes(cfg.model, world, batch, opts.gemm_shapes)
        hd = cfg.model.head_dim or cfg.model.n_embd // cfg.model.n_head
        per = max(1, (1 << 27) // (cfg.model.seq_len**2 * cfg.model.n_head))  # at most 2^27 scores
        attn = (max(1, min(batch, per)), cfg.model.n_head, cfg.model.seq_len, hd)  # one rank's whole attention
    else:
        n = opts.gemm_n
        dims = sorted({max(16, n // 8), max(32, n // 2), n})
        shapes = [(m, d, d, lay) for m in dims for d in dims for lay in ("nt", "nn", "tn")][: opts.gemm_shapes]
        attn = (2, 8, min(2048, 4 * n), 64)
    table = measure_gemm_table(device, shapes, repeats=max(1, opts.repeats))
    if opts.tuner_cache:
        table += rows_from_tuner_cache(opts.tuner_cache)
    half, _ = fit_half_dim(table)
    log(
        f"GEMM table: {len(table)} shapes, {min(p.tflops for p in table):.4g}-{max(p.tflops for p in table):.4g} "
        f"TFLOP/s; fitted half-speed dimension {half:.4g}"
    )
    att = measure_attention(device, *attn)
    mem = measure_memory(device, 16.0 if device.type == "cpu" else 256.0)
    log(f"attention (B, H, s, d) = {attn}: {att:.4g} TFLOP/s (axo4d count, fwd+bwd); streaming {mem:.4g} GB/s")
    return {
        "gemm_table": [p.to_dict() for p in table],
        "gemm_half_dim": round_sig(half, 3),
        "attention_tflops": round_sig(att),
        "memory_gbps": round_sig(mem),
    }


def measure_overlap_fields(
    world: int, rank: int, device: Any, gpn: int, opts: Any, log: Callable[[str], None]
) -> dict[str, Any]:
    """``compute_slowdown`` and ``comm_slowdown`` per link class the world has
    (``*_by_link``: 'intra' on its largest intra-node group shape, 'inter' on a shape whose every
    neighbour is on another node; the scalars: intra where there is one, else inter) and
    ``concurrent_slowdown`` per link class; with the middle ``--sizes-mb`` message on a GPU (a
    collective of the size training issues) and the largest on CPU ranks (a window of several
    scheduler slices: a CPU measurement of a few milliseconds is mostly noise)."""
    from .groups import group_shapes
    from .groups import shape_groups as _shape_groups

    pairs = link_pairs(world, gpn)
    shapes = group_shapes(world)
    intra = [s for s in shapes if s[0] * s[1] <= gpn]
    inter = [s for s in shapes if s[0] * s[1] > gpn]
    pick = {}
    if intra:
        pick["intra"] = max(intra, key=lambda s: s[1])
    if inter:
        pick["inter"] = max(inter, key=lambda s: (s[0] >= gpn, -s[1]))
    wanted = set(pick.values()) | {s for pair in pairs.values() for s in pair}
    groups = _shape_groups(world, rank, sorted(wanted))
    sizes = sorted(float(v) for v in opts.sizes_mb.split(",") if v.strip())
    nbytes = int((sizes[-1] if device.type == "cpu" else sizes[len(sizes) // 2]) * 1e6)
    by_link = {
        cls: round_sig(measure_overlap(device, groups[shape], nbytes, opts.gemm_n), 3) for cls, shape in pick.items()
    }
    s = by_link.get("intra", by_link.get("inter", 1.0))
    out: dict[str, Any] = {"compute_slowdown": s, "comm_slowdown": s}
    if by_link:
        out["compute_slowdown_by_link"] = dict(by_link)
        out["comm_slowdown_by_link"] = dict(by_link)
    conc = {}
    for cls, (a, b) in pairs.items():
        conc[cls] = round_sig(measure_concurrency(device, groups[a], groups[b], nbytes), 3)
    if conc:
        out["concurrent_slowdown"] = conc
    log(
        "overlap: a GEMM loop and a collective at once each "
        + ", ".join(f"x{v:g} ({cls}: group stride {pick[cls][0]} size {pick[cls][1]})" for cls, v in by_link.items())
        + f", {nbytes / 1e6:g} MB; concurrent collectives: "
        + (", ".join(f"{k} x{v:g}" for k, v in conc.items()) or "no pair of groups to measure")
    )
    return out


def link_pairs(world: int, gpus_per_node: int) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """Two different group shapes ``(stride, size)`` per link class: both staying inside a node
    ('intra'), both crossing nodes ('inter'), one of each ('mixed'), when the world has them."""
    from .groups import group_shapes

    shapes = group_shapes(world)
    cls = {s: ("inter" if s[0] * s[1] > gpus_per_node else "intra") for s in shapes}
    by = {c: sorted((s for s in shapes if cls[s] == c), key=lambda s: (s[1], s[0])) for c in ("intra", "inter")}
    out = {c: (v[0], v[1]) for c, v in by.items() if len(v) >= 2}
    if by["intra"] and by["inter"]:
        out["mixed"] = (by["intra"][0], by["inter"][0])
    return out


def round_sig(v: float, digits: int = 4) -> float:
    return float(f"{v:.{digits}g}") if v and math.isfinite(v) else v


__all__ = [
    "measure_compute",
    "measure_overlap_fields",
    "gemm_shapes",
    "measure_gemm_table",
    "measure_attention",
    "measure_memory",
    "measure_overlap",
    "measure_concurrency",
    "link_pairs",
]
