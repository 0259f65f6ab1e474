"""``perfmodel rank``'s answer pinned: a small case's whole table, byte for byte, against the text the
model printed before the search was made fast (issue 30 item 3), and the speed benchmark's smoke run.

Regenerate the expected file only for an intended change of the model's answers::

    python -m perfmodel rank --model llama3.1-8b --gpus 32 --batch 32 --seq 16384 --machine alps \\
        --cache-weights auto > tests/unit/data/perfmodel_rank_llama8b_32.txt
"""

from __future__ import annotations

from pathlib import Path

from perfmodel.__main__ import main

EXPECTED = Path(__file__).parent / "data" / "perfmodel_rank_llama8b_32.txt"
ARGS = "rank --model llama3.1-8b --gpus 32 --batch 32 --seq 16384 --machine alps --cache-weights auto"


def test_rank_table_is_pinned(capsys) -> None:
    """Sequence split, recomputation and cached blocks chosen per grid, the rank-order search, ties and
    infeasible grids: the whole table as before."""
    assert main(ARGS.split()) == 0
    assert capsys.readouterr().out == EXPECTED.read_text()


def test_speed_benchmark_smoke(capsys) -> None:
    from bench.perfmodel_speed import main as bench

    assert bench(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "cpu_s" in out and "gpt-5b" in out
