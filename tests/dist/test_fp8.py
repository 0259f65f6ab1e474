"""FP8 3D linear layers equal torchao's single-process ``Float8Linear`` on every grid of 2, 4 and 8
ranks (one spawned group per rank count; cases in cases_fp8.py; 1 rank: tests/unit/test_fp8.py).

Tolerances (relative to the largest reference value), from the FP8 rounding the recipes allow:
the FP8 operands and scales are those of the unsharded tensors bit for bit (checked: 0), so what
remains is the rounding of partial sums that a single process does not make: a tensorwise GEMM's
fp32 partials summed over an axis (~1e-6: :data:`TOL_FP32`), a rowwise GEMM's (and any bf16
run's) outputs in bf16 before they are summed over x, y or the batch pieces (2^-8 = 3.9e-3 per
rounding, a few summed: :data:`TOL_BF16`). In a chain of rowwise layers the first layer's output,
rounded in bf16 in another order, is the second's input: an element that lands on the other side
of an FP8 rounding boundary moves by one e4m3 step, 2^-3 of itself (:data:`TOL_CHAIN`). The
negative control (scales left unagreed, each rank its own amax) misses the fp32 tolerance by
orders of magnitude.
"""

import pytest

from tests.dist.harness import run_on_ranks

TOL_FP32 = 1e-5
TOL_BF16 = 2e-2
TOL_CHAIN = 2**-3


def tolerance(case: str) -> float:
    if "bit-exact" in case or "hits" in case:
        return 0.0
    if case.startswith("tensorwise") and "bf16" not in case:
        return TOL_FP32
    return TOL_CHAIN if "chain" in case else TOL_BF16


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4, 8])
def test_fp8_linear3d_matches_torchao(world):
    results = run_on_ranks(world, "tests.dist.cases_fp8:run", 600)
    bad = []
    for rank, res in enumerate(results):
        for spec, cases in res.items():
            for case, err in cases.items():
                if spec.startswith("control"):
                    if not err > 100 * TOL_FP32:
                        bad.append(f"rank {rank} {spec}: unagreed scales gave only {err:.2e}: the check cannot fail")
                elif not err <= tolerance(case):
                    bad.append(f"rank {rank} grid {spec} {case}: rel err {err:.2e} > {tolerance(case)}")
    for spec, cases in results[0].items():
        by: dict[float, float] = {}
        for c, v in cases.items():
            by[tolerance(c)] = max(by.get(tolerance(c), 0.0), v)
        print(f"world {world} {spec:26s} " + ", ".join(f"max {v:.2e} (tol {t:g})" for t, v in sorted(by.items())))
    assert not bad, "\n".join(bad[:20])
