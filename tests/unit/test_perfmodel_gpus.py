"""perfmodel: a GPU count that does not fill whole nodes is one clear error (exit 2), not a
silent estimate for a machine layout that cannot exist."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from perfmodel.machine import MachineError, load_machine

ROOT = Path(__file__).resolve().parents[2]


def test_check_gpus_per_node() -> None:
    m = load_machine("perlmutter")  # 4 GPUs per node
    assert m.check_gpus_per_node(None, 8) == 4 and m.check_gpus_per_node(4, 2) == 4
    assert m.check_gpus_per_node(3, 6) == 3 and m.check_gpus_per_node(None, 1) == 4
    with pytest.raises(MachineError, match=r"--gpus 7 is not a multiple of the 4 GPUs per node .* use --gpus 4 or 8"):
        m.check_gpus_per_node(4, 7)
    with pytest.raises(MachineError, match=r"--gpus 6 .* of perlmutter.* --gpus-per-node 3"):
        m.check_gpus_per_node(None, 6)


def test_cli_gpus_not_whole_nodes() -> None:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "perfmodel",
            "rank",
            "--model",
            "gpt-5b",
            "--gpus",
            "7",
            "--gpus-per-node",
            "4",
            "--batch",
            "8",
            "--machine",
            "perlmutter",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout[:500])
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and "--gpus 7 is not a multiple" in p.stderr


def test_a_billion_gpus_is_bounded_and_said(capsys) -> None:
    """Found by a probe (issue 22): --gpus 1000000000 estimated 48,400 grids for minutes without a
    word. Above FULL_SEARCH_MAX grids only those whose sizes divide the model and batch are priced."""
    import time

    from perfmodel.__main__ import main
    from perfmodel.model import FULL_SEARCH_MAX, rank_grids

    t0 = time.perf_counter()
    assert main(["rank", "--model", "tiny", "--gpus", "1000000000", "--batch", "64", "--machine", "perlmutter"]) == 0
    elapsed = time.perf_counter() - t0
    out = capsys.readouterr()
    assert "1,000,000,000 GPUs have 48,400 grids: only those whose sizes divide the model" in out.err
    assert "(not estimated)" in out.out and elapsed < 120, elapsed
    from axo4d.config import model_from_name

    small = rank_grids(model_from_name("tiny"), 64, 4, 64, load_machine("perlmutter"))
    assert len(small) <= FULL_SEARCH_MAX and not any("not estimated" in e.reason for e in small)


def test_cli_argument_errors_are_one_line(capsys) -> None:
    from perfmodel.__main__ import main

    args = ["tts", "--tokens", "lots", "--model", "tiny", "--gpus", "4", "--batch", "8", "--machine", "perlmutter"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "perfmodel: error: argument --tokens: invalid token count 'lots' (e.g. 3e11, 300B, 1.5T) "
        "(see: python -m perfmodel tts --help)"
    ]
