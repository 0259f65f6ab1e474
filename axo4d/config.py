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
from typing import Any, Literal

import yaml

from axo4d.errors import ConfigError

CONFIG_DIR = Path(__file__).parent / "configs"
#: words ``parallel.cache_weights`` takes besides a number of blocks
CACHE_WEIGHTS_WORDS = ("off", "false", "none", "", "all", "on", "true", "auto")


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "gpt"
    """A registered architecture (the entries of axo4d.archs, e.g. 'gpt': GPT-2 style, 'llama': Llama
    3.x); an unknown one is one error naming the registered ones."""
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
    """Norm epsilon (LayerNorm; RMSNorm for 'llama')."""
    init_std: float = 0.02
    """Std of the normal init of weights (residual projections scaled by 1/sqrt(2*n_layer))."""
    n_kv_head: int = 0
    """Key/value heads of grouped-query attention ('llama'; 0 = n_head); must divide n_head and by G_y."""
    head_dim: int = 0
    """Size of one attention head (0 = n_embd / n_head)."""
    ffn_hidden: int = 0
    """MLP hidden size (0 = ffn_mult * n_embd); for 'llama' the width of gate and up each."""
    tie_embeddings: bool = False
    """'llama': the token embedding is the LM head's weight (looked up vocabulary-parallel)."""
    rope_theta: float = 10000.0
    """RoPE base ('llama')."""
    rope_scaling: Literal["", "llama3"] = ""
    """RoPE frequency scaling: '' (none) or 'llama3' (Llama 3.1's, with the rope_* fields below)."""
    rope_factor: float = 8.0
    """'llama3' scaling: factor applied to low frequencies."""
    rope_low_freq_factor: float = 1.0
    """'llama3' scaling: low_freq_factor."""
    rope_high_freq_factor: float = 4.0
    """'llama3' scaling: high_freq_factor."""
    rope_original_max_positions: int = 8192
    """'llama3' scaling: original_max_position_embeddings of pre-training."""


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"
    """'stdlib' (the Python standard library's .py sources, no download), a directory of
    text files (and/or .jsonl files), a text file, a .jsonl file (one document per line, its
    text in ``text_field``), or a memory-mapped token file (.bin/.u16/.u32/.npy)."""
    tokenizer: str = "byte"
    """'byte' (vocabulary 256) or the path to a HuggingFace tokenizer.json (or its folder).
    With a tokenizer that has an end-of-text token, documents are separated by it."""
    text_field: str = "text"
    """The field holding a document's text in .jsonl sources."""
    token_dtype: Literal["auto", "uint16", "uint32"] = "auto"
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
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
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
    """torch.compile each block, and the head with its loss (axo4d.models.apply_compile)."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s per device that MFU is against (0 = the vendor's dense bf16 peak of a known GPU,
    axo4d.training.perf; none on a CPU). The fraction of the measured GEMM ceiling is reported beside it."""
    tensorboard: bool = False
    """Also write TensorBoard event files into the output folder (needs the tensorboard package)."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """On a non-finite loss: 'stop' (exit with an error) or 'skip' (skip the step)."""
    nonfinite_max_consecutive: int = 5
    """With nonfinite='skip': stop with an error when this many steps in a row were skipped (0 = no limit)."""
    nonfinite_max_total: int = 20
    """With nonfinite='skip': stop with an error when this many steps of the run were skipped
    (counted since the start or the resume; 0 = no limit)."""
    offload: Literal["none", "optimizer", "auto"] = "none"
    """Optimizer state in host memory: 'none', 'optimizer' (fp32 master weights and Adam moments
    in (pinned) host memory, AdamW on the CPU per gradient bucket, the weights on the device in
    the compute dtype) or 'auto' (on the device as far as the memory model fits, the rest offloaded)."""
    memory_budget_gb: float = 0.0
    """Device memory per rank in GiB (0 = the GPU's total memory; on CPU: no check). A run the
    memory model predicts not to fit stops before allocating; offload 'auto' fills it."""
    host_memory_gb: float = 0.0
    """Host memory per rank for offloaded state in GiB (0 = the node's available memory shared
    by the ranks on the node)."""
    goldfish_k: int = 0
    """Goldfish loss (docs/design.md section 8): drop target token i from the loss when a hash of
    the goldfish_h tokens before it is 0 mod k, about 1/k of the targets, the same on every grid and
    rerun (0 = off; k >= 2). Dropped targets count in neither the loss sum nor the token count;
    validation loss stays the full loss."""
    goldfish_h: int = 13
    """Goldfish context width h >= 1: the tokens hashed to decide whether the next one is dropped
    (the first h tokens of a sample are never dropped)."""
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"
    """FP8 training (docs/fp8.md): the forward, dX and dW GEMMs of the linear layers that
    train.fp8_layers picks run as scaled FP8 GEMMs with dynamic scales, torchao's recipe of this
    name ('tensorwise': e4m3, output gradients e5m2, one scale per tensor; 'rowwise': e4m3, one scale
    per row/column), outputs in the compute dtype, weight blocks gathered over z in FP8; masters,
    optimizer, gradient reductions and checkpoints stay fp32. 'off': none."""
    fp8_layers: Literal["auto", "blocks", "all"] = "auto"
    """With train.fp8: 'auto' (the block layers whose local GEMM shape pays in FP8, torchao's
    thresholds; the LM head stays in the compute dtype), 'blocks' (every block layer) or 'all'
    (the block layers and the LM head)."""


@dataclass(frozen=True)
class ParallelConfig:
    grid: str = "data=1"
    """Grid spec 'data=..,x=..,y=..,z=..' (missing axes are 1); the product is the world size."""
    order: str = "x,y,z,data"
    """Rank layout, fastest axis first."""
    backend: Literal["auto", "nccl", "gloo", "mpi"] = "auto"
    """'auto' (nccl with CUDA, else gloo), 'nccl', 'gloo' or 'mpi'."""
    timeout_s: float = 30.0
    """Collective timeout in seconds once training runs (from the second step on): a rank that
    hangs makes the others stop after this long, naming the rank, axis and operation."""
    init_timeout_s: float = 600.0
    """Collective timeout in seconds at start-up (process group, data preparation on rank 0,
    resume, the first step with its compilation and tuning) and during checkpoint saves."""
    overlap: bool = True
    """Overlap non-blocking collectives with compute."""
    tuner: bool = True
    """Time GEMM layout variants per layer and keep the fastest (axo4d.nn.tuner; agreed over all ranks)."""
    tuner_cache: str = ""
    """JSON file of tuner decisions ('' = <cache_dir>/blas_tuner.json)."""
    dp_bucket_mb: str = "auto"
    """Size of the data-parallel gradient buckets (all-reduced, or reduce-scattered with the sharded
    optimizer, as soon as their gradients are final): 'auto' (from the model and grid: about four
    buckets a block, at least 1 MiB per rank of the group, at most 25 MiB; the rule:
    axo4d.schedule_facts, docs/design.md section 3) or a size in MiB for every group."""
    shard_optimizer: Literal["auto", "true", "false"] = "auto"
    """Sharded optimizer (ZeRO-1): gradients reduce-scattered over each bucket's axes (data, and z
    for replicated parameters) instead of all-reduced, AdamW state of 1/G of every piece per rank,
    new weights all-gathered: 'auto' (on when G_data > 1), 'true' or 'false'."""
    cache_weights: str = "off"
    """Keep each gathered z weight block from forward for backward (and recompute), so those
    all-gathers disappear, at one block of memory per cached layer: 'off', 'all', a number N
    (the last N blocks and the LM head), or 'auto' (as many as the memory model fits; chosen by
    python -m axo4d.train)."""
    machine: str = ""
    """perfmodel machine (bundled name such as 'perlmutter', or a machine YAML) for --grid auto,
    cache_weights=auto and the predicted step time; '' = a short profile of this job's own
    groups taken at start-up (only when one of those needs it)."""


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
def _choice(value: Any, choices: tuple, key: str) -> str:
    """A ``Literal`` field: the value (YAML's booleans and numbers read as their words) if it is one
    of ``choices``, else one error naming the key, the value and the valid ones."""
    v = ("true" if value else "false") if isinstance(value, bool) else value
    v = str(v) if isinstance(v, (int, float)) else v
    if v in choices:
        return v
    valid = ", ".join(repr(c) if c == "" else str(c) for c in choices)
    raise ConfigError(f"{key}={value!r}; valid: {valid}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert ``value`` to the field type ``tp``; error names ``key``."""
    if typing.get_origin(tp) is Literal:
        return _choice(value, typing.get_args(tp), key)
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
        if isinstance(value, bool):  # YAML reads true/false/on/off/yes/no as booleans
            return "true" if value else "false"
        if isinstance(value, (str, int, float)):
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
            f"{prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(names))}"
        )
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


