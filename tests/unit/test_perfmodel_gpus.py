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
