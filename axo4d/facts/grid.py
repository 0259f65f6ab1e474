"""The 4D process grid ``G_data x G_x x G_y x G_z``: pure rank arithmetic.

A :class:`Grid` is an immutable value. It knows nothing about process groups;
:class:`axo4d.dist.comm.Comm` builds those from it. The performance model uses the same
object (``stride``, ``group_ranks``) so training and the model agree on which
ranks share a group.

Default order: x fastest, then y, z, data::

    rank = x + G_x * (y + G_y * (z + G_z * d))

Expert parallelism (``parallel.expert`` = ``G_ep``, a divisor of ``G_data``) cuts the data axis
in two sub-axes, ``d = ep + G_ep * edp``: ``ep`` (the expert group: ``G_ep`` consecutive data
ranks, which hold disjoint experts and exchange tokens) and ``edp`` (the ``G_data/G_ep`` ranks
at the same position of every expert group, which hold copies of the same experts and sum their
gradients). They are axes like the others for :meth:`Grid.size`, :meth:`Grid.group_ranks`,
:meth:`Grid.group_index` and :meth:`Grid.all_groups`; :meth:`Grid.coords` gives the four axes.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

from axo4d.config.errors import GridError

AXES: tuple[str, ...] = ("data", "x", "y", "z")
EXPERT_AXES: tuple[str, ...] = ("ep", "edp")
"""The two sub-axes of ``data`` under expert parallelism (module docstring): ``data = ep x edp``."""
DEFAULT_ORDER: tuple[str, ...] = ("x", "y", "z", "data")


def _parse_order(order: str | Iterable[str] | None) -> tuple[str, ...]:
    if order is None:
        return DEFAULT_ORDER
    items = [s.strip() for s in order.split(",")] if isinstance(order, str) else list(order)
    if sorted(items) != sorted(AXES):
        raise GridError(
            f"grid order {','.join(items)!r} is not a permutation of the axes "
            f"{','.join(AXES)} (fastest first, e.g. 'x,y,z,data')"
        )
    return tuple(items)


@dataclass(frozen=True)
class Grid:
    """Sizes of the four axes and the order in which ranks are laid out.

    ``order`` lists the axes fastest-varying first.
    """

    data: int = 1
    x: int = 1
    y: int = 1
    z: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER
    expert: int = 1
    """``G_ep``: ranks of an expert group, consecutive on the data axis (``parallel.expert``)."""

    def __post_init__(self) -> None:
        for axis in AXES:
            v = getattr(self, axis)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise GridError(f"grid axis {axis}={v!r} must be an integer >= 1")
        object.__setattr__(self, "order", _parse_order(self.order))
        e = self.expert
        if isinstance(e, bool) or not isinstance(e, int) or e < 1 or self.data % e:
            raise GridError(
                f"parallel.expert={e!r} must divide G_data={self.data} (an expert group is that many "
                f"consecutive ranks of the data axis); valid: {', '.join(map(str, divisors(self.data)))}"
            )

    # ---- construction -------------------------------------------------
    @classmethod
    def parse(cls, spec: str, order: str | Iterable[str] | None = None, expert: int = 1) -> Grid:
        """Build a grid from ``'data=2,x=2,y=1,z=2'``; missing axes are 1; ``expert``: ``G_ep``.

        ``'1'`` or ``''`` gives the single-process grid.
        """
        spec = (spec or "").strip()
        sizes: dict[str, int] = {}
        if spec not in ("", "1"):
            for part in spec.split(","):
                m = re.fullmatch(r"\s*([a-z]+)\s*=\s*(-?\d+)\s*", part)
                if not m:
                    raise GridError(
                        f"malformed grid spec {spec!r} at {part!r}: expected comma-separated "
                        f"AXIS=N with AXIS in {','.join(AXES)}, e.g. 'data=2,x=2,y=1,z=2'"
                    )
                axis, n = m.group(1), int(m.group(2))
                if axis not in AXES:
                    raise GridError(f"unknown grid axis {axis!r} in {spec!r}; valid axes: {', '.join(AXES)}")
                if axis in sizes:
                    raise GridError(f"grid axis {axis!r} given twice in {spec!r}")
                sizes[axis] = n
        return cls(**sizes, order=_parse_order(order), expert=expert)

    # ---- sizes ----------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.data * self.x * self.y * self.z

    def size(self, *axes: str) -> int:
        """Product of the sizes of ``axes`` (a combined group's size)."""
        if len(axes) == 1 and axes[0] in AXES:  # one axis of the grid: the common case, checked at once
            return getattr(self, axes[0])
        n = 1
        for a in self._check_axes(axes):  # a plain loop: torch.compile traces it (a generator breaks the graph)
            n *= self._sub(a)
        return n

    def _sub(self, axis: str) -> int:
        """Size of an axis, the data axis's sub-axes ``ep`` and ``edp`` included."""
        if axis == "ep":
            return self.expert
        if axis == "edp":
            return self.data // self.expert
        return getattr(self, axis)

    def _sub_coords(self, rank: int) -> dict[str, int]:
        """:meth:`coords` with the data axis's sub-axes ``ep`` and ``edp``."""
        c = self.coords(rank)
        return {**c, "ep": c["data"] % self.expert, "edp": c["data"] // self.expert}

    @property
    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def spec(self) -> str:
        """The canonical spec string, ready for ``--grid``."""
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES)

    def __str__(self) -> str:
        return self.spec()

    def with_xy_exchanged(self) -> Grid:
        """The same ranks with the roles of x and y exchanged: ``G_x`` and ``G_y`` swapped and the two
        names swapped in ``order``, so every rank's x coordinate here is its y coordinate in ``self``
        (and the reverse): each x group here is a y group of ``self``, each y group an x group, every
        other group the same (``tests/unit/test_xy_roles.py``)."""
        swap = {"x": "y", "y": "x"}
        order = tuple(swap.get(a, a) for a in self.order)
        return Grid(data=self.data, x=self.y, y=self.x, z=self.z, order=order, expert=self.expert)

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours on ``axis``: the product of the
        sizes of the axes ordered before it."""
        self._check_axes((axis,))
        if axis in EXPERT_AXES:  # sub-axes of data: ep its fastest part
            return self.stride("data") * (1 if axis == "ep" else self.expert)
        n = 1
        for a in self.order[: self.order.index(axis)]:  # a plain loop over the sizes (no dict per axis)
            n *= getattr(self, a)
        return n

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise GridError(
                f"grid {self.spec()} has {self.world_size} ranks but the job has {world_size}; "
                f"choose sizes whose product is {world_size} (e.g. data={world_size})"
            )

    # ---- rank arithmetic -------------------------------------------------
    def coords(self, rank: int) -> dict[str, int]:
        """``{'data': d, 'x': i, 'y': j, 'z': k}`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise GridError(f"rank {rank} outside grid {self.spec()} of {self.world_size} ranks")
        out: dict[str, int] = {}
        for a in self.order:
            n = self.sizes[a]
            out[a] = rank % n
            rank //= n
        return {a: out[a] for a in AXES}

    def rank(self, **coords: int) -> int:
        """Inverse of :meth:`coords`; missing coordinates are 0."""
        for a, v in coords.items():
            if a not in AXES:
                raise GridError(f"unknown grid axis {a!r}; valid axes: {', '.join(AXES)}")
            if not 0 <= v < self.sizes[a]:
                raise GridError(f"coordinate {a}={v} outside 0..{self.sizes[a] - 1}")
        r = 0
        for a in reversed(self.order):
            r = r * self.sizes[a] + coords.get(a, 0)
        return r

    def group_ranks(self, rank: int, axes: Iterable[str]) -> tuple[int, ...]:
        """The ranks that differ from ``rank`` only in ``axes``, ordered by
        their (group-local) index: first listed axis fastest."""
        axes = self._check_axes(tuple(axes))
        c = self._sub_coords(rank)
        ranges = [range(self._sub(a)) for a in axes]
        out = []
        for combo in itertools.product(*reversed(ranges)):
            cc = dict(c)
            cc.update(zip(reversed(axes), combo))
            if "ep" in axes or "edp" in axes:
                cc["data"] = cc["ep"] + self.expert * cc["edp"]
            out.append(self.rank(**{a: cc[a] for a in AXES}))
        return tuple(out)

    def group_index(self, rank: int, axes: Iterable[str]) -> int:
        """This rank's index inside its ``axes`` group (first axis fastest)."""
        axes = self._check_axes(tuple(axes))
        c = self._sub_coords(rank)
        idx = 0
        for a in reversed(axes):
            idx = idx * self._sub(a) + c[a]
        return idx

    def all_groups(self, axes: Iterable[str]) -> list[tuple[int, ...]]:
        """Every ``axes`` group of the grid (a partition of all ranks), in a
        deterministic order, so all ranks create process groups identically."""
        axes = self._check_axes(tuple(axes))
        seen: set[int] = set()
        groups = []
        for r in range(self.world_size):
            if r in seen:
                continue
            g = self.group_ranks(r, axes)
            seen.update(g)
            groups.append(g)
        return groups

    def _check_axes(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        for a in axes:
            if a not in AXES and a not in EXPERT_AXES:
                raise GridError(f"unknown grid axis {a!r}; valid axes: {', '.join(AXES)}")
        if len(set(axes)) != len(axes) or ("data" in axes and ("ep" in axes or "edp" in axes)):
            raise GridError(f"axis repeated in {axes}")
        return axes


def factorizations(world_size: int, n: int = 4) -> Iterator[tuple[int, ...]]:
    """All ordered ``n``-tuples of positive integers whose product is ``world_size``."""
    if n == 1:
        yield (world_size,)
        return
    for d in divisors(world_size):
        for rest in factorizations(world_size // d, n - 1):
            yield (d, *rest)


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def all_grids(world_size: int, order: Iterable[str] | None = None) -> list[Grid]:
    """Every grid ``data*x*y*z == world_size`` (the perf model's candidates)."""
    return [Grid(data=d, x=x, y=y, z=z, order=_parse_order(order)) for d, x, y, z in factorizations(world_size, 4)]
