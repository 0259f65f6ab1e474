"""Expert parallelism's facts (axo4d/facts/moe_memory.py) against closed forms counted apart:
the experts' elements (``L * E * 3 * C * F`` split over x, y, z), the all-to-all's volume (an
explicit dispatch of every (token, slot) pair to the rank holding its expert), the memory terms
as ``G_ep`` and the imbalance change, and the expert-group sizes a grid allows."""

from __future__ import annotations

import pytest

from axo4d.config import load_config
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid
from axo4d.facts.memory import Setup, memory, weight_dtypes
from axo4d.facts.moe_memory import (
    ExpertParallel,
    a2a_bytes_per_step,
    a2a_elements,
    ep_problems,
    ep_sizes,
    expert_elements,
    memory_with_experts,
)
from axo4d.facts.spec import Dtypes

L, C, E, K, F = 2, 64, 8, 2, 32  # moe-tiny


def _spec(grid: str):
    return model_spec(load_config("moe-tiny", [], None).model, Grid.parse(grid))


@pytest.mark.parametrize("grid", ["data=4", "data=4,x=2,y=2", "data=2,x=2,z=2"])
def test_expert_elements_closed_form(grid):
    spec = _spec(grid)
    g = spec.grid
    local, owned = expert_elements(spec)
    assert local == L * E * 3 * C * F / (g.x * g.y * g.z)
    assert owned == pytest.approx(local / g.size("data"))  # split over z already: grad_sum over data


def test_ep_sizes_and_problems():
    assert ep_sizes(_spec("data=4,x=2")) == [1, 2, 4]
    assert ep_sizes(_spec("data=16")) == [1, 2, 4, 8]  # 16 does not divide E = 8
    assert ep_problems(_spec("data=4"), ExpertParallel(4)) == []
    (msg,) = ep_problems(_spec("data=4"), ExpertParallel(3))
    assert "parallel.expert=3" in msg and "G_data=4" in msg and "n_experts=8" in msg
    assert "imbalance 0.5" in ep_problems(_spec("data=4"), ExpertParallel(2, 0.5))[0]
    dense = model_spec(load_config("tiny", [], None).model, Grid.parse("data=2"))
    assert "dense" in ep_problems(dense, ExpertParallel(2))[0] and ep_sizes(dense) == [1]


