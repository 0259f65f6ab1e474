"""``bench.gloo_reduce_scatter --smoke``: on 2 local gloo ranks the all-to-all and send/recv
reduce-scatters equal gloo's own (axo4d's :meth:`Comm.reduce_scatter`) on integer values, the
send/recv all-gather equals gloo's, and every variant is timed."""

import subprocess
import sys


def test_collectives_smoke() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "bench.gloo_reduce_scatter", "--smoke"], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    names = ("all_reduce (ring)", "reduce_scatter (gloo's own)", "reduce_scatter (all-to-all")
    for name in (*names, "reduce_scatter (send/recv", "all_gather (send/recv"):
        assert name in p.stdout, p.stdout
