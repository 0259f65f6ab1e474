"""x and y exchanged on grids with G_x > G_y > 1 whose x groups cross nodes (axo4d.facts.run.derive.run_grid,
docs/design.md 2.2): the same ranks, every layer pair turned, the trainer and perfmodel agreeing."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from axo4d.config import ModelConfig, model_from_name
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import AXES, Grid
from axo4d.facts.orientation import flipped, pair_bytes, tensor_bytes
from axo4d.facts.parts import layer_pairs
from axo4d.facts.run.derive import exchange_note, inside_node, run_grid
from perfmodel.machine import load_machine
from perfmodel.model import estimate

GPT = ModelConfig(n_layer=2, n_embd=64, n_head=8, vocab_size=256, seq_len=16)
LLAMA = ModelConfig(
    arch="llama", n_layer=2, n_embd=64, n_head=8, n_kv_head=4, ffn_hidden=96, vocab_size=256, seq_len=16
)
GRIDS = [
    Grid(x=4, y=2),
    Grid(data=2, x=4, y=2, z=2),
    Grid(data=2, x=4, y=2, z=2, order=("z", "y", "data", "x"), expert=2),
    Grid(x=3, y=2, z=2, order=("data", "x", "z", "y")),
]


@pytest.mark.parametrize("grid", GRIDS, ids=[f"{g.spec()}-{','.join(g.order)}" for g in GRIDS])
def test_exchanged_grid_has_the_same_ranks_with_x_and_y_swapped(grid):
    ex = grid.with_xy_exchanged()
    assert (ex.x, ex.y, ex.data, ex.z, ex.expert) == (grid.y, grid.x, grid.data, grid.z, grid.expert)
    assert ex.with_xy_exchanged() == grid
    swap = {"x": "y", "y": "x"}
    for r in range(grid.world_size):
        c, e = grid.coords(r), ex.coords(r)
        assert e == {a: c[swap.get(a, a)] for a in AXES}
        for n in range(1, 4):
            for axes in itertools.combinations(AXES, n):
                mirrored = tuple(swap.get(a, a) for a in axes)
                assert set(ex.group_ranks(r, axes)) == set(grid.group_ranks(r, mirrored)), (r, axes)


@pytest.mark.parametrize("cfg", [GPT, LLAMA], ids=["gpt", "llama"])
def test_the_exchange_turns_every_pair(cfg):
    """On the exchanged grid each pair sends what the pair turned sends on the grid asked
    (design.md 2.2's formula, test_orientation.test_pair_bytes_formula): exchanging x and y is
    turning every pair (and the residual stream's order with them)."""
    for grid in (Grid(x=4, y=2), Grid(x=8, y=2), Grid(x=4, y=2, z=2)):
        asked, ex = model_spec(cfg, grid), model_spec(cfg, grid.with_xy_exchanged())
        for (a, b), (c, d) in zip(layer_pairs(asked.block), layer_pairs(ex.block)):
            assert pair_bytes(c, d, ex.grid) == pytest.approx(pair_bytes(*flipped(a, b), grid))
            assert pair_bytes(c, d, ex.grid) < pair_bytes(a, b, grid)
        assert tensor_bytes(ex, cfg.seq_len) < tensor_bytes(asked, cfg.seq_len)


def test_when_the_start_up_exchanges():
    g = Grid(x=4, y=2)
    assert inside_node(g, "x", 4) and not inside_node(g, "x", 2) and not inside_node(g, "y", 4)
    assert run_grid(GPT, g, 1) == Grid(x=2, y=4, order=("y", "x", "z", "data"))  # x across nodes
    assert run_grid(GPT, g, 4) == g  # x inside a node: the wide activations stay on its links
    assert run_grid(GPT, g, 8) == g
    for same in (Grid(x=2, y=4), Grid(x=4), Grid(y=4), Grid(x=2, y=2), Grid(data=8)):
        assert run_grid(GPT, same, 1) == same  # x not larger than y, or one tensor axis
    # the exchanged grid must divide the model: 4 kv heads on y=8 do not
    assert run_grid(LLAMA, Grid(x=8, y=2), 1) == Grid(x=8, y=2)
    ex = run_grid(GPT, g, 1)
    assert run_grid(GPT, ex, 1) == ex  # what it gives is kept
    assert "runs as data=1,x=2,y=4,z=1 in order y,x,z,data" in exchange_note(g, ex)
    assert exchange_note(g, g) == ""


def test_perfmodel_prices_the_grid_the_trainer_runs():
    """perfmodel's estimate of a grid whose x crosses nodes is the estimate of the exchanged grid given
    directly (the same ranks, x below y: nothing exchanged), reported on the axes of the grid asked."""
    model = dataclasses.replace(model_from_name("gpt-5b"), seq_len=1024)
    m = load_machine("alps")
    asked = Grid(data=2, x=4, y=2, order=("y", "x", "z", "data"))  # x's groups span two 4-GPU nodes
    direct = asked.with_xy_exchanged()
    a = estimate(model, asked, 32, m, gpus_per_node=4)
    d = estimate(model, direct, 32, m, gpus_per_node=4)
    assert a.grid == asked and d.grid == direct
    assert a.runs_as == "data=2,x=2,y=4,z=1 order x,y,z,data" and d.runs_as == ""  # the table's note
    assert a.step_time_s == d.step_time_s and a.memory_bytes == d.memory_bytes
    assert a.comm_s == {"x": d.comm_s["y"], "y": d.comm_s["x"], "z": d.comm_s["z"], "data": d.comm_s["data"]}
    assert a.exposed_by_axis["y"] == d.exposed_by_axis["x"]
    assert {(k[0], k[1]): v for k, v in a.bytes_per_rank.items()} == {
        ({"x": "y", "y": "x"}.get(k[0], k[0]), k[1]): v for k, v in d.bytes_per_rank.items()
    }
    on = lambda e, axis: sum(v for (g, _), v in e.bytes_per_rank.items() if g == axis)  # noqa: E731
    assert on(a, "y") > on(a, "x")  # the wide activations on y's links, inside the node
    kept = estimate(model, Grid(data=2, x=4, y=2), 32, m, gpus_per_node=4)  # x inside a node: as asked
    assert on(kept, "x") > on(kept, "y")  # the wide activations on x
    assert on(a, "x") + on(a, "y") < on(kept, "x") + on(kept, "y")


def test_a_ranking_shares_the_exchanged_answer_on_the_axes_asked():
    """perfmodel.plan.LinkMemo answers plans of the same sizes and links once: the exchanged grid and
    the same ranks given directly share the answer, each reported on its own axes."""
    from perfmodel.plan import LinkMemo, Options, plan

    model = dataclasses.replace(model_from_name("gpt-5b"), seq_len=1024)
    m = load_machine("alps")
    asked = Grid(data=2, x=4, y=2, order=("y", "x", "z", "data"))
    o = Options(gpus_per_node=4)
    memo = LinkMemo()
    d = memo(plan(model, asked.with_xy_exchanged(), 32, m, o))
    a = memo(plan(model, asked, 32, m, o))
    assert len(memo.answers) == 2 and a.grid == asked
    assert (a.comm_s["x"], a.comm_s["y"]) == (d.comm_s["y"], d.comm_s["x"]) and a.step_time_s == d.step_time_s
    again = memo(plan(model, asked, 32, m, o))
    assert again.comm_s == a.comm_s and len(memo.answers) == 2
