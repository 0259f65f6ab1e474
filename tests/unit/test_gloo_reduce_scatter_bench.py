"""``bench.gloo_reduce_scatter --smoke``: on 2 local gloo ranks the all-to-all reduce-scatter equals
gloo's own (axo4d's :meth:`Comm.reduce_scatter`) on integer values, and every variant is timed."""

import subprocess
import sys


def test_collectives_smoke() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "bench.gloo_reduce_scatter", "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    for name in ("all_reduce (ring)", "reduce_scatter (gloo's own)", "reduce_scatter (all-to-all", "all_gather"):
        assert name in p.stdout, p.stdout
