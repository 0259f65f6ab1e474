"""Comm arithmetic, single-rank collectives and weight/batch sharding, in one process.

Multi-rank grids are simulated: one ``Comm(grid, rank, init_groups=False)`` per rank.
"""

import itertools

import pytest
import torch
from torch import nn

from axo4d.dist.comm import GROUP_AXES, Comm, Handle
from axo4d.dist.mappings import AllGather, AllReduce, all_reduce_sum
from axo4d.facts.grid import Grid, GridError
from axo4d.facts.placement import Block3D, placement_of
from axo4d.nn.linear import Linear3D
from tests.helpers import from_linear, full_weight, load_linear, shard_linear_weight, shard_rows


def _comms(grid: Grid) -> list[Comm]:
    return [Comm(grid, r, init_groups=False) for r in range(grid.world_size)]


# ---- arithmetic --------------------------------------------------------------------------
def test_comm_arithmetic_2x2x2():
    grid = Grid.parse("x=2,y=2,z=2")
    for rank, c in enumerate(_comms(grid)):
        x, y, z = rank % 2, (rank // 2) % 2, rank // 4  # default order: x fastest
        assert (c.coord("x"), c.coord("y"), c.coord("z"), c.coord("data")) == (x, y, z, 0)
        assert c.size("x") == c.size("y") == c.size("z") == 2
        assert c.size("data") == 1
        assert c.size(("z", "data")) == 2 and c.size(("x", "y")) == 4 and c.size(("x", "y", "z")) == 8
        assert c.index("x") == x and c.index("y") == y and c.index("z") == z and c.index("data") == 0
        assert c.index(("z", "data")) == z
        assert c.index(("x", "y")) == x + 2 * y
        assert c.index(("y", "x")) == y + 2 * x
        assert c.index(("x", "y", "z")) == rank
        # no process groups were built
        for axes in GROUP_AXES:
            assert c.group(axes) is None
        assert c.group("x") is None
        d = c.describe("all_reduce", ("x",))
        assert f"rank {rank}" in d and "axis x" in d and "x=2,y=2,z=2" in d
        assert str(list(grid.group_ranks(rank, ("x",)))) in d
    with pytest.raises(KeyError, match="no process group"):
        Comm(grid, 0, init_groups=False).group(("y", "z"))


def test_comm_arithmetic_with_data_and_order():
    grid = Grid.parse("data=2,x=3,z=2", order="data,z,x,y")
    for rank, c in enumerate(_comms(grid)):
        d, z, x = rank % 2, (rank // 2) % 2, rank // 4
        assert (c.coord("data"), c.coord("z"), c.coord("x"), c.coord("y")) == (d, z, x, 0)
        assert c.index(("z", "data")) == z + 2 * d
        assert c.size(("z", "data")) == 4
    with pytest.raises(GridError, match="rank 12 outside"):
        Comm(grid, 12, init_groups=False)


# ---- single grid: identities -------------------------------------------------------------
def test_single_grid_collectives_are_identity():
    c = Comm(Grid(), 0)  # init_groups=True, but a 1-rank world builds nothing
    t = torch.arange(6.0).reshape(2, 3)
    ref = t.clone()
    for axes in ["x", "y", "z", "data", ("z", "data"), ("x", "y", "z"), ("x", "y")]:
        assert c.all_reduce(t, axes) is t
        assert c.all_reduce(t, axes, op="max") is t
        assert c.all_gather(t, axes) is t
        assert torch.equal(c.reduce_scatter(t, axes), ref.reshape(-1))
        for fn in (c.all_reduce, c.all_gather, c.reduce_scatter):
            h = fn(t, axes, async_op=True)
            assert isinstance(h, Handle)
            assert torch.equal(h.wait().reshape(2, 3), ref)
            assert torch.equal(h.wait().reshape(2, 3), ref)  # wait twice is fine
    assert torch.equal(t, ref)
    obj = {"a": [1, 2]}
    assert c.broadcast_object(obj) is obj
    c.barrier()
    assert not c.bytes and not c.calls  # nothing counted
    assert sum(c.bytes.values()) == 0


def test_counters_reset():
    c = Comm(Grid(), 0)
    c.bytes[("x", "all_reduce")] += 8
    c.calls[("x", "all_reduce")] += 1
    c.reset_counters()
    assert not c.bytes and not c.calls


@pytest.mark.parametrize("fn", [AllGather, AllReduce])
@pytest.mark.parametrize("axes", [("x",), ("z",), ("z", "data")])
def test_autograd_primitives_identity_on_one_rank(fn, axes):
    c = Comm(Grid(), 0)
    x = torch.randn(4, requires_grad=True)
    y = fn.apply(x, c, axes)
    assert torch.equal(y.detach(), x.detach())
    g = torch.randn(4)
    (gx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(gx, g)
    assert not c.bytes and not c.calls


def test_autograd_primitive_inside_a_graph():
    c = Comm(Grid(), 0)
    x = torch.randn(3, 4, requires_grad=True)
    y = (AllReduce.apply(x * 2, c, ("y",)) ** 2).sum()
    y.backward()
    torch.testing.assert_close(x.grad, 8 * x.detach())
    t = torch.randn(3)
    assert all_reduce_sum(t, c, "x") is t
    assert all_reduce_sum(t, c, ("x", "y")) is t


# ---- weight sharding ---------------------------------------------------------------------
def _reassemble(pieces: dict[int, torch.Tensor], grid: Grid, in_axis: str, out_axis: str, n: int, k: int):
    g_in, g_out, g_z = grid.size(in_axis), grid.size(out_axis), grid.size("z")
    bn, bk = n // g_out, k // g_in
    out = torch.full((n, k), float("nan"))
    for i, j in itertools.product(range(g_out), range(g_in)):
        flat = torch.cat([pieces[grid.rank(**{out_axis: i, in_axis: j, "z": zz})] for zz in range(g_z)])
        out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = flat.view(bn, bk)
    return out


@pytest.mark.parametrize(
    "spec, n, k",
    [("x=2,y=2,z=2", 8, 12), ("x=2,y=3,z=2", 12, 6), ("data=2,x=3,y=2,z=4", 12, 18), ("z=4", 4, 6), ("1", 5, 3)],
)
@pytest.mark.parametrize("transposed", [False, True])
def test_shard_linear_weight_reassembles(spec, n, k, transposed):
    grid = Grid.parse(spec)
    in_axis, out_axis = ("y", "x") if transposed else ("x", "y")
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    comms = _comms(grid)
    pieces = {c.rank: shard_linear_weight(w, c, in_axis, out_axis) for c in comms}
    size = n * k // (grid.x * grid.y * grid.z)
    assert all(p.shape == (size,) for p in pieces.values())
    assert torch.equal(_reassemble(pieces, grid, in_axis, out_axis, n, k), w)
    # replicas over data hold the same piece; distinct (x, y, z) hold disjoint elements
    for r in range(grid.world_size):
        assert torch.equal(pieces[r], pieces[grid.rank(**{**grid.coords(r), "data": 0})])
    distinct = torch.cat([pieces[r] for r in range(grid.world_size) if grid.coords(r)["data"] == 0])
    assert sorted(distinct.tolist()) == list(range(n * k))
    # the piece is a copy, not a view into the full weight
    p0 = shard_linear_weight(w, comms[0], in_axis, out_axis)
    p0 += 1
    assert w[0, 0] == 0
    # the placement's inverse agrees, given every rank's piece
    pl = Block3D((n, k), in_axis=in_axis, out_axis=out_axis)
    assert torch.equal(pl.assemble([pieces[r] for r in range(grid.world_size)], grid), w)


def test_shard_linear_weight_explicit_2x2x2():
    grid = Grid.parse("x=2,y=2,z=2")
    w = torch.arange(16.0).reshape(4, 4)
    c = Comm(grid, grid.rank(x=1, y=0, z=1), init_groups=False)
    # non-transposed: rows (out) by y=0 -> rows 0..1, cols (in) by x=1 -> cols 2..3; block [[2,3],[6,7]]
    assert shard_linear_weight(w, c, "x", "y").tolist() == [6.0, 7.0]
    # transposed: rows by x=1 -> rows 2..3, cols by y=0 -> cols 0..1; block [[8,9],[12,13]]
    assert shard_linear_weight(w, c, "y", "x").tolist() == [12.0, 13.0]


@pytest.mark.parametrize("transposed", [False, True])
def test_linear3d_load_full_matches_shard(transposed):
    grid = Grid.parse("x=2,y=2,z=2")
    full = nn.Linear(8, 4)
    in_axis, out_axis = ("y", "x") if transposed else ("x", "y")
    pieces = {}
    for c in _comms(grid):
        lin = from_linear(full, c, transposed=transposed)
        assert lin.block_shape == (2, 4)
        assert lin.weight.numel() == 4 and lin.bias.numel() == 2
        pieces[c.rank] = lin.weight.detach().clone()
        assert torch.equal(lin.bias.detach(), full.bias.detach().chunk(2)[c.coord(out_axis)])
        s = placement_of(lin.weight)
        assert (s.in_axis, s.out_axis, s.full_shape) == (in_axis, out_axis, (4, 8))
    assert torch.equal(_reassemble(pieces, grid, in_axis, out_axis, 4, 8), full.weight.detach())


def test_linear3d_single_grid_is_nn_linear():
    torch.manual_seed(0)
    full = nn.Linear(6, 5)
    lin = from_linear(full, Comm(Grid(), 0))
    x = torch.randn(2, 3, 6, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    y, y2 = lin(x), full(x2)
    torch.testing.assert_close(y, y2)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(lin.weight.grad.view(5, 6), full.weight.grad)
    torch.testing.assert_close(lin.bias.grad, full.bias.grad)
    torch.testing.assert_close(full_weight(lin), full.weight.detach())
    with pytest.raises(ValueError, match="full weight shape"):
        load_linear(lin, torch.zeros(6, 5))


# ---- batch sharding ----------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["x=2,y=2,z=2", "data=2,z=2,x=2", "data=3,y=2", "z=4", "1"])
def test_shard_rows_concatenate_in_z_data_order(spec):
    grid = Grid.parse(spec)
    n = grid.z * grid.data
    x_full = torch.arange(n * 3 * 5, dtype=torch.float32).reshape(n * 3, 5)
    comms = _comms(grid)
    chunks = [shard_rows(x_full, comms[grid.rank(data=d, z=z)]) for d in range(grid.data) for z in range(grid.z)]
    assert all(ch.shape == (3, 5) for ch in chunks)
    assert torch.equal(torch.cat(chunks), x_full)
    # ranks that differ only in x or y get the same rows
    for r, c in enumerate(comms):
        co = grid.coords(r)
        assert torch.equal(shard_rows(x_full, c), shard_rows(x_full, comms[grid.rank(data=co["data"], z=co["z"])]))


def test_shard_rows_not_divisible():
    c = Comm(Grid.parse("data=2,z=2"), 0, init_groups=False)
    with pytest.raises(GridError) as e:
        shard_rows(torch.zeros(6, 2), c)
    assert "6" in str(e.value) and "4" in str(e.value)


# ---- Linear3D constructor errors ---------------------------------------------------------
def test_linear3d_indivisible_features():
    """Both sides of every layer are split over x and y (the activations between GEMMs, section 15):
    input and output features must divide by G_x*G_y, whichever way the layer is transposed."""
    c = Comm(Grid.parse("x=2,y=3,z=2"), 0, init_groups=False)
    with pytest.raises(GridError, match=r"qkv: input features 7 not divisible by G_x\*G_y=6"):
        Linear3D(7, 6, c, name="qkv")
    with pytest.raises(GridError, match=r"qkv: output features 8 not divisible by G_x\*G_y=6"):
        Linear3D(6, 8, c, name="qkv")
    with pytest.raises(GridError, match=r"input features 4 not divisible by G_x\*G_y=6"):
        Linear3D(4, 6, c, transposed=True)
    with pytest.raises(GridError, match=r"output features 3 not divisible by G_x\*G_y=6"):
        Linear3D(6, 3, c, transposed=True)
    lin = Linear3D(6, 12, c, transposed=True)  # 6 over y=3, 12 over x=2: block (6, 2), 12 over z=2
    assert lin.block_shape == (6, 2) and lin.weight.numel() == 6 and lin.bias.numel() == 6


def test_linear3d_block_not_divisible_by_z():
    c = Comm(Grid.parse("x=2,y=3,z=4"), 0, init_groups=False)
    with pytest.raises(GridError) as e:
        Linear3D(6, 6, c, name="proj")  # block (2, 3): 6 elements over G_z=4
    msg = str(e.value)
    assert "proj" in msg and "weight block of 6 elements" in msg and "G_z=4" in msg
    lin = Linear3D(12, 12, c, bias=False)  # block (4, 6) = 24 over 4
    assert lin.weight.numel() == 6 and lin.bias is None


def test_expert_placement_held_by_one_position_of_every_expert_group():
    """An expert's weight under expert parallelism: the ranks at its position of every expert group
    hold it (chunks covering the full tensor once per group), the others nothing; assembled from
    the holders; its norm counts each element once (split over x, y, z and ep)."""
    from axo4d.facts.placement import ExpertBlock3D

    grid = Grid.parse("data=4,x=2,z=2", expert=2)
    full = torch.arange(48.0).reshape(8, 6)
    for e in range(4):  # 4 experts over G_ep = 2: experts 0, 1 at position 0; 2, 3 at position 1
        pl = ExpertBlock3D((8, 6), expert=e, n_experts=4)
        assert pl.split == ("x", "y", "z", "ep") and pl.grad_sum == ("edp",)
        holders = [r for r in range(grid.world_size) if pl.chunks(grid, r)]
        assert holders == [r for r in range(grid.world_size) if grid.coords(r)["data"] % 2 == e // 2]
        for edp in range(2):
            cover = torch.zeros(8, 6)
            for r in holders:
                if grid.coords(r)["data"] // 2 == edp:
                    for ch in pl.chunks(grid, r):
                        cover[tuple(slice(o, o + n) for o, n in zip(ch.offsets, ch.sizes))] += 1
            assert torch.equal(cover, torch.ones(8, 6))
        nan = torch.full(pl.local_shape(grid), float("nan"))  # what a rank that holds nothing would send
        pieces = [pl.shard(full, grid, r) if r in holders else nan for r in range(16)]
        assert torch.equal(pl.assemble(pieces, grid), full)
