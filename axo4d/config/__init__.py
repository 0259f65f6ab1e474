"""Run configuration: YAML loaded into frozen dataclasses.

Every field carries a docstring (the string literal under it). Unknown keys, wrong types, choices
outside a field's ``Literal`` and malformed ``--set`` overrides are :class:`ConfigError` naming the
key and what would be valid. Named configs live in ``axo4d/configs/*.yaml``.

* :mod:`axo4d.config.schema` -- the dataclasses (what a run config holds);
* :mod:`axo4d.config.loader` -- files, ``base:`` inheritance, ``--set``, ``--grid``, coercion, dumping;
* :mod:`axo4d.config.checks` -- ranges the types cannot rule out (:func:`check_values`).
"""

from axo4d.config.checks import check_values, parse_bucket_mb, signal_names
from axo4d.config.errors import ConfigError
from axo4d.config.loader import (
    _build,
    config_from_dict,
    config_to_dict,
    default_cache_dir,
    dump_config,
    field_docs,
    load_config,
    model_from_name,
    named_configs,
    parse_overrides,
    resolve_config_path,
    resolve_named_yaml,
    user_model_keys,
)
from axo4d.config.schema import (
    CACHE_WEIGHTS_WORDS,
    CONFIG_DIR,
    FLOAT32_MAX,
    INT_MAX,
    STOP_SIGNALS,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    SourceConfig,
    TrainConfig,
)

__all__ = [
    "CACHE_WEIGHTS_WORDS",
    "CONFIG_DIR",
    "FLOAT32_MAX",
    "INT_MAX",
    "STOP_SIGNALS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "SourceConfig",
    "TrainConfig",
    "_build",
    "check_values",
    "config_from_dict",
    "config_to_dict",
    "default_cache_dir",
    "dump_config",
    "field_docs",
    "load_config",
    "model_from_name",
    "named_configs",
    "parse_bucket_mb",
    "parse_overrides",
    "resolve_config_path",
    "resolve_named_yaml",
    "signal_names",
    "user_model_keys",
]
