"""``bench.rank_threads`` smoke: two 2-rank jobs of 2 steps (torch's default threads, then axo4d's),
one table row with both step times and their ratio; bad input is exit 2."""

from __future__ import annotations

import re

import pytest

from bench import rank_threads


@pytest.mark.timeout(300)
def test_rank_threads_smoke(capsys) -> None:
    assert rank_threads.main(["--ranks", "2", "--grids", "data=2", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^\| data=2 \| (\d+) \| (\d+) \| ([\d.]+)x \|", out, re.M)
    assert row, out
    old, new, ratio = int(row.group(1)), int(row.group(2)), float(row.group(3))
    assert old > 0 and new > 0 and ratio == pytest.approx(old / new, rel=0.15)


def test_rank_threads_bad_input(capsys) -> None:
    assert rank_threads.main(["--ranks", "1"]) == 2
    assert "--ranks 1" in capsys.readouterr().err
