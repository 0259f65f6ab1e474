"""The run's derived numbers (:mod:`axo4d.facts.run.derive`): a sub-package of its own because it
reads the architecture registry (:mod:`axo4d.facts.archs`), which reads the other model facts."""

from axo4d.facts.run.derive import (
    OptimizerMode,
    RunFacts,
    cache_blocks_of,
    check_batch,
    derive,
    exchange_note,
    fp8_of,
    fp8_rows,
    micro_batch,
    optimizer_mode,
    resolve_z_split,
    run_grid,
    shard_optimizer_on,
    shard_setting,
    split_reasons,
)

__all__ = [
    "RunFacts",
    "OptimizerMode",
    "derive",
    "micro_batch",
    "resolve_z_split",
    "split_reasons",
    "shard_optimizer_on",
    "shard_setting",
    "optimizer_mode",
    "check_batch",
    "fp8_rows",
    "fp8_of",
    "cache_blocks_of",
    "run_grid",
    "exchange_note",
]
