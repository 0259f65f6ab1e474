"""Grouped expert GEMM against the loop of matmuls on this machine's CPU (axo4d/nn/grouped_gemm.py).

For each shape (E experts, N routed rows, hidden C, expert width F = C, counts balanced or not)
both kernels run one SwiGLU expert set forward (gate|up, down: ``2 * N * C * F * 3`` FLOPs),
interleaved round by round so a change in the machine's load hits both alike; the medians, the
ratio grouped/loop (< 1: grouped faster), the achieved GFLOP/s and the 1-minute load average
(before and after) are printed, and which kernel the dispatcher picks on this CPU. Figures taken
with a load average above the core count are not evidence::

    python -m bench.moe_gemm                  # the full table (minutes on 2 cores)
    python -m bench.moe_gemm --smoke          # one tiny shape (the unit test's)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from axo4d.nn.grouped_gemm import grouped_mm_supported, pick_kernel, swiglu_experts, swiglu_flops

FULL = [(e, n, c) for e in (8, 64) for n in (512, 2048, 8192) for c in (256, 1024)]
SMOKE = [(4, 64, 32)]


def counts_for(e: int, n: int, balanced: bool) -> torch.Tensor:
    """Rows per expert: equal shares, or unbalanced (half the rows to one expert, a quarter of the
    experts empty, the rest spread evenly)."""
    if balanced:
        c = torch.full((e,), n // e)
    else:
        c = torch.zeros(e, dtype=torch.int64)
        c[0] = n // 2
        rest = list(range(1 + e // 4, e)) or [0]
        for i, k in enumerate(rest):
            c[k] += (n - n // 2) // len(rest) + (1 if i < (n - n // 2) % len(rest) else 0)
    c[0] += n - int(c.sum())
    return c


def time_shape(e: int, n: int, c: int, balanced: bool, rounds: int) -> dict:
    """Median seconds of one forward per kernel, interleaved rounds (one warm-up each first)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, generator=gen)  # (N, C)
    gu = torch.randn(e, c, 2 * c, generator=gen) / c**0.5  # (E, C, 2F), F = C
    dn = torch.randn(e, c, c, generator=gen) / c**0.5  # (E, F, C)
    counts = counts_for(e, n, balanced)
    kernels = ["loop"] + (["grouped"] if grouped_mm_supported("cpu", x.dtype) else [])
    times: dict[str, list[float]] = {k: [] for k in kernels}
    with torch.no_grad():
        for k in kernels:
            swiglu_experts(x, counts, gu, dn, kernel=k)
        for _ in range(rounds):
            for k in kernels:
                t0 = time.perf_counter()
                swiglu_experts(x, counts, gu, dn, kernel=k)
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.moe_gemm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one tiny shape, 3 rounds")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per shape (median of them)")
    a = ap.parse_args(argv)
    shapes, rounds = (SMOKE, 3) if a.smoke else (FULL, a.rounds)
    load0 = os.getloadavg()[0]
    cores = f"{torch.get_num_threads()} threads, {os.cpu_count()} cores"
    print(f"torch {torch.__version__}, {cores}, load average {load0:.2f}")
    print("FLOPs per forward of a SwiGLU expert set: 2 * N * C * F * 3 (gate, up, down), F = C here")
    head = f"{'E':>3} {'N':>5} {'C':>5} {'counts':>10} {'loop_ms':>9} {'grouped_ms':>10} {'grouped/loop':>12}"
    print(head + f" {'loop_GF/s':>9} {'grouped_GF/s':>12}")
    for e, n, c in shapes:
        for balanced in (True, False):
            t = time_shape(e, n, c, balanced, rounds)
            flops = swiglu_flops(n, c, c)
            g = t.get("grouped", float("nan"))
            print(
                f"{e:>3} {n:>5} {c:>5} {'balanced' if balanced else 'unbalanced':>10} {t['loop'] * 1e3:>9.3f} "
                f"{g * 1e3:>10.3f} {g / t['loop']:>12.3f} {flops / t['loop'] / 1e9:>9.1f} {flops / g / 1e9:>12.1f}"
            )
    print(f"load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after (figures under load are not evidence)")
    picked = pick_kernel(torch.ones(1, 16), torch.ones(1, 16, 16))
    print(f"dispatcher picks on this CPU (float32): {picked} (torch._grouped_mm supported: {picked == 'grouped'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