def resolve_named_yaml(
    name_or_path: str | os.PathLike, folder: Path, what: str, error: type[Exception] = ConfigError
) -> Path:
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


def load_config(name_or_path: str = "tiny", overrides: list[str] | None = None, grid: str | None = None) -> RunConfig:
    """Load a named config or YAML file, apply ``--set`` overrides and ``--grid``."""
    path = resolve_config_path(name_or_path)
    raw = _load_raw(path)
    raw.setdefault("name", path.stem)
    raw = _merge(raw, parse_overrides(overrides or []))
    if grid is not None:
        raw = _merge(raw, {"parallel": {"grid": grid}})
    return _build(RunConfig, raw)


def parse_bucket_mb(setting: str | float) -> float | None:
    """``parallel.dp_bucket_mb``: ``None`` for 'auto', else the size in MiB (> 0); ConfigError
    (a ValueError) naming the value otherwise."""
    s = str(setting).strip().lower()
    if s == "auto":
        return None
    try:
        mb = float(s)
    except ValueError:
        mb = float("nan")
    if not 0 < mb < float("inf"):
        raise ConfigError(f"parallel.dp_bucket_mb={setting!r}; valid: auto, or a size in MiB > 0 (such as 25)")
    return mb


def _bucket_ok(setting: str) -> bool:
    try:
        parse_bucket_mb(setting)
    except ConfigError:
        return False
    return True


