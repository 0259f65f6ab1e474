"""The 3D linear layer matches nn.Linear (fp32, <= 1e-5 relative) on every grid of 2, 4 and 8 ranks."""

import pytest

from tests.dist.harness import run_on_ranks

TOL = 1e-5


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4, 8])
def test_linear3d_matches_nn_linear(world):
    results = run_on_ranks(world, "tests.dist.cases_linear:run", 300)
    bad = []
    for rank, res in enumerate(results):
        for spec, cases in res.items():
            for case, err in cases.items():
                if not err <= TOL:
                    bad.append(f"rank {rank} grid {spec} case {case}: rel err {err:.2e} > {TOL}")
    for spec, cases in results[0].items():
        print(f"world {world} grid {spec:16s} max rel err {max(cases.values()):.2e} over {len(cases)} cases")
    assert not bad, "\n".join(bad[:20])


@pytest.mark.dist
def test_bias_gradient_counted_once_is_checked():
    res = run_on_ranks(4, "tests.dist.cases_linear:bias_counted_wrong", 120)
    for r in res:
        assert r["good"] <= TOL
        assert r["wrong"] > 0.5, "a bias gradient counted G_x times went unnoticed"
