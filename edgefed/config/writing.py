"""A Config back to TOML (the run log stores that text; device ranks rebuild the config from it), and the
comparison `--resume` makes between two configs."""

from __future__ import annotations

import dataclasses

import tomli_w

from edgefed.config.schema import PLACEMENT, TOML_NAMES, Config


def to_dict(cfg: Config) -> dict:
    """The config as plain TOML-able data; None fields, and tables left with none, are left out (they mean
    "default")."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            table = _plain(dataclasses.asdict(value))
            if table:
                out[TOML_NAMES.get(f.name, f.name)] = table
        elif isinstance(value, tuple):
            if value:
                out[f.name] = [dataclasses.asdict(item) for item in value]
        elif value is not None:
            out[f.name] = value
    return out


def _plain(table: dict) -> dict:
    """A table's values as TOML takes them: tuples as lists (tables in them too), None left out."""
    def plain(v):
        if isinstance(v, (tuple, list)):
            return [plain(item) for item in v]
        return _plain(v) if isinstance(v, dict) else v

    return {k: plain(v) for k, v in table.items() if v is not None}


def to_toml(cfg: Config) -> str:
    return tomli_w.dumps(to_dict(cfg))


def same_experiment(a: Config, b: Config) -> list[str]:
    """Keys (table.key) where two configs differ, ignoring where the log is written and where the devices
    run (PLACEMENT)."""
    da, db = to_dict(a), to_dict(b)
    for d in (da, db):
        d.get("log", {}).pop("path", None)
        for table, keys in PLACEMENT.items():
            for key in keys:
                d.get(table, {}).pop(key, None)
    traces = [(d.get("participation") or {}).get("trace") for d in (da, db)]
    if all(isinstance(t, str) and t.endswith((".h5", ".hdf5")) for t in traces):
        for d in (da, db):  # a replay may name its run log by another path; the log itself is checked
            d["participation"].pop("trace")
    return [key for key, _ in dict_differences(da, db)]


def log_differences(given: Config, config_toml: str, source: str) -> tuple[Config, list[str]]:
    """(the config stored in a log, the keys where `given` runs another experiment). A key the log predates
    that `given` leaves at its default is not a difference: the log's run keeps the behaviour it had."""
    from edgefed.config.reading import config_from_dict, stored_config

    raw, predated = stored_config(config_toml, source)
    logged = config_from_dict(raw)
    defaults = to_dict(Config())
    mine = to_dict(given)
    diffs = [key for key in same_experiment(given, logged)
             if not (key in predated and mine.get(key.split(".")[0], {}).get(key.split(".")[1])
                     == defaults.get(key.split(".")[0], {}).get(key.split(".")[1]))]
    return logged, diffs


def dict_differences(a: dict, b: dict) -> list[tuple[str, object]]:
    """(table.key, a's value) of every key whose value differs between two configs as TOML data."""
    out = []
    for table in sorted(set(a) | set(b)):
        va, vb = a.get(table), b.get(table)
        if isinstance(va, dict) or isinstance(vb, dict):
            va, vb = va or {}, vb or {}
            out += [(f"{table}.{k}", va.get(k)) for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)]
        elif va != vb:
            out.append((table, va))
    return out


def with_placement(cfg: Config, placed: Config) -> Config:
    """cfg with the PLACEMENT keys of `placed` (a resume continues the logged experiment where it runs now)."""
    tables = {table: dataclasses.replace(getattr(cfg, table), **{k: getattr(getattr(placed, table), k) for k in keys})
              for table, keys in PLACEMENT.items()}
    return dataclasses.replace(cfg, **tables)
