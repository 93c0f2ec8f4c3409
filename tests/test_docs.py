"""The docs held to the code: docs/config.md lists every config key with its real default, docs/runlog.md
every dataset and attribute a run writes, the examples in the docs and the shipped sweeps read, and no link
points outside the repository."""

import dataclasses
import re
import shutil
import tomllib
from pathlib import Path

import h5py
import pytest

from edgefed import config as config_mod
from edgefed.config import schema
from edgefed.orchestration import run as runs
from edgefed.orchestration.sweep import read_sweep

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

SECTIONS = {  # docs/config.md heading -> (dataclass, where its resolved defaults live in the built-in config)
    "Top level": (schema.Config, lambda cfg: cfg),
    **{f"`[{name}]`": (type(getattr(schema.Config(), schema.FIELDS[name])),
                       lambda cfg, name=schema.FIELDS[name]: getattr(cfg, name))
       for name in schema.TABLES},
    "`[[dynamics.arrive]]`": (schema.ArrivalConfig, None),
    "`[[dynamics.depart]]`": (schema.DepartureConfig, None),
    "`[[mpi.away]]`": (schema.AwayConfig, None),
    "`[[fault]]`": (schema.FaultConfig, None),
}


def config_doc() -> dict[str, dict[str, str]]:
    """heading -> key -> default cell, from the tables of docs/config.md."""
    out: dict[str, dict[str, str]] = {}
    heading = None
    for line in (DOCS / "config.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        row = re.match(r"\| `([a-z_]+)` \| ([^|]+) \|", line)
        if row:
            out.setdefault(heading, {})[row[1]] = row[2].strip()
    return out


def literal(cell: str):
    """The default cell as a value when it is one TOML literal in backticks; None when it describes."""
    match = re.fullmatch(r"`([^`]+)`", cell)
    return tomllib.loads(f"v = {match[1]}")["v"] if match else None


def plain(value):
    return list(value) if isinstance(value, tuple) else value


def test_config_md_lists_every_key_of_every_table_with_its_default():
    doc = config_doc()
    assert set(doc) == set(SECTIONS), "docs/config.md: a table is missing or one is not a config table"
    default = config_mod.load_config(None, [])
    checked = 0
    for heading, (cls, resolved) in SECTIONS.items():
        fields = {f.name: f for f in dataclasses.fields(cls) if cls is not schema.Config or f.name in schema.TOP_KEYS}
        assert set(doc[heading]) == set(fields), f"docs/config.md {heading}: keys differ from the code"
        for key, cell in doc[heading].items():
            value = literal(cell)
            if value is None:
                continue
            expected = (getattr(resolved(default), key) if resolved else fields[key].default)
            assert value == plain(expected), f"docs/config.md {heading} {key}: default {cell}, code {expected!r}"
            checked += 1
    assert checked >= 40  # most defaults are literals, so the check has teeth


def test_config_md_example_is_a_valid_config(tmp_path):
    block = re.search(r"```toml\n(.*?)```", (DOCS / "config.md").read_text(encoding="utf-8"), re.S)[1]
    (tmp_path / "c.toml").write_text(block)
    cfg = config_mod.load_config(tmp_path / "c.toml")
    assert (cfg.rounds, cfg.participation.trace, cfg.train.weighting) == (200, "builtin:5", "count_global")


def documented_paths() -> tuple[set[str], set[str]]:
    text = (DOCS / "runlog.md").read_text(encoding="utf-8")
    datasets = set(re.findall(r"^\| `(/[a-z_/]+)`", text, re.M))
    attributes = set()
    for cell in re.findall(r"^\| (`[a-z_]+`(?:, `[a-z_]+`)*) \|", text, re.M):
        attributes |= set(re.findall(r"`([a-z_]+)`", cell))
    return datasets, attributes


@pytest.mark.parametrize("overrides", [
    ["rounds=2", "data.clients=4", "train.clients_per_round=2"],
    ["rounds=2", "data.clients=4", "train.clients_per_round=2", 'train.algorithm="scaffold"',
     "log.client_controls=true"],
    ["rounds=2", "data.clients=3", 'train.clients_per_round="all"', "train.local_steps=5",
     'participation.mode="deadline"', "participation.deadline_s=0.01"],
    ["rounds=2", "data.clients=3", "train.clients_per_round=3", "secagg.enabled=true"],
    ["rounds=2", "data.clients=4", "train.clients_per_round=2", 'privacy.mechanism="central"',
     "privacy.noise_multiplier=1.0", 'selection.policy="oort"'],
], ids=["fedavg", "scaffold", "deadline", "secagg", "privacy-and-selection"])
def test_runlog_md_documents_every_dataset_and_attribute_a_run_writes(tmp_path, overrides):
    runs.run(config_mod.load_config(None, overrides), tmp_path / "r.h5")
    datasets, attributes = documented_paths()
    written = []
    with h5py.File(tmp_path / "r.h5", "r") as f:
        f.visititems(lambda name, obj: written.append("/" + name) if isinstance(obj, h5py.Dataset) else None)
        missing_attrs = set(f.attrs) - attributes
    missing = [p for p in written if p not in datasets and not p.startswith("/state/")]
    assert not missing and not missing_attrs, f"docs/runlog.md lacks {missing} {sorted(missing_attrs)}"


def test_sweeps_md_example_reads_as_a_sweep(tmp_path):
    text = (DOCS / "sweeps.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```toml\n(.*?)```", text, re.S) if "[axes]" in b and "base" in b)
    (tmp_path / "sweeps").mkdir()
    shutil.copy(ROOT / "examples" / "synthetic-paper.toml", tmp_path)
    (tmp_path / "sweeps" / "s.toml").write_text(block)
    sweep = read_sweep(tmp_path / "sweeps" / "s.toml")
    assert len(sweep.jobs) == 4 * 3 * 3 and sweep.target == 0.8


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "sweeps").glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_sweep_reads_and_names_its_commands(path):
    assert read_sweep(path).jobs
    assert f"| `{path.name}` |" in (DOCS / "reproduce.md").read_text(encoding="utf-8"), "docs/reproduce.md lacks it"


def test_links_stay_inside_the_repository():
    pages = [ROOT / "README.md", ROOT / "DEVELOPERS.md", *DOCS.glob("*.md"), ROOT / "benchmarks" / "RESULTS.md"]
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert "../shared" not in text and "/work/" not in text, f"{page.name} points outside the repository"
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            assert "://" not in target, f"{page.name} links outside the repository: {target}"
            assert (page.parent / target).resolve().is_relative_to(ROOT), f"{page.name}: {target}"
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