def check_values(cfg: RunConfig) -> None:
    """Ranges and choices the field types cannot rule out; :class:`ConfigError` naming the first bad
    value and what would be valid. (Model shapes against themselves and the grid: axo4d.spec.)"""
    t, d, p, c = cfg.train, cfg.data, cfg.parallel, cfg.checkpoint
    checks = [
        (t.steps >= 1, f"train.steps={t.steps} must be >= 1"),
        (
            t.nonfinite_max_consecutive >= 0,
            f"train.nonfinite_max_consecutive={t.nonfinite_max_consecutive} must be >= 0 (0 = no limit)",
        ),
        (t.nonfinite_max_total >= 0, f"train.nonfinite_max_total={t.nonfinite_max_total} must be >= 0 (0 = no limit)"),
        (t.log_interval >= 1, f"train.log_interval={t.log_interval} must be >= 1"),
        (t.eval_interval >= 0, f"train.eval_interval={t.eval_interval} must be >= 0 (0 = only at the end)"),
        (t.eval_batches >= 1, f"train.eval_batches={t.eval_batches} must be >= 1"),
        (
            t.warmup_steps >= 0 and t.decay_steps >= 0,
            f"train.warmup_steps={t.warmup_steps} and train.decay_steps={t.decay_steps} must be >= 0",
        ),
        (t.lr > 0 and t.min_lr >= 0, f"train.lr={t.lr} must be > 0 and train.min_lr={t.min_lr} >= 0"),
        (t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 = off)"),
        (t.goldfish_k != 1, "train.goldfish_k=1 would drop every token; use 0 (off) or k >= 2 (drops about 1/k)"),
        (t.goldfish_k >= 0, f"train.goldfish_k={t.goldfish_k} must be 0 (off) or >= 2 (drops about 1/k of the tokens)"),
        (t.goldfish_h >= 1, f"train.goldfish_h={t.goldfish_h} must be >= 1 (tokens hashed before each target)"),
        (0.0 < d.val_fraction < 1.0, f"data.val_fraction={d.val_fraction} must be strictly between 0 and 1"),
        (d.max_tokens >= 0, f"data.max_tokens={d.max_tokens} must be >= 0 (0 = all tokens)"),
        (p.timeout_s > 0, f"parallel.timeout_s={p.timeout_s} must be > 0 (seconds)"),
        (p.init_timeout_s > 0, f"parallel.init_timeout_s={p.init_timeout_s} must be > 0 (seconds)"),
        (_bucket_ok(p.dp_bucket_mb), f"parallel.dp_bucket_mb={p.dp_bucket_mb}; valid: auto, or a size in MiB > 0"),
        (
            p.cache_weights.strip().lower() in CACHE_WEIGHTS_WORDS or p.cache_weights.strip().isdigit(),
            f"parallel.cache_weights={p.cache_weights!r}; valid: off, all, auto, or a number of blocks N (the last N)",
        ),
        (c.interval >= 0, f"checkpoint.interval={c.interval} must be >= 0 (0 = only at the end)"),
        (c.keep >= 0, f"checkpoint.keep={c.keep} must be >= 0 (0 = keep all)"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)


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
