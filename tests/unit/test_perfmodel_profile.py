"""Tests of ``perfmodel profile``: fitting, table construction, one gloo run."""

from __future__ import annotations

import os
import socket

import pytest

from perfmodel.__main__ import main
from perfmodel.collectives import ALL_GATHER, ALL_REDUCE, collective_time
from perfmodel.machine import load_machine
from perfmodel.profile import build_machine, coverage_table, fit_alpha_beta, group_shapes, shape_grid


@pytest.mark.parametrize("kind", [ALL_GATHER, ALL_REDUCE])
def test_fit_recovers_alpha_beta(kind):
    sizes = [1e6, 4e6, 16e6, 64e6]
    ts = [collective_time(kind, n, 4, 50.0, 7e-6) for n in sizes]
    alpha, gbps = fit_alpha_beta(kind, 4, sizes, ts)
    assert alpha == pytest.approx(7e-6, rel=1e-6) and gbps == pytest.approx(50.0, rel=1e-9)


def test_group_shapes_use_grid_strides():
    assert group_shapes(8) == [(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)]
    g = shape_grid(8, 2, 4)
    assert g.stride("y") == 2 and g.size("y") == 4 and g.all_groups(("y",))[0] == (0, 2, 4, 6)


def test_build_machine_covers_every_key(tmp_path):
    pts = {(s, p): (100.0 / s, 1e-5 * s) for s, p in group_shapes(16)}
    m = build_machine(pts, name="fake", gpus_per_node=4, device_memory_gb=80, gemm_tflops=500)
    assert m.bandwidth(1, 2) == 100 and m.bandwidth(1, 3) == 100 and m.bandwidth(8, 2) == 12.5
    assert m.bandwidth(3, 2) == 25 and m.bandwidth(100, 100) == 12.5  # next larger key, then unbounded
    assert m.latency_s(2, 4) == pytest.approx(2e-5)
    assert m.inter_node_gbps == 12.5
    assert len(coverage_table(pts)) == len(pts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # dist is initialised: profile's main uses it as is
        assert (
            main(
                [
                    "profile",
                    "--out",
                    out,
                    "--sizes-mb",
                    "0.01,0.04",
                    "--iters",
                    "2",
                    "--warmup",
                    "1",
                    "--gemm-n",
                    "64",
                    "--gpus-per-node",
                    "2",
                    "--name",
                    "cpu",
                    "--gemm-shapes",
                    "4",
                ]
            )
            == 0
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_profile_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "cpu.yaml"
    mp.spawn(_worker, args=(2, _free_port(), str(out)), nprocs=2)
    m = load_machine(str(out))
    assert m.name == "cpu" and m.gpus_per_node == 2 and m.bandwidth(1, 2) > 0 and m.gemm_tflops > 0
    assert len(m.gemm_table) == 4 and all(p.dtype == "float32" and p.tflops > 0 for p in m.gemm_table)
    assert m.attention_tflops > 0 and m.memory_gbps > 0
    g, c, _ = m.slowdowns()
    assert g >= 1 and c >= 1 and m.compute_slowdown is not None  # measured, not derived


def test_profile_cli_help(capsys):
    assert main(["profile", "--help"]) == 0
    assert "--sizes-mb" in capsys.readouterr().out