@pytest.mark.parametrize("g_ep", [1, 2, 4])
def test_a2a_volume_against_explicit_dispatch(g_ep):
    """Every (token, slot) pair of each rank goes to the rank holding its expert (E/G_ep
    consecutive experts a rank); routing spread evenly over the experts: the elements that leave
    a rank, dispatch then combine, equal the formula's."""
    spec = _spec("data=4,x=2")
    b = 48  # local tokens
    c_l = C / 2  # features a rank holds (x = 2)
    per_rank = E // g_ep
    sent = 0
    for rank in range(g_ep):
        for t in range(b):
            for s in range(K):
                e = (rank * b * K + t * K + s) % E  # balanced: every expert the same number of pairs
                sent += (e // per_rank != rank) * c_l
    sent_per_rank = 2 * sent / g_ep  # dispatch, and the combine sends the same rows back
    assert a2a_elements(spec, b, ExpertParallel(g_ep)) == pytest.approx(sent_per_rank)
    dt = Dtypes()
    step = a2a_bytes_per_step(spec, b, dt, ExpertParallel(g_ep), micro=3, ckpt=True)
    assert step == pytest.approx(sent_per_rank * dt.act * L * 3 * 3)  # fwd + bwd + recompute, 3 micro-steps


def test_memory_terms_with_experts():
    spec, dt, b = _spec("data=4"), Dtypes(), 64.0
    local, _ = expert_elements(spec)
    unsharded = Setup(shard=False, gpu=True)
    base = memory(spec, b, dt, unsharded).device
    one = memory_with_experts(spec, b, dt, unsharded, ExpertParallel(1)).device
    four = memory_with_experts(spec, b, dt, unsharded, ExpertParallel(4)).device
    assert one["params"] == base["params"] and one["optimizer"] == base["optimizer"]
    mlp = 2 * b * C + 8 * (2 * F / 4) * b * 2  # one MLP's kept bytes per block on x = y = 1 (bf16)
    assert one["activations"] - base["activations"] == pytest.approx((K - 1) * mlp * L)  # k rows a token, not 1
    assert base["params"] - four["params"] == pytest.approx(local * 3 / 4 * dt.param_state)
    assert base["grads"] - four["grads"] == pytest.approx(local * 3 / 4 * dt.grad_state)
    assert base["optimizer"] - four["optimizer"] == pytest.approx(local * 3 / 4 * 8)  # Adam moments (fp32 weights)
    assert four["transient"] - one["transient"] == pytest.approx(2 * K * b * C * dt.act)  # send + receive
    skew = memory_with_experts(spec, b, dt, unsharded, ExpertParallel(4, 1.5)).device
    assert skew["activations"] > four["activations"] and skew["transient"] > four["transient"]
    sharded = Setup(shard=True, gpu=True)  # a rank owns 1/G_data of each expert either way
    s1 = memory_with_experts(spec, b, dt, sharded, ExpertParallel(1)).device
    s4 = memory_with_experts(spec, b, dt, sharded, ExpertParallel(4)).device
    assert s1["optimizer"] == s4["optimizer"] and s1["grads"] == s4["grads"]
    dense = model_spec(load_config("tiny", [], None).model, Grid.parse("data=2"))
    assert memory_with_experts(dense, b, dt, unsharded, ExpertParallel()) == memory(dense, b, dt, unsharded)


def test_fp8_rule_on_experts_counts_routed_rows():
    """Qwen3-30B-A3B's experts pay in FP8 by shape (K, N) alone; with 8192 local rows, top-8 of 128
    experts gives each 512 routed rows (< 591: bf16), and an expert group of 2 doubles them (FP8).
    Mixtral's 8 experts, top-2, get 2048 (FP8). Without rows the rule judges the shape only."""
    from axo4d.facts.fp8_rule import EXPERT_MIN_ROWS, expert_rows, fp8_layer_names

    assert EXPERT_MIN_ROWS == 591
    q = model_spec(load_config("qwen3-30b-a3b", [], None).model, Grid.parse("data=256"))
    experts = lambda names: [n for n in names if n.startswith("mlp.experts.")]
    assert len(experts(fp8_layer_names(q, "tensorwise"))) == 2 * 128  # shape only: every expert
    assert expert_rows(q, 8192) == 512 and expert_rows(q, 8192, g_ep=2) == 1024
    names = fp8_layer_names(q, "tensorwise", rows=8192)
    assert experts(names) == [] and "attn.qkv" in names  # the dense layers keep their rule
    assert len(experts(fp8_layer_names(q, "tensorwise", rows=8192, g_ep=2))) == 256
    assert len(experts(fp8_layer_names(q, "tensorwise", "blocks", rows=8))) == 256  # 'blocks': all
    m = model_spec(load_config("mixtral-8x7b", [], None).model, Grid.parse("data=256"))
    assert expert_rows(m, 8192) == 2048 and len(experts(fp8_layer_names(m, "rowwise", rows=8192))) == 16


def test_trainers_memory_check_counts_the_experts_a_rank_holds():
    """The trainer's prediction (axo4d.training.memory_plan) for Qwen3-30B-A3B on data=8: with
    experts over 8 ranks a rank's expert weights are an eighth of those without, which the dense
    count (one MLP per token, every expert on every rank) missed; equal to memory_with_experts."""
    from axo4d.facts.moe_memory import IMBALANCE
    from axo4d.training.memory_plan import _predict, run_setup

    cfg = load_config("qwen3-30b-a3b", ["train.global_batch=8", "model.seq_len=512"], None)
    got = {}
    for ep in (1, 8):
        grid = Grid.parse("data=8", expert=ep)
        spec, b, dt, setup = run_setup(cfg, grid, True)
        got[ep] = _predict(spec, b, dt, setup, grid).device
        want = memory_with_experts(spec, b, dt, setup, ExpertParallel(ep, IMBALANCE if ep > 1 else 1.0))
        assert got[ep] == want.device
        if ep == 1:
            assert got[1]["activations"] > memory(spec, b, dt, setup).device["activations"]  # k rows per token
    local, _ = expert_elements(model_spec(cfg.model, Grid.parse("data=8")))
    per = weight_dtypes(dt, setup.offload).param_state  # bytes a weight element keeps
    assert got[1]["params"] - got[8]["params"] == pytest.approx(local * 7 / 8 * per, rel=1e-9)
