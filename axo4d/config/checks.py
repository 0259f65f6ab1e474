"""Ranges the field types cannot rule out, checked once a config is loaded (:func:`check_values`)."""

from __future__ import annotations

from axo4d.config.errors import ConfigError
from axo4d.config.schema import CACHE_WEIGHTS_WORDS, FLOAT32_MAX, STOP_SIGNALS, RunConfig


def signal_names(text: str) -> list[str]:
    """``checkpoint.signals`` as signal names (``'USR1, SIGTERM'`` -> ``['SIGUSR1', 'SIGTERM']``);
    ConfigError for a name that is not one of :data:`STOP_SIGNALS`."""
    out = []
    for w in text.replace(";", ",").split(","):
        w = w.strip().upper()
        if not w:
            continue
        name = w if w.startswith("SIG") else "SIG" + w
        if name not in STOP_SIGNALS:
            raise ConfigError(f"checkpoint.signals={text!r}: {w!r} is not one of {', '.join(STOP_SIGNALS)} ('' = none)")
        out.append(name)
    return list(dict.fromkeys(out))


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


def _train_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    """``train`` (and the model floats the optimizer and layers compute with) as (ok, message) pairs."""
    t = cfg.train
    return [
        (t.steps >= 0, f"train.steps={t.steps} must be >= 0 (0: only the validation loss of the initial weights)"),
        (
            t.nonfinite_max_consecutive >= 0,
            f"train.nonfinite_max_consecutive={t.nonfinite_max_consecutive} must be >= 0 (0 = no limit)",
        ),
        (t.nonfinite_max_total >= 0, f"train.nonfinite_max_total={t.nonfinite_max_total} must be >= 0 (0 = no limit)"),
        (t.log_interval >= 1, f"train.log_interval={t.log_interval} must be >= 1"),
        (t.eval_interval >= 0, f"train.eval_interval={t.eval_interval} must be >= 0 (0 = only at the end)"),
        (t.eval_batches >= 0, f"train.eval_batches={t.eval_batches} must be >= 0 (0 = every validation sample)"),
        (
            t.warmup_steps >= 0 and t.decay_steps >= 0,
            f"train.warmup_steps={t.warmup_steps} and train.decay_steps={t.decay_steps} must be >= 0",
        ),
        (t.lr > 0 and t.min_lr >= 0, f"train.lr={t.lr} must be > 0 and train.min_lr={t.min_lr} >= 0"),
        *(
            (
                abs(v) <= FLOAT32_MAX,
                f"{k}={v:g} is beyond the largest float32 ({FLOAT32_MAX:.3g}): the optimizer and the layers "
                f"compute with it in float32",
            )
            for k, v in (
                ("train.lr", t.lr),
                ("train.min_lr", t.min_lr),
                ("train.weight_decay", t.weight_decay),
                ("train.eps", t.eps),
                ("train.grad_clip", t.grad_clip),
                ("model.init_std", cfg.model.init_std),
                ("model.ln_eps", cfg.model.ln_eps),
            )
        ),
        (
            0 <= t.beta1 < 1 and 0 <= t.beta2 < 1,
            f"train.beta1={t.beta1} and train.beta2={t.beta2} must be in [0, 1)",
        ),
        (
            t.eps > 0 and t.weight_decay >= 0,
            f"train.eps={t.eps} must be > 0 and train.weight_decay={t.weight_decay} >= 0",
        ),
        (t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 = off)"),
        (t.goldfish_k != 1, "train.goldfish_k=1 would drop every token; use 0 (off) or k >= 2 (drops about 1/k)"),
        (t.goldfish_k >= 0, f"train.goldfish_k={t.goldfish_k} must be 0 (off) or >= 2 (drops about 1/k of the tokens)"),
        (t.goldfish_h >= 1, f"train.goldfish_h={t.goldfish_h} must be >= 1 (tokens hashed before each target)"),
    ]


def _data_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    """``data`` (and ``train.epochs``) as (ok, message) pairs."""
    t, d = cfg.train, cfg.data
    return [
        (0.0 < d.val_fraction < 1.0, f"data.val_fraction={d.val_fraction} must be strictly between 0 and 1"),
        (d.max_tokens >= 0, f"data.max_tokens={d.max_tokens} must be >= 0 (0 = all tokens)"),
        (t.epochs >= 0, f"train.epochs={t.epochs} must be >= 0 (0 = train.steps decides)"),
        (
            all(s.weight >= 0 for s in d.sources),
            "data.sources weights must be >= 0: " + ", ".join(f"{s.path}: {s.weight}" for s in d.sources),
        ),
        (
            not d.sources or sum(s.weight for s in d.sources) > 0,
            "data.sources weights must sum to a positive number: "
            + ", ".join(f"{s.path}: {s.weight}" for s in d.sources),
        ),
        (all(s.path for s in d.sources), "data.sources: every source needs a path"),
    ]


def _run_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    """``parallel`` and ``checkpoint`` as (ok, message) pairs."""
    p, c = cfg.parallel, cfg.checkpoint
    return [
        (p.timeout_s > 0, f"parallel.timeout_s={p.timeout_s} must be > 0 (seconds)"),
        (p.init_timeout_s > 0, f"parallel.init_timeout_s={p.init_timeout_s} must be > 0 (seconds)"),
        (_bucket_ok(p.dp_bucket_mb), f"parallel.dp_bucket_mb={p.dp_bucket_mb}; valid: auto, or a size in MiB > 0"),
        (
            p.cache_weights.strip().lower() in CACHE_WEIGHTS_WORDS or p.cache_weights.strip().isdigit(),
            f"parallel.cache_weights={p.cache_weights!r}; valid: off, all, auto, or a number of blocks N (the last N)",
        ),
        (c.interval >= 0, f"checkpoint.interval={c.interval} must be >= 0 (0 = only at the end)"),
        (c.keep >= 0, f"checkpoint.keep={c.keep} must be >= 0 (0 = keep all)"),
        (p.trace_collectives >= 0, f"parallel.trace_collectives={p.trace_collectives} must be >= 0 (0 = off)"),
    ]


def check_values(cfg: RunConfig) -> None:
    """Ranges and choices the field types cannot rule out; :class:`ConfigError` naming the first bad
    value and what would be valid. (Model shapes against themselves and the grid: axo4d.facts.spec.)"""
    checks = [*_train_checks(cfg), *_data_checks(cfg), *_run_checks(cfg)]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    signal_names(cfg.checkpoint.signals)
