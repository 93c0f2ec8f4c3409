"""Sweep folders as the report reads them: each cell's runs, the tables `edgefed sweep` wrote, and the
sweep's axes as dimensions (keys that moved together as one)."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from edgefed.analysis.logs import Run
from edgefed.errors import EdgefedError


@dataclass
class Sweep:
    """A sweep folder: its cells' runs (by cell name, seeds in order) and its tables."""

    folder: Path
    cells: dict[str, list[Run]] = field(default_factory=dict)
    summary: list[dict] = field(default_factory=list)
    table: list[dict] = field(default_factory=list)
    axes: list[str] = field(default_factory=list)  # dotted keys, in the sweep file's order
    values: dict[str, dict[str, str]] = field(default_factory=dict)  # cell -> axis -> value as written

    @classmethod
    def read(cls, folder: Path) -> "Sweep":
        sweep = cls(folder)
        sweep.summary = _read_csv(folder / "summary.csv")
        sweep.table = _read_csv(folder / "cells.csv") if (folder / "cells.csv").is_file() else []
        header = list(sweep.summary[0]) if sweep.summary else []
        if not {"cell", "seed", "log", "status"} <= set(header):
            raise EdgefedError(f"{folder / 'summary.csv'} is not a sweep's summary; give a folder `edgefed sweep` wrote")
        sweep.axes = header[1:header.index("seed")]
        for row in sweep.summary:
            sweep.values[row["cell"]] = {k: row[k] for k in sweep.axes}
            if row["status"] in ("complete", "running") and (folder / row["log"]).is_file():
                sweep.cells.setdefault(row["cell"], []).append(Run.read(folder / row["log"]))
        if not sweep.cells:
            raise EdgefedError(f"sweep folder {folder} holds no readable runs yet; run `edgefed sweep` first")
        return sweep

    @property
    def name(self) -> str:
        return self.folder.resolve().name

    def files(self) -> list[Path]:
        """What the report reads of the folder: its tables and its runs' logs."""
        tables = [self.folder / name for name in ("summary.csv", "cells.csv")]
        return tables + [run.path for runs in self.cells.values() for run in runs]

    def dimensions(self) -> list[tuple[str, ...]]:
        """The axes, with keys that moved together (a linked axis, "data.alpha,data.beta") as one."""
        dims: list[tuple[str, ...]] = []
        for key in self.axes:
            if dims and self._linked(dims[-1] + (key,)):
                dims[-1] += (key,)
            else:
                dims.append((key,))
        return dims

    def _linked(self, keys: tuple[str, ...]) -> bool:
        """Whether the last key moved with the ones before it (a zipped axis: "mode,scheme" = [[...], ...]; a key
        of one value in it), not across them (a product of two axes holds every pair)."""
        def combos(ks) -> int:
            return len({tuple(v[k] for k in ks) for v in self.values.values()})

        return combos(keys[-1:]) == 1 or combos(keys) < combos(keys[:-1]) * combos(keys[-1:])

    def label(self, cell: str, dims) -> str:
        """ "alpha=0.0, beta=0.0, trace=builtin:4": the cell's values along these dimensions."""
        return ", ".join(f"{short_key(k)}={self.values[cell][k]}" for dim in dims for k in dim)

    def groups(self) -> dict[str, list[tuple[str, list[Run]]]]:
        """Cells grouped by every dimension but the last: a figure per group, a line per value of the last."""
        out: dict[str, list[tuple[str, list[Run]]]] = {}
        dims = self.dimensions()
        for cell, runs in self.cells.items():
            group = self.label(cell, dims[:-1]) or "all cells"
            out.setdefault(group, []).append((self.label(cell, dims[-1:]) or cell, runs))
        return out


def short_key(key: str) -> str:
    """A dotted key's last part (data.alpha: alpha)."""
    return key.rpartition(".")[2]


def _read_csv(path: Path) -> list[dict]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    except OSError as exc:
        raise EdgefedError(f"{path} cannot be read ({exc}); a sweep folder holds the summary.csv `edgefed sweep` "
                           "writes") from None


def load_targets(targets) -> tuple[list[Sweep], list[Run]]:
    sweeps, runs = [], []
    for target in targets:
        path = Path(target)
        if path.is_dir():
            sweeps.append(Sweep.read(path))
        elif path.is_file():
            runs.append(Run.read(path))
        else:
            raise EdgefedError(f"{target} not found; give run logs (.h5) or sweep folders")
    return sweeps, runs


def number(text) -> float:
    """A table's value as a number (NaN: empty or not a number)."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan
