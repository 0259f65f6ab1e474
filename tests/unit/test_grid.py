"""Rank arithmetic of the 4D grid (docs/design.md section 1), without any process group."""

import dataclasses
import itertools
import math

import pytest

from axo4d.facts.grid import AXES, DEFAULT_ORDER, Grid, GridError, all_grids, divisors, factorizations

SHAPES = [(1, 1, 1, 1), (2, 2, 2, 2), (3, 1, 2, 4), (1, 4, 1, 2), (2, 3, 1, 1)]  # (data, x, y, z)
ORDERS = list(itertools.permutations(AXES))
# every subset of axes, each also listed in reverse (the group index depends on the listed order)
AXIS_SUBSETS = sorted({t for n in range(1, 5) for c in itertools.combinations(AXES, n) for t in (c, c[::-1])})


def _grid(shape, order=DEFAULT_ORDER) -> Grid:
    d, x, y, z = shape
    return Grid(data=d, x=x, y=y, z=z, order=order)


# ---- parse -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, sizes",
    [
        ("data=2,x=3,y=4,z=5", (2, 3, 4, 5)),
        ("x=2", (1, 2, 1, 1)),
        ("z=4,data=2", (2, 1, 1, 4)),
        ("  y = 3 ,  x=2 ", (1, 2, 3, 1)),
        ("1", (1, 1, 1, 1)),
        ("", (1, 1, 1, 1)),
        ("  ", (1, 1, 1, 1)),
        (None, (1, 1, 1, 1)),
    ],
)
def test_parse_valid(spec, sizes):
    g = Grid.parse(spec)
    assert (g.data, g.x, g.y, g.z) == sizes
    assert g.world_size == math.prod(sizes)
    assert g.order == DEFAULT_ORDER
    # the canonical spec parses back to the same grid
    assert Grid.parse(g.spec()) == g
    assert str(g) == g.spec()


def test_parse_order():
    g = Grid.parse("x=2,y=2", order="data, z, y, x")
    assert g.order == ("data", "z", "y", "x")
    assert Grid.parse("x=2", order=["z", "x", "y", "data"]).order == ("z", "x", "y", "data")
    with pytest.raises(GridError, match="not a permutation") as e:
        Grid.parse("x=2", order="x,y,z")
    assert "data" in str(e.value)
    with pytest.raises(GridError, match="not a permutation"):
        Grid.parse("x=2", order="x,y,z,w")
    with pytest.raises(GridError, match="not a permutation"):
        Grid(order=("x", "x", "z", "data"))


@pytest.mark.parametrize(
    "spec, bad",
    [
        ("x2", "x2"),  # no '='
        ("x=2,,y=2", ""),  # empty part
        ("x=1.5", "x=1.5"),  # non-integer
        ("x=two", "x=two"),
        ("x=2;y=2", "x=2;y=2"),
        ("X=2", "X=2"),  # axes are lower case
    ],
)
def test_parse_malformed(spec, bad):
    with pytest.raises(GridError, match="malformed") as e:
        Grid.parse(spec)
    msg = str(e.value)
    assert repr(bad) in msg
    assert "data,x,y,z" in msg  # names the valid axes


def test_parse_unknown_axis():
    with pytest.raises(GridError) as e:
        Grid.parse("x=2,w=2")
    msg = str(e.value)
    assert "'w'" in msg and "unknown" in msg
    for a in AXES:
        assert a in msg.split("valid axes:")[1]


def test_parse_duplicate_axis():
    with pytest.raises(GridError, match="given twice") as e:
        Grid.parse("x=2,y=2,x=4")
    assert "'x'" in str(e.value)


@pytest.mark.parametrize("spec, axis, value", [("x=0", "x", 0), ("z=-2", "z", -2), ("data=0,y=2", "data", 0)])
def test_parse_non_positive(spec, axis, value):
    with pytest.raises(GridError) as e:
        Grid.parse(spec)
    msg = str(e.value)
    assert f"{axis}={value}" in msg and ">= 1" in msg


@pytest.mark.parametrize("kw", [{"x": 0}, {"y": -1}, {"z": 1.0}, {"data": True}, {"x": "2"}])
def test_constructor_rejects_bad_sizes(kw):
    with pytest.raises(GridError, match="must be an integer >= 1"):
        Grid(**kw)


def test_grid_is_frozen_value():
    g = Grid.parse("x=2,y=2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.x = 4  # type: ignore[misc]
    assert g == Grid(x=2, y=2) and hash(g) == hash(Grid(x=2, y=2))
    assert g != Grid(x=2, y=2, order=("y", "x", "z", "data"))


# ---- rank arithmetic ---------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_coords_rank_round_trip_all_orders(shape):
    for order in ORDERS:
        g = _grid(shape, order)
        seen = set()
        for r in range(g.world_size):
            c = g.coords(r)
            assert set(c) == set(AXES)
            assert all(0 <= c[a] < g.sizes[a] for a in AXES)
            assert g.rank(**c) == r
            seen.add(tuple(c[a] for a in AXES))
        # coords is a bijection onto the full coordinate box
        assert len(seen) == g.world_size
        for c in itertools.product(*(range(g.sizes[a]) for a in AXES)):
            assert g.coords(g.rank(**dict(zip(AXES, c)))) == dict(zip(AXES, c))


@pytest.mark.parametrize("shape", SHAPES)
def test_default_order_formula(shape):
    g = _grid(shape)
    for d, x, y, z in itertools.product(range(g.data), range(g.x), range(g.y), range(g.z)):
        r = x + g.x * (y + g.y * (z + g.z * d))
        assert g.rank(data=d, x=x, y=y, z=z) == r
        assert g.coords(r) == {"data": d, "x": x, "y": y, "z": z}


def test_custom_order_formula():
    # data fastest, then z, y, x
    g = Grid(data=2, x=3, y=2, z=2, order=("data", "z", "y", "x"))
    for d, x, y, z in itertools.product(range(2), range(3), range(2), range(2)):
        assert g.rank(data=d, x=x, y=y, z=z) == d + 2 * (z + 2 * (y + 2 * x))


def test_rank_missing_coords_are_zero_and_errors():
    g = Grid.parse("data=2,x=2,y=2,z=2")
    assert g.rank() == 0
    assert g.rank(y=1) == 2
    with pytest.raises(GridError, match="x=2 outside 0..1"):
        g.rank(x=2)
    with pytest.raises(GridError, match="outside"):
        g.rank(z=-1)
    with pytest.raises(GridError, match="unknown grid axis 'w'"):
        g.rank(w=0)
    for r in (-1, 16, 100):
        with pytest.raises(GridError, match=f"rank {r} outside"):
            g.coords(r)


# ---- stride ------------------------------------------------------------------------------
def test_stride_default_order():
    g = Grid.parse("data=5,x=2,y=3,z=4")
    assert g.stride("x") == 1
    assert g.stride("y") == 2
    assert g.stride("z") == 6
    assert g.stride("data") == 24


def test_stride_custom_order():
    g = Grid.parse("data=5,x=2,y=3,z=4", order="z,data,x,y")
    assert g.stride("z") == 1
    assert g.stride("data") == 4
    assert g.stride("x") == 20
    assert g.stride("y") == 40
    with pytest.raises(GridError, match="unknown grid axis"):
        g.stride("w")


@pytest.mark.parametrize("shape", SHAPES)
def test_stride_is_rank_distance_of_neighbours(shape):
    for order in ORDERS:
        g = _grid(shape, order)
        for a in AXES:
            if g.sizes[a] == 1:
                continue
            assert g.rank(**{a: 1}) - g.rank(**{a: 0}) == g.stride(a)
            # and from any rank with coordinate 0 on a
            for r in range(g.world_size):
                c = g.coords(r)
                if c[a] + 1 < g.sizes[a]:
                    assert g.rank(**{**c, a: c[a] + 1}) - r == g.stride(a)


# ---- groups ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("order", [DEFAULT_ORDER, ("data", "z", "y", "x"), ("y", "data", "x", "z")])
def test_groups_partition_the_world(shape, order):
    g = _grid(shape, order)
    for axes in AXIS_SUBSETS:
        groups = g.all_groups(axes)
        flat = [r for grp in groups for r in grp]
        assert sorted(flat) == list(range(g.world_size))  # a partition
        assert len(groups) == g.world_size // g.size(*axes)
        for grp in groups:
            assert len(grp) == g.size(*axes)
            c0 = g.coords(grp[0])
            for i, r in enumerate(grp):
                c = g.coords(r)
                # members differ only in the given axes
                assert all(c[a] == c0[a] for a in AXES if a not in axes)
                # every member computes the same group, and its index is its position
                assert g.group_ranks(r, axes) == grp
                assert g.group_index(r, axes) == i
                # index: first listed axis fastest
                idx, mul = 0, 1
                for a in axes:
                    idx += c[a] * mul
                    mul *= g.sizes[a]
                assert idx == i


def test_group_ranks_examples():
    g = Grid.parse("data=2,x=2,y=2,z=2")
    assert g.group_ranks(0, ["x"]) == (0, 1)
    assert g.group_ranks(0, ["y"]) == (0, 2)
    assert g.group_ranks(5, ["z"]) == (1, 5)
    assert g.group_ranks(0, ["data"]) == (0, 8)
    assert g.group_ranks(0, ["z", "data"]) == (0, 4, 8, 12)  # z fastest
    assert g.group_ranks(0, ["data", "z"]) == (0, 8, 4, 12)  # data fastest
    assert g.group_ranks(3, ["x", "y"]) == (0, 1, 2, 3)
    assert g.all_groups(["x"])[:3] == [(0, 1), (2, 3), (4, 5)]
    assert g.group_index(12, ["z", "data"]) == 3
    assert g.size("x", "y", "z") == 8 and g.size() == 1
    with pytest.raises(GridError, match="repeated"):
        g.group_ranks(0, ["x", "x"])
    with pytest.raises(GridError, match="unknown grid axis 'q'"):
        g.all_groups(["q"])


# ---- world size check --------------------------------------------------------------------
def test_check_world():
    g = Grid.parse("x=2,y=3")
    g.check_world(6)
    with pytest.raises(GridError) as e:
        g.check_world(8)
    msg = str(e.value)
    assert "6" in msg and "8" in msg
    assert "has 6 ranks" in msg and "the job has 8" in msg


# ---- enumeration -------------------------------------------------------------------------
def test_divisors():
    for n in [1, 2, 7, 12, 16, 36, 97, 360, 1024]:
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def _brute_force_factorisations(p: int) -> set:
    return {t for t in itertools.product(range(1, p + 1), repeat=4) if math.prod(t) == p}


@pytest.mark.parametrize("p", [1, 2, 6, 8, 12, 16])
def test_all_grids_count_and_products(p):
    expected = _brute_force_factorisations(p)
    grids = all_grids(p)
    got = [(g.data, g.x, g.y, g.z) for g in grids]
    assert len(got) == len(set(got)) == len(expected)
    assert set(got) == expected
    assert all(g.world_size == p for g in grids)
    assert set(factorizations(p, 4)) == expected


def test_all_grids_known_counts_and_order():
    assert len(all_grids(8)) == 20
    assert len(all_grids(12)) == 40
    assert {g.order for g in all_grids(4, order=("z", "y", "x", "data"))} == {("z", "y", "x", "data")}
    assert sorted(factorizations(6, 2)) == [(1, 6), (2, 3), (3, 2), (6, 1)]


def test_expert_sub_axes_of_data():
    """``ep`` (G_ep consecutive data ranks) and ``edp`` (the same position of every expert group)
    partition the data axis, in the default and another rank order; G_ep must divide G_data."""
    for order in (None, "data,z,x,y"):
        g = Grid.parse("data=4,x=2,z=2", order, expert=2)
        assert g.size("ep") == 2 and g.size("edp") == 2 and g.size("x", "y", "z", "ep") == 8
        for r in range(g.world_size):
            c = g.coords(r)
            ep = [g.coords(q) for q in g.group_ranks(r, ("ep",))]
            edp = [g.coords(q) for q in g.group_ranks(r, ("edp",))]
            same = lambda o: all(o[a] == c[a] for a in ("x", "y", "z"))  # noqa: E731
            assert all(map(same, ep + edp))
            assert [o["data"] for o in ep] == [c["data"] // 2 * 2, c["data"] // 2 * 2 + 1]
            assert [o["data"] for o in edp] == [c["data"] % 2, c["data"] % 2 + 2]
            assert g.group_index(r, ("ep",)) == c["data"] % 2 and g.group_index(r, ("edp",)) == c["data"] // 2
        assert sorted(sum(g.all_groups(("ep",)), ())) == list(range(g.world_size))
        assert g.stride("ep") == g.stride("data") and g.stride("edp") == 2 * g.stride("data")
    for bad in (3, 0):
        with pytest.raises(GridError, match=f"parallel.expert={bad} must divide G_data=4"):
            Grid(data=4, expert=bad)
    with pytest.raises(GridError, match="repeated"):
        Grid(data=4, expert=2).size("data", "ep")
