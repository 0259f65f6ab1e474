"""The grouped expert GEMM (axo4d/nn/grouped_gemm.py): ``torch._grouped_mm`` and the loop of
matmuls against a per-token reference (each token through its own expert with ``F.linear``),
forward and every gradient, with experts that receive no token; fp32 to 1e-6, bf16 to the
bf16 rounding of a few sums. Also the probe, the kernel choice and the benchmark's smoke run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from axo4d.nn import grouped_gemm as G

ROOT = Path(__file__).resolve().parents[2]
COUNTS = [5, 0, 9, 0, 1, 7]  # two experts without tokens, one with a single token


def _problem(dtype: torch.dtype, counts=COUNTS, c: int = 16, f: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    n, e = sum(counts), len(counts)
    x = torch.randn(n, c, generator=gen).to(dtype)  # (N, C)
    gu = (torch.randn(e, c, 2 * f, generator=gen) / c**0.5).to(dtype)  # (E, C, 2F)
    dn = (torch.randn(e, f, c, generator=gen) / f**0.5).to(dtype)  # (E, F, C)
    g = torch.randn(n, c, generator=gen).to(dtype)  # upstream gradient (N, C)
    return x, torch.tensor(counts), gu, dn, g


def _run(fn, x, counts, gu, dn, g):
    x, gu, dn = (t.detach().clone().requires_grad_() for t in (x, gu, dn))
    y = fn(x, counts, gu, dn)
    y.backward(g)
    return y.detach(), x.grad, gu.grad, dn.grad


def _per_token(x, counts, gu, dn):
    """Each row through its expert alone: expert index of row i from the counts."""
    owner = torch.repeat_interleave(torch.arange(len(counts)), counts)
    rows = []
    for i in range(x.shape[0]):
        e = int(owner[i])
        h = F.linear(x[i], gu[e].t()).unflatten(-1, (-1, 2))
        rows.append(F.linear(F.silu(h[..., 0]) * h[..., 1], dn[e].t()))
    return torch.stack(rows)


def _kernel(name):
    return lambda x, c, gu, dn: G.swiglu_experts(x, c, gu, dn, kernel=name)


def test_cpu_torch_has_grouped_mm():
    """torch 2.13's CPU build runs ``_grouped_mm`` (fp32, bf16) with its backward: 'auto' picks it."""
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
        assert G.pick_kernel(torch.ones(2, 16), torch.ones(1, 16, 16)) in ("grouped", "loop")
        return
    assert G.grouped_mm_supported("cpu", torch.float32) and G.grouped_mm_supported("cpu", torch.bfloat16)
    assert not G.grouped_mm_supported("cpu", torch.float64)  # the kernel refuses doubles: the loop runs
    assert G.pick_kernel(torch.ones(2, 16), torch.ones(1, 16, 16)) == "grouped"
    assert G.pick_kernel(torch.ones(2, 16, dtype=torch.float64), torch.ones(1, 16, 16, dtype=torch.float64)) == "loop"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_grouped_equals_loop_and_reference(dtype, tol):
    prob = _problem(dtype)
    ref = _run(_per_token, *prob)
    kernels = ["loop"] + (["grouped"] if G.grouped_mm_supported("cpu", dtype) else [])
    for name in kernels:
        got = _run(_kernel(name), *prob)
        for what, a, b in zip(("y", "dx", "d gate_up", "d down"), got, ref):
            scale = b.float().abs().max().clamp_min(1.0)
            err = ((a.float() - b.float()).abs().max() / scale).item()
            assert err <= tol, f"{name} {dtype} {what}: {err:.2e} > {tol}"
    if len(kernels) == 2:  # grouped == loop to 1e-6 in fp32 (bf16: rounding of different sums)
        a, b = _run(_kernel("grouped"), *prob), _run(_kernel("loop"), *prob)
        for t, u in zip(a, b):
            assert (t.float() - u.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else 5e-2)
    empty = [e for e, c in enumerate(COUNTS) if c == 0]
    for name in kernels:
        _, _, dgu, ddn = _run(_kernel(name), *prob)
        assert all(dgu[e].abs().max() == 0 and ddn[e].abs().max() == 0 for e in empty)


def test_all_tokens_one_expert_and_no_tokens():
    for counts in ([0, 12, 0], [0, 0, 0]):
        prob = _problem(torch.float32, counts)
        ref = _run(_per_token, *prob) if sum(counts) else None
        for name in ("loop", "grouped") if G.grouped_mm_supported("cpu", torch.float32) else ("loop",):
            got = _run(_kernel(name), *prob)
            assert got[0].shape == (sum(counts), 16)
            if ref is not None:
                assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-6) for a, b in zip(got, ref))
            else:
                assert got[2].abs().max() == 0 and got[3].abs().max() == 0


def test_between_and_after_hooks_and_bad_shapes():
    x, counts, gu, dn, _ = _problem(torch.float32)
    y = G.swiglu_experts(x, counts, gu, dn, between=lambda t: 2 * t, after=lambda t: t + 1)
    ref = _per_token(x, counts, 2 * gu, dn) + 1
    assert torch.allclose(y, ref, atol=1e-6)
    with pytest.raises(ValueError, match="grouped_matmul"):
        G.grouped_matmul(x, counts[:-1], gu)
    with pytest.raises(ValueError, match="kernel='fast'"):
        G.grouped_matmul(x, counts, gu, kernel="fast")


def test_bench_smoke():
    """bench/moe_gemm.py on one tiny shape: both kernels timed, the ratio and the choice printed."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.moe_gemm", "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "load average" in out.stdout and "grouped/loop" in out.stdout and "dispatcher picks" in out.stdout
