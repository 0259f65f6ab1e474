"""Loading a run config: YAML files (with ``base:`` inheritance), ``--set`` overrides and ``--grid``
into the schema's dataclasses (:mod:`axo4d.config.schema`), every value coerced to its field's type
or one :class:`ConfigError` naming the key; named configs and machine files; writing a config back."""

from __future__ import annotations

import dataclasses
import keyword
import math
import os
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from axo4d.config.errors import ConfigError
from axo4d.config.schema import CONFIG_DIR, INT_MAX, DataConfig, ModelConfig, RunConfig


def _choice(value: Any, choices: tuple, key: str) -> str:
    """A ``Literal`` field: the value (YAML's booleans and numbers read as their words) if it is one
    of ``choices``, else one error naming the key, the value and the valid ones."""
    v = value
    if isinstance(value, bool):  # YAML 1.1 reads on/off/yes/no/true/false as booleans: take the valid word
        words = ("true", "on", "yes") if value else ("false", "off", "no")
        v = next((w for w in words if w in choices), words[0])
    v = str(v) if isinstance(v, (int, float)) else v
    if v in choices:
        return v
    valid = ", ".join(repr(c) if c == "" else str(c) for c in choices)
    raise ConfigError(f"{key}={value!r}; valid: {valid}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert ``value`` to the field type ``tp``; error names ``key``."""
    if typing.get_origin(tp) is Literal:
        return _choice(value, typing.get_args(tp), key)
    if typing.get_origin(tp) is tuple:  # tuple[X, ...]: a YAML list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key!r} must be a list, got {value!r}")
        item = typing.get_args(tp)[0]
        return tuple(_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value))
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
        return _int(value, key)
    if tp is float:
        v = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            v = float(value)
        elif isinstance(value, str):
            try:
                v = float(value)
            except ValueError:
                pass
        if v is None:
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
        if not math.isfinite(v):
            raise ConfigError(f"config key {key!r} must be a finite number, got {value!r}")
        return v
    if tp is str:
        if isinstance(value, bool):  # YAML reads true/false/on/off/yes/no as booleans
            return "true" if value else "false"
        if isinstance(value, (str, int, float)):
            return str(value)
        raise ConfigError(f"config key {key!r} must be a string, got {value!r}")
    raise ConfigError(f"config key {key!r}: unsupported type {tp}")


def _field_name(key: str) -> str:
    """The dataclass field of a config key: a Python keyword gets a trailing underscore (``async``)."""
    return key + "_" if keyword.iskeyword(key) else key


def _key_name(field_name: str) -> str:
    """The config key of a dataclass field (inverse of :func:`_field_name`)."""
    return field_name[:-1] if field_name.endswith("_") and keyword.iskeyword(field_name[:-1]) else field_name


def _int(value: Any, key: str) -> int:
    v = None
    if isinstance(value, int) and not isinstance(value, bool):
        v = value
    elif isinstance(value, float) and value.is_integer():
        v = int(value)
    elif isinstance(value, str):
        try:
            v = int(value.replace("_", ""))
        except ValueError:
            pass
    if v is None:
        raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
    if abs(v) > INT_MAX:
        raise ConfigError(f"config key {key!r}={v} is too large: integers in a config are at most 2**63-1 ({INT_MAX})")
    return v


def _build(cls: type, values: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {_field_name(str(k)): v for k, v in values.items()}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix + str(unknown[0])!r}; valid keys under "
            f"{prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(map(_key_name, names)))}"
        )
    kwargs = {k: _coerce(v, hints[k], prefix + _key_name(k)) for k, v in values.items()}
    return cls(**kwargs)


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}): "
            "a config is a YAML file"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}: {problem}") from None
    if data is None:
        raise ConfigError(
            f"config file {str(path)!r} is empty: give a named config as its base ('base: tiny') or "
            f"the sections to set (model, data, train, parallel, checkpoint)"
        )
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
    folder_error = error(f"{what} {s!r} is a folder, not a file; give a .yaml file or a bundled {what}'s name")
    if p.suffix in (".yaml", ".yml") or os.sep in s:
        if p.is_dir():
            raise folder_error
        if not p.is_file():
            raise error(f"{what} file {s!r} does not exist")
        return p
    q = folder / f"{s}.yaml"
    if not q.is_file() and p.is_dir():
        raise folder_error
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


def user_model_keys(name_or_path: str) -> dict:
    """The ``model`` keys written in the user's own YAML files of a config (the file and its
    ``base:`` chain up to the first bundled named config; a named config has none): under
    ``--init-from`` they win over the source's ``config.json`` (and ``--set model.*`` over both)."""
    path, layers = resolve_config_path(name_or_path), []
    for _ in range(10):
        if path.resolve().parent == CONFIG_DIR.resolve():
            break
        data = _read_yaml(path)
        model = data.get("model") or {}
        if not isinstance(model, dict):
            raise ConfigError(f"config file {str(path)!r}: 'model' must be a mapping of model keys")
        layers.append(model)
        if data.get("base") is None:
            break
        path = resolve_config_path(str(data["base"]))
    out: dict = {}
    for layer in reversed(layers):
        out.update(layer)
    return out


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


def config_from_dict(raw: dict) -> RunConfig:
    return _build(RunConfig, raw)


def _lists(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    return [_lists(x) for x in v] if isinstance(v, (list, tuple)) else v


def config_to_dict(cfg: Any) -> dict:
    """``cfg`` as the nested dict of its YAML keys (``async``, not the field's ``async_``)."""

    def keys(v: Any) -> Any:
        return {_key_name(k): keys(x) for k, x in v.items()} if isinstance(v, dict) else v

    return _lists(keys(dataclasses.asdict(cfg)))


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
