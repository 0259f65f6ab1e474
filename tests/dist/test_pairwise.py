"""Two-rank gloo groups: reduce-scatter and all-gather as one exchange in chunks
(:mod:`axo4d.dist.pairwise`) equal gloo's own bit for bit, and a silent peer times out by name."""

import pytest

from tests.dist.cases_pairwise import TIMEOUT_S
from tests.dist.harness import run_on_ranks


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_two_rank_collectives_equal_gloo_and_time_out():
    res = run_on_ranks(4, "tests.dist.cases_pairwise:run", 150)
    for r, out in enumerate(res):
        assert out["paired"] == [True, True], f"rank {r}: the two-rank groups did not take the exchange"
        assert out["profile"] == {"forms": ["all_gather", "reduce_scatter"], "seconds_positive": True}, out["profile"]
        assert out["bad"] == [], f"rank {r}: {out['bad']}"
    t = res[0]["timeout"]
    assert t["raised"], "a reduce-scatter whose peer never joined returned"
    assert TIMEOUT_S - 0.5 <= t["seconds"] <= TIMEOUT_S + 5, t
    msg = t["message"]
    assert "rank 0" in msg and "reduce_scatter over axis x" in msg and "[0, 1]" in msg and "timed out" in msg, msg
