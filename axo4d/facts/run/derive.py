"""What a run's config means on a grid, derived once and torch-free: the numbers the trainer and the
performance model must agree on (issue 30 item 2).

:func:`derive` turns ``(config, grid)`` into :class:`RunFacts` -- the model spec, the micro-batch
and accumulation, the sequence split (``parallel.z_split``), the FP8 layers, the data-parallel
bucket limits, the optimizer mode (plain / sharded / offload) and the weight-cache blocks -- or
raises one :class:`~axo4d.config.errors.ConfigError` / :class:`~axo4d.config.errors.GridError`
naming the bad value. The training start-up (:mod:`axo4d.training.run_plan`) and ``perfmodel``
call the same functions (:func:`micro_batch`, :func:`resolve_z_split`), so they cannot disagree
on a derived number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

from axo4d.config.errors import ConfigError, GridError
from axo4d.facts.archs import model_spec
from axo4d.facts.fp8_rule import fp8_layer_names, shape_problems
from axo4d.facts.grid import Grid
from axo4d.facts.memory import shard_on_grid
from axo4d.facts.moe_parts import router_of
from axo4d.facts.orientation import tensor_bytes
from axo4d.facts.schedule_rules import bucket_limit, largest_bucket_limit
from axo4d.facts.spec import ModelSpec, cached_blocks

if TYPE_CHECKING:
    from axo4d.config import ModelConfig, ParallelConfig, RunConfig

OptimizerMode = Literal["plain", "sharded", "offload"]


def micro_batch(global_batch: int, grad_accum: int) -> int:
    """Samples of one micro-step over the whole grid: ``global_batch // grad_accum`` (the trainer,
    the memory check and ``perfmodel`` all take it from here; :func:`check_batch` says when it
    does not divide)."""
    return global_batch // max(1, grad_accum)


def split_reasons(seq_len: int, g_z: int) -> list[str]:
    """Why a sequence of ``seq_len`` tokens cannot be split over ``g_z`` ranks ([] when it can)."""
    if g_z > 1 and seq_len % (2 * g_z):
        return [f"sequence of {seq_len} tokens not divisible by 2*G_z={2 * g_z} (2 chunks per z rank)"]
    return []


def resolve_z_split(setting: str, micro: int, g_data: int, g_z: int, seq_len: int) -> tuple[str, str]:
    """``('batch' | 'sequence', why)`` for ``parallel.z_split=setting``. 'auto' splits the sequence
    when the micro-batch cannot fill ``G_data*G_z`` (it then needs only ``G_data`` to divide it):
    per-rank activations are ``micro/(G_data*G_z) * T`` token rows either way, so the batch split,
    which needs no K/V all-gather, is kept whenever it is possible."""
    if setting != "auto":
        return setting, f"parallel.z_split={setting}"
    if g_z > 1 and micro % (g_data * g_z) and not micro % g_data and not split_reasons(seq_len, g_z):
        return "sequence", f"auto: micro-batch of {micro} not divisible by G_data*G_z={g_data * g_z}"
    return "batch", "auto: the micro-batch fills G_data*G_z" if not micro % (g_data * g_z) else "auto"


def shard_setting(p: ParallelConfig) -> bool | None:
    """``parallel.shard_optimizer`` as the memory model and ``perfmodel`` take it (None: 'auto')."""
    return {"auto": None, "true": True, "false": False}[p.shard_optimizer]


def shard_optimizer_on(p: ParallelConfig, grid: Grid) -> bool:
    """``parallel.shard_optimizer`` on ``grid`` (:func:`axo4d.facts.memory.shard_on_grid`: 'auto' is
    on when G_data > 1)."""
    return shard_on_grid(grid.size("data"), shard_setting(p))


def optimizer_mode(cfg: RunConfig, grid: Grid) -> OptimizerMode:
    """'offload' (``train.offload`` not 'none'), else 'sharded' (``parallel.shard_optimizer``), else 'plain'."""
    if cfg.train.offload != "none":
        return "offload"
    return "sharded" if shard_optimizer_on(cfg.parallel, grid) else "plain"


def check_batch(global_batch: int, grad_accum: int, z_split: str, grid: Grid, seq_len: int) -> int:
    """The global micro-batch; one clear :class:`GridError` when it does not divide the grid."""
    if global_batch < 1 or grad_accum < 1:
        raise GridError(f"train.global_batch={global_batch} and train.grad_accum={grad_accum} must be >= 1")
    if global_batch % grad_accum:
        raise GridError(f"train.global_batch={global_batch} not divisible by train.grad_accum={grad_accum}")
    micro, g_z = global_batch // grad_accum, grid.size("z")
    if z_split == "sequence":  # z splits every sample's sequence
        shards, bad = grid.size("data"), split_reasons(seq_len, g_z)
        if bad:
            raise GridError(f"parallel.z_split=sequence on grid {grid.spec()}: {bad[0]}")
        if micro % shards:
            raise GridError(
                f"micro-batch of {micro} samples (global_batch/grad_accum) not divisible by G_data={shards} of "
                f"grid {grid.spec()} (parallel.z_split=sequence); use a multiple of {shards}"
            )
        return micro
    shards = grid.size("data", "z")
    if micro % shards:
        hint = " (or parallel.z_split=sequence to split each sample over z)" if g_z > 1 else ""
        raise GridError(
            f"micro-batch of {micro} samples (global_batch/grad_accum) not divisible by "
            f"G_data*G_z={shards} of grid {grid.spec()}; use a multiple of {shards}{hint}"
        )
    return micro


def fp8_rows(micro: int, seq_len: int, grid: Grid) -> int:
    """Rows of every linear layer's input on one rank and micro-step: ``micro/(G_data*G_z) * seq_len``."""
    return max(1, micro * seq_len // grid.size("data", "z"))


def fp8_of(
    spec: ModelSpec, recipe: str, layers: str, micro: int, seq_len: int, grid: Grid
) -> tuple[tuple[str, ...], list[str]]:
    """``(the linear layers that run FP8 GEMMs, why they cannot)`` for ``train.fp8=recipe`` and
    ``train.fp8_layers=layers`` on ``grid`` with a micro-batch of ``micro`` samples: the rule of
    :mod:`axo4d.facts.fp8_rule` at this run's rows per rank (:func:`fp8_rows`; they decide the
    experts' choice under 'auto') and expert group. The trainer's start-up (:func:`derive`) and
    ``perfmodel``'s plans both call it, so they mark the same layers and refuse the same grids."""
    if recipe == "off":
        return (), []
    rows = fp8_rows(micro, seq_len, grid)
    names = fp8_layer_names(spec, recipe, layers, rows=rows, g_ep=grid.expert)
    return names, shape_problems(spec, recipe, layers, rows)


def cache_blocks_of(setting: str, n_layer: int) -> int:
    """Blocks ``parallel.cache_weights = setting`` keeps ('auto' is resolved before, by the
    performance model); :class:`ConfigError` naming the setting when it is not valid."""
    try:
        return cached_blocks(setting, n_layer)
    except ValueError as e:
        raise ConfigError(str(e)) from None


#: what :meth:`RunFacts.changes_from` compares: the numbers that change how a resumed run trains
RESUME_KEYS = ("micro_batch", "grad_accum", "z_split", "optimizer")


@dataclass(frozen=True)
class RunFacts:
    """The derived numbers of one run on one grid (module docstring)."""

    spec: ModelSpec
    """The model's parts on the grid (without the sequence split's K/V gather)."""
    micro_batch: int
    """Samples of one micro-step over the whole grid (``global_batch / grad_accum``)."""
    grad_accum: int
    """Micro-steps per optimizer step."""
    z_split: str
    """'batch' or 'sequence': what z splits (``parallel.z_split`` resolved)."""
    z_split_why: str
    """Why (the setting, or what 'auto' saw)."""
    fp8_layers: tuple[str, ...]
    """The linear layers that run FP8 GEMMs (empty when ``train.fp8`` is off)."""
    bucket_limit: Callable[[tuple[str, ...]], float]
    """Data-parallel bucket limit in bytes per gradient group (``parallel.dp_bucket_mb``,
    :func:`axo4d.facts.schedule_rules.bucket_limit`): what the schedule plans buckets with."""
    buckets: tuple[tuple[str, float], ...]
    """That limit for each of the model's gradient groups, ``(axes 'data,z', bytes)``."""
    largest_bucket_bytes: float
    """The largest bucket the memory model prices."""
    optimizer: OptimizerMode
    """'plain' (AdamW on every rank), 'sharded' (over data), or 'offload' (state in host memory)."""
    shard_optimizer: bool
    """Whether the optimizer state is sharded over data (also with offload)."""
    cache_blocks: int
    """Transformer blocks whose gathered z weight blocks are kept for backward (``parallel.cache_weights``)."""
    cache_layers: int
    """Linear layers those blocks hold, plus the LM head (0 when caching is off)."""

    @property
    def split_spec(self) -> ModelSpec:
        """The spec the memory model prices: with the gathered K/V when z splits the sequence."""
        return self.spec.with_sequence_split() if self.z_split == "sequence" else self.spec

    def rows_per_rank(self, seq_len: int) -> float:
        """Token rows of one rank's micro-step (the same under both z splits)."""
        return self.micro_batch * seq_len / self.spec.grid.size("data", "z")

    def to_dict(self) -> dict:
        """Plain values (``plan.yaml``)."""
        return {
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "z_split": self.z_split,
            "z_split_why": self.z_split_why,
            "fp8_layers": list(self.fp8_layers),
            "bucket_bytes": {axes: float(b) for axes, b in self.buckets},
            "optimizer": self.optimizer,
            "cache_blocks": self.cache_blocks,
            "cache_layers": self.cache_layers,
        }

    def changes_from(self, saved: dict | None) -> list[str]:
        """``'key old -> new'`` for each of :data:`RESUME_KEYS` that differs from ``saved`` (a
        checkpoint's ``plan``, :meth:`to_dict`); [] when ``saved`` is None (an older checkpoint)."""
        now = self.to_dict()
        return [f"{k} {saved[k]} -> {now[k]}" for k in RESUME_KEYS if saved and k in saved and saved[k] != now[k]]


def derive(cfg: RunConfig, grid: Grid, spec: ModelSpec | None = None, batch: bool = True) -> RunFacts:
    """The :class:`RunFacts` of ``cfg`` on ``grid`` -- the one place they are derived -- or one
    clear error naming the bad value (the model's own numbers, the grid, the batch, FP8 shapes,
    ``parallel.cache_weights``); ``spec``: the model's spec on ``grid`` when known already (a
    variant of the same model and grid: the memory check's alternatives); ``batch=False``: the
    training batch is not checked against the grid (generation builds the model on any grid)."""
    t, p = cfg.train, cfg.parallel
    spec = model_spec(cfg.model, grid) if spec is None else spec
    if spec.checks:  # the model's own numbers, whatever the grid
        raise ConfigError("model config: " + "; ".join(f"model.{r}" for r in spec.checks))
    if grid.expert > 1 and router_of(spec.block) is None:
        raise ConfigError(
            f"parallel.expert={grid.expert} needs a mixture-of-experts model; model.arch={cfg.model.arch!r} "
            f"is dense (valid: 1)"
        )
    auto_cache = p.cache_weights.strip().lower() == "auto"
    blocks = 0 if auto_cache else cache_blocks_of(p.cache_weights, cfg.model.n_layer)
    bad = spec.divisibility_reasons()
    if bad:
        raise GridError(f"model does not fit grid {grid.spec()}: {'; '.join(bad)}")
    micro = micro_batch(t.global_batch, t.grad_accum)
    z_split, why = resolve_z_split(p.z_split, micro, grid.size("data"), grid.size("z"), cfg.model.seq_len)
    if batch:
        micro = check_batch(t.global_batch, t.grad_accum, z_split, grid, cfg.model.seq_len)
    fp8, probs = fp8_of(spec, t.fp8, t.fp8_layers, micro, cfg.model.seq_len, grid)
    if probs:
        raise ConfigError(probs[0] + (f" (and {len(probs) - 1} more)" if len(probs) > 1 else ""))
    split = spec.with_sequence_split() if z_split == "sequence" else spec
    limit = bucket_limit(p.dp_bucket_mb, spec)
    groups = sorted({tuple(pl.grad_sum) for _, pl, _ in spec.placements()})
    return RunFacts(
        spec=spec,
        micro_batch=micro,
        grad_accum=t.grad_accum,
        z_split=z_split,
        z_split_why=why,
        fp8_layers=fp8,
        bucket_limit=limit,
        buckets=tuple((",".join(g) or "none", limit(g)) for g in groups),
        largest_bucket_bytes=largest_bucket_limit(p.dp_bucket_mb, split),
        optimizer=optimizer_mode(cfg, grid),
        shard_optimizer=shard_optimizer_on(p, grid),
        cache_blocks=blocks,
        cache_layers=blocks * len(spec.linears()) + 1 if blocks else 0,
    )


# ---- x and y exchanged ---------------------------------------------------------------------------
# Which tensor axis plays x and which y on a grid with both (docs/design.md 2.2).
#
# A block's layer pairs send their wide inner activation over one tensor axis and the ``C``-wide
# residual stream over the other. On a grid with one tensor axis the pairs turn
# (:func:`axo4d.facts.orientation.orient`) so that the axis moves the narrow one. On a grid with both,
# ``G_x > G_y > 1``, turning every pair also turns the residual stream's feature order, which the
# embeddings, norms, LM head and loss read: the same thing as exchanging the two axes' roles. So the
# start-up runs the model on :meth:`~axo4d.facts.grid.Grid.with_xy_exchanged` -- the same ranks in
# every group, the larger axis now the model's y, whose collectives carry the narrow activations --
# where that sends fewer bytes (:func:`axo4d.facts.orientation.tensor_bytes` of a sample's tokens) and the model divides
# the exchanged grid as it divides the given one.
#
# Only where x's groups cross nodes: bytes are not time where the two axes sit on links of different
# speed, and inside a node the wide activations are best left where they are (x first in the rank
# order, the usual layout; on Frontier's nodes the links between GCD pairs differ, and ``perfmodel``
# priced a bytes-only exchange there up to 1.6% slower). Across nodes the exchange moves the wide
# activations onto y's links, inside a node or not, with fewer bytes on the links across nodes
# (``perfmodel``: 13 of 155 grids of gpt-5b on 256 Alps GPUs in the default order 1.2-3.9x faster,
# none slower). The trainer (:mod:`axo4d.training.startup`, ranks per node from the launcher) and
# ``perfmodel`` (its GPUs per node) ask the same :func:`run_grid`.


def inside_node(grid: Grid, axis: str, ranks_per_node: int) -> bool:
    """Whether ``axis``'s groups lie inside one node of ``ranks_per_node`` consecutive ranks
    (stride times size within a node)."""
    return grid.stride(axis) * grid.size(axis) <= ranks_per_node


def run_grid(model: ModelConfig, grid: Grid, ranks_per_node: int) -> Grid:
    """The grid the model runs on for ``grid`` (the comment above): ``grid`` itself, or the same
    ranks with x and y exchanged where ``G_x > G_y > 1``, x's groups cross nodes of
    ``ranks_per_node`` ranks, the exchange sends fewer tensor-axis bytes, and both grids divide the
    model."""
    if not grid.x > grid.y > 1 or inside_node(grid, "x", ranks_per_node):
        return grid
    ex = grid.with_xy_exchanged()
    given, other = model_spec(model, grid), model_spec(model, ex)
    if given.divisibility_reasons() or other.divisibility_reasons():
        return grid
    rows = model.seq_len  # a sample's tokens: the activations outweigh what does not scale with rows
    return ex if tensor_bytes(other, rows) < tensor_bytes(given, rows) else grid


def exchange_note(asked: Grid, grid: Grid) -> str:
    """One line saying that ``grid`` is ``asked`` with x and y exchanged ('' when it is ``asked``)."""
    if grid == asked:
        return ""
    return (
        f"x and y exchange roles: grid {asked.spec()} runs as {grid.spec()} in order {','.join(grid.order)} "
        f"(the same ranks in every group; the layer pairs send the wide activations over the {grid.x}-rank "
        "axis and fewer bytes: docs/design.md 2.2)"
    )
