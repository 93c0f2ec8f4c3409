"""TOML text -> a checked Config: files, `--set table.key=value` overrides, keys and types with fixes."""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
import types
import typing
from pathlib import Path

from edgefed.config.schema import FIELDS, TABLES, TOP_KEYS, Config
from edgefed.config.validation import validate
from edgefed.errors import ConfigError
from edgefed.hwprofile import names_a_file


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read CONFIG.toml (None: the built-in default), apply `table.key=value` overrides, validate. Every file or
    folder a config names (PATH_KEYS) is taken relative to the config file, or to the working folder when set by
    an override, and stored absolute: a resumed run and every rank find it whatever their working folder."""
    raw = {} if path is None else read_toml(path)
    absolute_paths(raw, Path(path).parent if path is not None else Path.cwd(), None if path is None else str(path))
    for item in overrides:
        apply_override(raw, item)
        absolute_paths(raw, Path.cwd())
    return config_from_dict(raw)


# every key whose value names a file or folder (some of their values are names instead: a shipped board
# profile, the built-in traces); one rule for all: relative to the file that names it (docs/config.md)
PATH_KEYS = ("data.path", "data.vocab", "data.shards", "model.module", "model.weights", "device.profile",
             "device.boards", "participation.trace", "log.path")


def files_read(cfg) -> list[tuple[str, str]]:
    """(what, path) of every file and folder a run of this config reads, so that no output of the run is
    written over one of them (outputs.check_output)."""
    named = [("data.path", cfg.data.path), ("data.vocab", cfg.data.vocab), ("model.module", cfg.model.module),
             ("model.weights", cfg.model.weights), ("device.profile", cfg.device.profile),
             *(("device.boards", board) for board in cfg.device.boards)]
    trace = cfg.participation.trace
    named += [("participation.trace", trace)] if isinstance(trace, str) else []
    return [(f"the {key} {'folder' if Path(value).is_dir() else 'file'}", value) for key, value in named
            if isinstance(value, str) and Path(value).exists()]


def absolute_path(value, base: Path):
    """A relative file path made absolute against base (anything else as it is)."""
    return str((base / value).resolve()) if isinstance(value, str) and not Path(value).is_absolute() else value


def absolute_value(key: str, value, base: Path, source: str | None = None):
    """The value of a PATH_KEYS key with the paths in it made absolute against base (names left as they are).
    source: the file the value was read from; a path not found there but found in the working folder (where
    data.path and data.vocab were once taken from) is refused, saying what to write."""
    if key in ("device.profile", "device.boards"):
        if isinstance(value, list):
            return [absolute_value(key, v, base, source) for v in value]
        return value if not isinstance(value, str) or not names_a_file(value) else _absolute(key, value, base, source)
    if key == "participation.trace":
        if isinstance(value, list):  # trace names, a file's as FILE#name (builtin#name: the built-in file's)
            return [f"{_absolute(key, v.rpartition('#')[0], base, source)}#{v.rpartition('#')[2]}"
                    if isinstance(v, str) and "#" in v and v.rpartition("#")[0] != "builtin" else v for v in value]
        if not isinstance(value, str) or value == "builtin" or value.startswith("builtin:"):
            return value
        file, colon, first = value.rpartition(":")  # FILE:k, the first k of its traces
        if colon and first.isdigit() and not (base / value).exists():
            return f"{_absolute(key, file, base, source)}:{first}"
    return _absolute(key, value, base, source)


def _absolute(key: str, value, base: Path, source: str | None):
    if not isinstance(value, str) or not value or Path(value).is_absolute():
        return value
    path = absolute_path(value, base)
    here = Path.cwd() / value
    if (source is not None and key != "log.path" and not Path(path).exists() and here.exists()  # (an output may
            and base.resolve() != Path.cwd().resolve()):  # exist anywhere: only inputs are looked for)
        fix = os.path.relpath(here.resolve(), base.resolve())
        raise ConfigError(f"config: {key} = {value!r} is not at {path}: a path in a config file is relative to that "
                          f"file ({source}); write {fix!r} for the working folder's {value}, or an absolute path")
    return path


def absolute_paths(raw: dict, base: Path, source: str | None = None) -> None:
    """PATH_KEYS of a raw config made absolute against base, in place (source: as absolute_value takes it)."""
    for key in PATH_KEYS:
        table, name = key.split(".")
        if isinstance(raw.get(table), dict) and name in raw[table]:
            raw[table][name] = absolute_value(key, raw[table][name], base, source)


def read_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found; give an existing TOML file or none for the default") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc}); give a UTF-8 TOML file") from None
    return parse_toml(text, str(path))


def parse_toml(text: str, source: str = "config") -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source} is not valid TOML: {exc}") from None


# keys a run log's stored config may predate, and the behaviour runs had before each existed
PREDATED = {("data", "min_partition_size"): 2}


def stored_config(text: str, source: str) -> tuple[dict, list[str]]:
    """A config stored in a run log, as TOML data, with the keys it predates set as its run behaved (every log
    stores every key, so a missing one is one the log is older than); and those keys (table.key). A relative
    path in it is from a log older than the rule that stores every path absolute, and was the working folder's."""
    raw = parse_toml(text, source)
    absolute_paths(raw, Path.cwd())  # (a log written before paths were stored absolute: its run took them from here)
    predated = []
    for (table, key), value in PREDATED.items():
        if isinstance(raw.get(table), dict) and key not in raw[table]:
            raw[table][key] = value
            predated.append(f"{table}.{key}")
    return raw, predated


