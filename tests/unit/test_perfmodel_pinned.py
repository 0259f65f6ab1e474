"""``perfmodel rank``'s answer pinned: a small case's whole table, byte for byte, against the text the
model printed before the search was made fast (issue 30 item 3), and the speed benchmark's smoke run.

Regenerate the expected file only for an intended change of the model's answers::

    python -m perfmodel rank --model llama3.1-8b --gpus 32 --batch 32 --seq 16384 --machine alps \\
        --cache-weights auto > tests/unit/data/perfmodel_rank_llama8b_32.txt
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

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


def test_mfu_hfu_and_gemm_ceiling_are_told_apart() -> None:
    """Issue 33 item 2: MFU counts model FLOPs (no recomputation) over the vendor's dense peak, HFU
    counts the recomputed FLOPs too, and the share of the measured GEMM ceiling is a third figure."""
    from axo4d.config import model_from_name
    from axo4d.facts.grid import Grid
    from perfmodel.machine import load_machine
    from perfmodel.model import estimate
    from perfmodel.tables import RANK_HEADERS, rank_text

    m = load_machine("alps")
    assert (m.vendor_tflops, load_machine("perlmutter").vendor_tflops, load_machine("frontier").vendor_tflops) == (
        989.0,
        312.0,
        191.5,
    )
    model = dataclasses.replace(model_from_name("llama3.1-8b"), seq_len=131072)
    e = estimate(model, Grid(data=1, x=1, y=2, z=4), 8, m, checkpointing=True, flash_attention=True)
    model_tflops = e.model_flops_per_step / e.step_time_s / 8 / 1e12
    assert e.model_tflops_per_gpu == pytest.approx(model_tflops, rel=1e-12)
    assert e.mfu == pytest.approx(model_tflops / 989.0, rel=1e-12)
    assert e.hfu / e.mfu == pytest.approx(e.flops_per_step / e.model_flops_per_step, rel=1e-12) and e.hfu > e.mfu
    assert e.ceiling_fraction == pytest.approx(e.tflops_per_gpu / 813.0, rel=1e-12)
    assert {"MFU", "HFU", "ceil"} <= set(RANK_HEADERS) and "peak" not in RANK_HEADERS
    row = next(ln for ln in rank_text([e], "h").splitlines() if ln.strip().startswith("data=1,x=1,y=2,z=4"))
    assert f"{model_tflops:.1f}" in row and f"{100 * e.mfu:.1f}%" in row and f"{100 * e.hfu:.1f}%" in row


def test_attention_kernel_defaults_to_the_trainers(capsys) -> None:
    """Issue 33 item 3: the trainer runs fused SDPA on GPUs, so perfmodel's default prices it (time and
    memory); fp32 (CPU) runs the unfused kernel; a bare --flash-attention still means on."""
    from perfmodel.__main__ import _kw, build_parser

    def kw(*extra: str) -> dict:
        return _kw(build_parser().parse_args(["rank", "--model", "tiny", "--batch", "8", "--machine", "alps"]
                                             + ["--gpus", "8", *extra]))  # fmt: skip

    assert kw()["flash_attention"] is True
    assert kw("--dtype", "fp32")["flash_attention"] is False
    assert kw("--flash-attention")["flash_attention"] is True
    assert kw("--flash-attention", "off")["flash_attention"] is False
    args = "explain --grid data=2,x=1,y=2,z=2 --model llama3.1-8b --batch 8 --seq 8192 --machine alps".split()
    args += "--z-split batch --checkpointing off".split()
    assert main(args) == 0
    default = capsys.readouterr().out
    assert main(args + ["--flash-attention", "on"]) == 0
    assert capsys.readouterr().out == default and "attention fused" in default
    assert main(args + ["--flash-attention", "off"]) == 0
    off = capsys.readouterr().out
    assert "attention unfused" in off and off.split("memory per GPU")[1] != default.split("memory per GPU")[1]
