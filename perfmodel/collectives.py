"""Ring alpha-beta cost of collectives, and the byte-counting convention.

Three collective kinds are modelled, each on a group of ``p`` ranks with a
bandwidth ``gbps`` (GB/s, 1 GB = 1e9 bytes) and a per-step latency ``alpha``
(seconds). ``nbytes`` is always the *logical message size* ``n``:

- ``all_gather``: the full, gathered output (``p`` times each rank's input);
- ``reduce_scatter``: the full, pre-scatter input;
- ``all_reduce``: the input (= output) tensor.

Ring algorithm costs (zero when ``p == 1``)::

    all-gather / reduce-scatter:  (p-1)*alpha +  (p-1)/p * n / BW
    all-reduce:                  2(p-1)*alpha + 2(p-1)/p * n / BW
    all-to-all (pairwise):        (p-1)*alpha +  (p-1)/p * n / BW   (n: the whole input, rows kept included)

:func:`counted_bytes` is the convention shared with the communication layer:
it turns one call's *input* tensor size into the logical ``n`` counted by the
performance model's ``bytes_per_rank``, so measured and modelled byte counts
compare one to one.
"""

from __future__ import annotations

ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
ALL_TO_ALL = "all_to_all"
KINDS: tuple[str, ...] = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)
"""The kinds a machine file may give its own bandwidth (``by_kind``); an all-to-all uses the
all-gather's (:func:`link_kind`)."""

GB = 1e9
"""Bytes in a GB (bandwidths are GB/s, decimal)."""


def _check(kind: str, p: int) -> None:
    if kind not in KINDS and kind != ALL_TO_ALL:
        raise ValueError(f"unknown collective {kind!r}; valid: {', '.join(KINDS + (ALL_TO_ALL,))}")
    if p < 1:
        raise ValueError(f"group size must be >= 1, got {p}")


def link_kind(kind: str) -> str:
    """The kind whose bandwidth and latency a collective is priced on (the all-gather's for an
    all-to-all: both send ``(p-1)/p`` of ``n`` in ``p-1`` steps)."""
    return ALL_GATHER if kind == ALL_TO_ALL else kind


def latency_steps(kind: str, p: int) -> int:
    """Number of ring steps (each paying ``alpha``): p-1, or 2(p-1) for all-reduce."""
    _check(kind, p)
    return 2 * (p - 1) if kind == ALL_REDUCE else p - 1


def volume_factor(kind: str, p: int) -> float:
    """Fraction of ``n`` each rank sends in a ring: (p-1)/p, or 2(p-1)/p for all-reduce."""
    _check(kind, p)
    f = (p - 1) / p
    return 2 * f if kind == ALL_REDUCE else f


def ring_bytes(kind: str, nbytes: float, p: int) -> float:
    """Bytes each rank sends (and receives) in the ring for a message of ``nbytes``."""
    return volume_factor(kind, p) * nbytes


def collective_time(kind: str, nbytes: float, p: int, gbps: float, alpha_s: float) -> float:
    """Seconds for one ``kind`` collective of logical size ``nbytes`` on ``p`` ranks."""
    _check(kind, p)
    if p == 1:
        return 0.0
    if gbps <= 0:
        raise ValueError(f"bandwidth must be > 0 GB/s, got {gbps}")
    return latency_steps(kind, p) * alpha_s + ring_bytes(kind, nbytes, p) / (gbps * GB)


def all_gather_time(nbytes: float, p: int, gbps: float, alpha_s: float) -> float:
    """Ring all-gather: ``(p-1)*alpha + (p-1)/p * n/BW``; ``n`` = gathered size."""
    return collective_time(ALL_GATHER, nbytes, p, gbps, alpha_s)


def reduce_scatter_time(nbytes: float, p: int, gbps: float, alpha_s: float) -> float:
    """Ring reduce-scatter: ``(p-1)*alpha + (p-1)/p * n/BW``; ``n`` = full input size."""
    return collective_time(REDUCE_SCATTER, nbytes, p, gbps, alpha_s)


def all_reduce_time(nbytes: float, p: int, gbps: float, alpha_s: float) -> float:
    """Ring all-reduce: ``2(p-1)*alpha + 2(p-1)/p * n/BW``."""
    return collective_time(ALL_REDUCE, nbytes, p, gbps, alpha_s)


def counted_bytes(kind: str, input_nbytes: int, group_size: int) -> int:
    """Bytes one call contributes to ``bytes_per_rank`` (the counting convention).

    ``input_nbytes`` is the byte size of the tensor the rank passes *in*:

    - ``all_reduce``: ``input_nbytes`` (the reduced tensor);
    - ``all_gather``: ``input_nbytes * group_size`` (the full gathered output);
    - ``reduce_scatter``: ``input_nbytes`` (the full, pre-scatter input).

    A call on a group of one rank moves nothing and counts 0. Counts are
    per rank and per training step, summed over calls, keyed by
    ``(group, kind)`` where ``group`` is :func:`group_name` of its axes.
    """
    _check(kind, group_size)
    if group_size == 1:
        return 0
    return input_nbytes * group_size if kind == ALL_GATHER else input_nbytes


def axis_of(axes: tuple[str, ...]) -> str:
    """The grid axis a group's time is reported under: ``data`` for any group over data or its
    expert sub-axes (``ep``, ``edp``), else its first axis."""
    return "data" if any(a in ("data", "ep", "edp") for a in axes) else axes[0]


def group_name(axes: tuple[str, ...] | list[str] | str) -> str:
    """Key of a group in ``bytes_per_rank``: its axes joined by ',' (``'data,z'``)."""
    return axes if isinstance(axes, str) else ",".join(axes)
