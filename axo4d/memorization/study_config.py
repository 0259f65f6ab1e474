"""The study's settings (``study.*``) and how a study's config is read.

A study is a run config (``model``, ``data``, ``train``, ``parallel`` as for ``axo4d.train``; default
the named config ``memorize``) plus the ``study`` section below. ``--set study.epochs=4`` sets a
study field, ``--set train.lr=1e-3`` a run field. A report's ``config.yaml`` (sections ``study`` and
``run``) is itself a valid ``--config``: it reruns the same study.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from axo4d.config import (
    RunConfig,
    config_from_dict,
    load_config,
    parse_overrides,
    resolve_config_path,
)
from axo4d.config.errors import ConfigError
from axo4d.config.loader import _coerce
from axo4d.nn.goldfish import check_goldfish


@dataclass(frozen=True)
class StudyConfig:
    prefix: int = 50
    """Tokens of each document given to the model as the prompt."""
    suffix: int = 50
    """Tokens then generated greedily and compared with the document's own (the study's 50); a
    document is its first prefix + suffix tokens."""
    buckets: int = 2
    """Treated buckets (trained for ``epochs`` epochs); one control bucket is never trained."""
    bucket_size: int = 8
    """Documents per bucket, treated and control alike."""
    epochs: int = 100
    """Passes over the treated documents; every bucket is measured before training and after each
    (see measure_every)."""
    measure_every: int = 10
    """Measure after every n-th epoch (and always after epoch 1 and the last); 1 = after every
    epoch. Measuring is greedy generation of every document, which costs more than an epoch of
    training when the buckets are small; the default study takes ~100 epochs to memorize, so it
    measures every 10th."""
    seeds: str = "1,2,3"
    """Comma-separated seeds; a seed draws which documents are treated and which control, and the
    order of the training batches (the starting model is the same for every seed and arm)."""
    goldfish_k: str = "4"
    """Comma-separated k of the Goldfish arms ('' = the standard arm only); each k >= 2."""
    goldfish_h: int = 13
    """Goldfish context width h of every Goldfish arm."""
    lr: float = 0.0
    """Learning rate of the memorization phase (0 = train.lr): train.warmup_steps of linear warm-up,
    then constant, so that every epoch trains alike."""
    pretrain_steps: int = 200
    """Steps of training on the rest of the corpus (every usable document not in the study) before
    the study, on random windows as axo4d.train does (train.* schedule and batch); 0 = none."""
    split: str = "auto"
    """Cut each source document into consecutive documents of prefix + suffix tokens: 'yes', 'no'
    (one document per file or JSONL line: its first prefix + suffix tokens), or 'auto' (yes for the
    stdlib corpus, no otherwise)."""
    generate_batch: int = 0
    """Prompts per generation call (0 = every document of the study at once)."""

    @property
    def length(self) -> int:
        """Tokens of a study document: prefix + suffix."""
        return self.prefix + self.suffix

    @property
    def measured_epochs(self) -> list[int]:
        """Epochs after which every bucket is measured: 0 (before training), 1, every
        ``measure_every``-th and the last."""
        return sorted({0, 1, self.epochs} | set(range(self.measure_every, self.epochs + 1, self.measure_every)))

    @property
    def seed_list(self) -> list[int]:
        return _int_list(self.seeds, "study.seeds")

    @property
    def goldfish_list(self) -> list[int]:
        return _int_list(self.goldfish_k, "study.goldfish_k")

    @property
    def arms(self) -> list[tuple[str, int]]:
        """``(name, k)`` of every arm: the standard loss (k = 0), then Goldfish with each k."""
        return [("standard", 0)] + [(f"goldfish-k{k}", k) for k in self.goldfish_list]


def _int_list(raw: str, key: str) -> list[int]:
    try:
        out = [int(p) for p in str(raw).replace(" ", "").split(",") if p != ""]
    except ValueError:
        raise ConfigError(f"{key}={raw!r} must be comma-separated integers, e.g. 1,2,3") from None
    if len(set(out)) != len(out):
        raise ConfigError(f"{key}={raw!r} repeats a value")
    return out


def check_study(s: StudyConfig) -> None:
    """Ranges the field types cannot rule out: :class:`ConfigError` naming the first bad value."""
    checks = [
        (s.prefix >= 1, f"study.prefix={s.prefix} must be >= 1"),
        (s.suffix >= 1, f"study.suffix={s.suffix} must be >= 1"),
        (s.buckets >= 1, f"study.buckets={s.buckets} must be >= 1 (treated buckets; the control is extra)"),
        (s.bucket_size >= 1, f"study.bucket_size={s.bucket_size} must be >= 1"),
        (s.epochs >= 1, f"study.epochs={s.epochs} must be >= 1"),
        (s.measure_every >= 1, f"study.measure_every={s.measure_every} must be >= 1 (1 = after every epoch)"),
        (s.lr >= 0, f"study.lr={s.lr} must be >= 0 (0 = train.lr)"),
        (s.pretrain_steps >= 0, f"study.pretrain_steps={s.pretrain_steps} must be >= 0"),
        (s.split in ("auto", "yes", "no"), f"study.split={s.split!r}; valid: auto, yes, no"),
        (s.generate_batch >= 0, f"study.generate_batch={s.generate_batch} must be >= 0 (0 = all at once)"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
    if not s.seed_list:
        raise ConfigError(f"study.seeds={s.seeds!r} names no seed; give e.g. 1,2,3")
    for k in s.goldfish_list:
        try:
            check_goldfish(k, s.goldfish_h)
        except ValueError as e:
            raise ConfigError(f"study.{e}") from None
        if k == 0:
            raise ConfigError("study.goldfish_k lists 0; the standard arm (k = 0) is always run, list only k >= 2")
    try:
        check_goldfish(0, s.goldfish_h)
    except ValueError as e:
        raise ConfigError(f"study.{e}") from None


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def build_study(values: dict) -> StudyConfig:
    """A :class:`StudyConfig` from a mapping; unknown keys and wrong types name the key."""
    if not isinstance(values, dict):
        raise ConfigError(f"config key 'study' must be a mapping of study fields, got {values!r}")
    names = {f.name: f for f in dataclasses.fields(StudyConfig)}
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown config key 'study.{unknown[0]}'; valid keys under study: {', '.join(sorted(names))}"
        )
    hints = {"int": int, "float": float, "str": str}
    return StudyConfig(**{k: _coerce(v, hints[str(names[k].type)], f"study.{k}") for k, v in values.items()})


def load_study(config: str, sets: list[str], grid: str | None = None) -> tuple[StudyConfig, RunConfig, list[str]]:
    """The study, the run config and the size sweep of ``--config`` (a named config, a YAML run
    config, or a report's ``config.yaml``), then ``--set`` overrides (``study.*`` and run keys) and
    ``--grid``."""
    over = parse_overrides(sets)
    study_over = over.pop("study", {})
    if not isinstance(study_over, dict):
        raise ConfigError("--set study=... must name a field, e.g. study.epochs=4")
    path = resolve_config_path(config)
    raw = _read(path)
    if "study" in raw or "run" in raw:
        if set(raw) - {"study", "run", "sizes", "command"}:
            bad = sorted(set(raw) - {"study", "run", "sizes", "command"})[0]
            raise ConfigError(f"study config {str(path)!r}: unknown top-level key {bad!r}; valid: study, run")
        run_raw = _merge(raw.get("run") or {}, over)
        if grid is not None:
            run_raw = _merge(run_raw, {"parallel": {"grid": grid}})
        cfg = config_from_dict(run_raw)
        study_raw, sizes = raw.get("study") or {}, [str(x) for x in raw.get("sizes") or []]
    else:
        run_sets = [s for s in sets if not s.strip().startswith("study.")]
        cfg, study_raw, sizes = load_config(config, run_sets, grid), {}, []
    return build_study(_merge(study_raw, study_over)), cfg, sizes


def _read(path: Path) -> dict:
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {str(path)!r}: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config {str(path)!r} must hold a mapping at the top level")
    return raw