def apply_override(raw: dict, item: str) -> None:
    """`train.local_steps=10`: the value is read as TOML, or taken as a bare string if it is not TOML."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item!r} is not KEY=VALUE; write it like --set train.local_steps=10")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError as exc:
        value = text.strip()
        if value[:1] in ("[", "{", '"', "'"):  # meant as TOML (a list, a table, a quoted string): say what is off
            raise ConfigError(f"--set {item!r}: the value is not valid TOML ({exc}); write strings in quotes, "
                              "lists in [ ] and tables in { }, e.g. --set 'data.kind=\"arrays\"'") from None
    set_key(raw, key, value)


def set_key(raw: dict, key: str, value) -> None:
    """raw[table][key] = value for a dotted `table.key` (a top-level key has no dot)."""
    parts = key.split(".")
    if len(parts) == 1:
        raw[key] = value
    elif len(parts) == 2:
        table = raw.setdefault(parts[0], {})
        if not isinstance(table, dict):
            raise ConfigError(f"--set {key}: {parts[0]} is not a table in this config")
        table[parts[1]] = value
    else:
        raise ConfigError(f"--set {key}: keys have the form table.key (e.g. train.local_steps)")


def config_from_dict(raw: dict) -> Config:
    _check_keys(raw, TOP_KEYS + tuple(TABLES), "")
    tables = {}
    for name, cls in TABLES.items():
        sub = raw.get(name, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"config: {name} must be a table ([{name}]), found {_describe(sub)}")
        tables[FIELDS[name]] = _build(cls, sub, name)
    top = _build_fields(Config, {k: raw[k] for k in TOP_KEYS if k in raw}, "")
    return validate(Config(**top, **tables))


def _check_keys(raw: dict, known: typing.Sequence[str], table: str) -> None:
    for key in raw:
        if key not in known:
            where = f"[{table}] " if table else ""
            hint = difflib.get_close_matches(key, known, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"known keys: {', '.join(known)}"
            raise ConfigError(f"config: unknown key {where}{key!r}; {fix}")


def _build(cls, raw: dict, table: str):
    names = tuple(f.name for f in dataclasses.fields(cls))
    _check_keys(raw, names, table)
    return cls(**_build_fields(cls, raw, table))


def _build_table(cls, raw: dict, where: str):
    """One table of an array of tables: like _build, but every field without a default is required."""
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in raw]
    if missing:
        raise ConfigError(f"config: {where} lacks {', '.join(missing)}")
    return _build(cls, raw, where)


def _build_fields(cls, raw: dict, table: str) -> dict:
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in raw.items():
        out[key] = _coerce(value, hints[key], f"{table}.{key}" if table else key)
    return out


def _coerce(value, hint, key: str):
    """Check value against a field's type hint; ints are accepted where floats are expected.

    `tuple[T, ...]` fields take TOML arrays (of values, or of tables when T is a dataclass).
    """
    if isinstance(hint, types.UnionType) and isinstance(value, list):
        hint = next((alt for alt in typing.get_args(hint) if typing.get_origin(alt) is tuple), hint)
    if typing.get_origin(hint) is tuple:
        elem = typing.get_args(hint)[0]
        if not isinstance(value, list):
            raise ConfigError(f"config: {key} = {value!r} is {_describe(value)}; expected a list")
        if dataclasses.is_dataclass(elem):
            bad = [item for item in value if not isinstance(item, dict)]
            if bad:
                raise ConfigError(f"config: {key} must be a list of tables ([[{key}]]), found {_describe(bad[0])}")
            return tuple(_build_table(elem, item, f"{key}[{i}]") for i, item in enumerate(value))
        return tuple(_coerce(item, elem, f"{key}[{i}]") for i, item in enumerate(value))
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if isinstance(value, dict) and dict in allowed:  # a table checked by its own registry (a layer)
        return dict(value)
    if isinstance(value, bool):
        if bool in allowed:
            return value
    elif isinstance(value, int) and int in allowed:
        return value
    elif isinstance(value, (int, float)) and float in allowed:
        return float(value)
    elif isinstance(value, str) and str in allowed:
        return value
    expected = " or ".join(_TYPE_NAMES.get(t, "a list") for t in allowed if t is not type(None))
    raise ConfigError(f"config: {key} = {value!r} is {_describe(value)}; expected {expected}")


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a table"}


def _describe(value) -> str:
    for t in (bool, int, float, str):
        if isinstance(value, t):
            return _TYPE_NAMES[t]
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__
