"""Run configuration: YAML loaded into frozen dataclasses.

Every field carries a docstring (the string literal under it). Unknown keys,
wrong types and malformed ``--set`` overrides are :class:`ConfigError` naming
the key and what would be valid. Named configs live in ``axo4d/configs/*.yaml``.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from axo4d.errors import ConfigError

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int = 2
    """Number of transformer blocks."""
    n_embd: int = 64
    """Hidden size ``h``; must divide by G_x and G_y."""
    n_head: int = 4
    """Attention heads; must divide by G_y and divide ``n_embd``."""
    vocab_size: int = 256
    """Tokenizer vocabulary; padded up to ``vocab_multiple * G_y`` for the LM head."""
    seq_len: int = 64
    """Sequence length (context) in tokens."""
    ffn_mult: int = 4
    """MLP hidden size is ``ffn_mult * n_embd``."""
    bias: bool = True
    """Biases in linear layers and LayerNorms."""
    vocab_multiple: int = 64
    """The padded vocabulary is a multiple of this times G_y (padding is masked)."""
    ln_eps: float = 1e-5
    """LayerNorm epsilon."""
    init_std: float = 0.02
    """Std of the normal init of weights (residual projections scaled by 1/sqrt(2*n_layer))."""


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"
    """'stdlib' (the Python standard library's .py sources, no download), a directory of
    text files, or a memory-mapped token file (.bin/.u16/.u32/.npy)."""
    tokenizer: str = "byte"
    """'byte' (vocabulary 256) or the path to a HuggingFace tokenizer.json."""
    token_dtype: str = "auto"
    """dtype of a token file: 'uint16', 'uint32' or 'auto' (from the suffix/vocabulary)."""
    val_fraction: float = 0.05
    """Fraction of the token stream (its tail) held out for validation."""
    max_tokens: int = 0
    """Use at most this many tokens of the corpus (0 = all)."""
    cache_dir: str = ""
    """Where tokenised corpora are cached ('' = $AXO4D_CACHE or ~/.cache/axo4d)."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    """Optimizer steps."""
    global_batch: int = 8
    """Samples per optimizer step, over all ranks and accumulation steps."""
    grad_accum: int = 1
    """Micro-steps per optimizer step; global_batch/grad_accum must divide by data*z."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 2
    """Linear warm-up steps."""
    decay_steps: int = 0
    """Steps of cosine decay after warm-up (0 = until the last step)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms, biases)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    seed: int = 1234
    """Seed of initialisation, data order and everything random."""
    dtype: str = "auto"
    """'auto' (bf16 autocast on GPU, fp32 on CPU), 'fp32' or 'bf16'."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward."""
    eval_interval: int = 10
    """Validation every this many steps (0 = only at the end)."""
    eval_batches: int = 2
    """Validation batches (of global_batch/grad_accum samples) per evaluation."""
    log_interval: int = 1
    """Print a line every this many steps."""
    compile: bool = False
    """Wrap blocks in torch.compile (GPU)."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s per device for MFU (0 = known GPU ceiling, or a GEMM rate measured at start)."""
    nonfinite: str = "stop"
    """On a non-finite loss: 'stop' (exit with an error) or 'skip' (skip the step)."""


@dataclass(frozen=True)
class ParallelConfig:
    grid: str = "data=1"
    """Grid spec 'data=..,x=..,y=..,z=..' (missing axes are 1); the product is the world size."""
    order: str = "x,y,z,data"
    """Rank layout, fastest axis first."""
    backend: str = "auto"
    """'auto' (nccl with CUDA, else gloo), 'nccl', 'gloo' or 'mpi'."""
    timeout_s: float = 300.0
    """Collective timeout in seconds; a hung collective fails with the group and rank."""
    overlap: bool = True
    """Overlap non-blocking collectives with compute."""
    tuner: bool = True
    """Time GEMM layout variants per layer and keep the fastest (axo4d.nn.tuner; agreed over all ranks)."""
    tuner_cache: str = ""
    """JSON file of tuner decisions ('' = <cache_dir>/blas_tuner.json)."""
    dp_bucket_mb: float = 25.0
    """Size of data-parallel gradient all-reduce buckets in MiB."""


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 0
    """Save every this many steps (0 = only at the end)."""
    keep: int = 2
    """Keep the newest this many complete checkpoints."""
    at_end: bool = True
    """Save when training ends."""


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model shape."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset and tokenizer."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Grid and communication."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    name: str = "custom"
    """Name of the config."""


# ---------------------------------------------------------------------------
def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert ``value`` to the field type ``tp``; error names ``key``."""
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} must be a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key {key!r} must be a string, got {value!r}")
    raise ConfigError(f"config key {key!r}: unsupported type {tp}")


def _build(cls: type, values: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix + str(unknown[0])!r}; valid keys under "
            f"{prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(names))}")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in values.items()}
    return cls(**kwargs)


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
    return data


def default_cache_dir(cfg: DataConfig | None = None) -> Path:
    """Where tokenised corpora and tuner decisions are cached: ``cfg.cache_dir``, else
    ``$AXO4D_CACHE``, else ``~/.cache/axo4d``."""
    d = (cfg.cache_dir if cfg is not None else "") or os.environ.get("AXO4D_CACHE", "")
    return Path(d).expanduser() if d else Path.home() / ".cache" / "axo4d"


def named_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_named_yaml(name_or_path: str | os.PathLike, folder: Path, what: str,
                       error: type[Exception] = ConfigError) -> Path:
    """A YAML file bundled in ``folder`` by its stem (``tiny``, ``perlmutter`` ...) or a path.

    Shared by configs and perfmodel machine files; ``error`` names the missing file or
    lists the bundled names.
    """
    s = str(name_or_path)
    p = Path(s)
    if p.suffix in (".yaml", ".yml") or os.sep in s:
        if not p.is_file():
            raise error(f"{what} file {s!r} does not exist")
        return p
    q = folder / f"{s}.yaml"
    if not q.is_file():
        known = ", ".join(sorted(f.stem for f in folder.glob("*.yaml")))
        raise error(f"unknown {what} {s!r}; known {what}s: {known} (or give a path to a .yaml file)")
    return q


def resolve_config_path(name_or_path: str) -> Path:
    """A named config (``tiny``, ``gpt2-124m`` ...) or a YAML path."""
    return resolve_named_yaml(name_or_path, CONFIG_DIR, "config")


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _load_raw(path: Path, depth: int = 0) -> dict:
    """Read a YAML file; a top-level ``base: NAME`` key inherits another config."""
    data = _read_yaml(path)
    base = data.pop("base", None)
    if base is not None:
        if depth > 8:
            raise ConfigError(f"config {str(path)!r}: 'base' chain too deep")
        data = _merge(_load_raw(resolve_config_path(str(base)), depth + 1), data)
    return data


def parse_overrides(items: list[str]) -> dict:
    """``['train.steps=5', 'model.n_layer=2']`` -> nested dict (values YAML-parsed)."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like section.key=value, e.g. train.steps=100")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"--set {item!r}: malformed key {key!r}")
        try:
            val = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            val = raw
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                raise ConfigError(f"--set {item!r}: {p!r} is not a section")
        d[parts[-1]] = val
    return out


def load_config(name_or_path: str = "tiny", overrides: list[str] | None = None,
                grid: str | None = None) -> RunConfig:
    """Load a named config or YAML file, apply ``--set`` overrides and ``--grid``."""
    path = resolve_config_path(name_or_path)
    raw = _load_raw(path)
    raw.setdefault("name", path.stem)
    raw = _merge(raw, parse_overrides(overrides or []))
    if grid is not None:
        raw = _merge(raw, {"parallel": {"grid": grid}})
    return _build(RunConfig, raw)


def config_from_dict(raw: dict) -> RunConfig:
    return _build(RunConfig, raw)


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False)


def field_docs(cls: type) -> dict[str, str]:
    """Field docstrings of a config dataclass (for ``--help-config``)."""
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = " ".join(str(b.value.value).split())  # type: ignore[attr-defined]
    return docs


def model_from_name(name_or_path: str) -> ModelConfig:
    """The model section of a named config or YAML (shared by perfmodel)."""
    return load_config(name_or_path).model
