"""Trace files: named traces of completed fractions s/K, one per recorded round, as CSV with a header.

The built-in traces (edgefed/data/traces.csv) were measured by edgefed itself; the file's header holds the
command that re-records them (`edgefed trace record`). `sampled_traces` resolves `participation.trace` to
the traces it names and each device's assignment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgefed.errors import ConfigError
from edgefed.participation.traces import SampledTraces
from edgefed.rng import Purpose, generator

BUILTIN = Path(__file__).resolve().parent / "data" / "traces.csv"
FORMAT_LINE = "# edgefed trace file, format 1"


@dataclass(frozen=True)
class TraceFile:
    """Named traces: each a list of completed fractions s/K, one per recorded round."""

    names: tuple[str, ...]
    fractions: tuple[np.ndarray, ...]
    meta: dict

    def stats(self) -> list[dict]:
        out = []
        for name, f in zip(self.names, self.fractions):
            out.append({"name": name, "rounds": f.size, "mean": float(f.mean()), "std": float(f.std()),
                        "min": float(f.min()), "max": float(f.max()), "inactive": float(np.mean(f == 0)),
                        "complete": float(np.mean(f >= 1))})
        return out


def read_trace_file(path: str | Path) -> TraceFile:
    path = Path(path)
    where = f"trace file {path}"
    if not path.is_file():
        raise ConfigError(f"{where} not found; participation.trace names \"builtin\", a trace file or a run log")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read ({exc})") from None
    if raw.startswith(b"\x89HDF"):
        raise ConfigError(f"{where} is an HDF5 file, not a trace file (CSV from edgefed trace record); a run log is "
                          "replayed with participation.trace = \"RUN.h5\" and read with edgefed summary")
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not text, so not a trace file (CSV from edgefed trace record)") from None
    if not lines or lines[0].strip() != FORMAT_LINE:
        raise ConfigError(f"{where} is not an edgefed trace file (its first line must be {FORMAT_LINE!r})")
    meta = {}
    body = []
    for line in lines[1:]:
        if line.startswith("#"):
            key, _, value = line[1:].partition(":")
            meta[key.strip()] = value.strip()
        elif line.strip():
            body.append(line.split(","))
    if len(body) < 2:
        raise ConfigError(f"{where} holds no rounds; record one with edgefed trace record")
    names = tuple(name.strip() for name in body[0])
    try:
        values = np.array([[float(v) for v in row] for row in body[1:]])
    except ValueError:
        raise ConfigError(f"{where}: every value must be a completed fraction (a number)") from None
    if values.shape[1] != len(names):
        raise ConfigError(f"{where}: rows must have {len(names)} values, one per trace")
    values = values.T
    if not np.all((values >= 0) & (values <= 1)):
        raise ConfigError(f"{where}: completed fractions must lie in [0, 1]")
    return TraceFile(names, tuple(values), meta)


def write_trace_file(path: str | Path, names, fractions: np.ndarray, meta: dict) -> None:
    """fractions: (rounds, traces) completed fractions."""
    lines = [FORMAT_LINE] + [f"# {k}: {v}" for k, v in meta.items()] + [",".join(names)]
    lines += [",".join(f"{v:.4f}" for v in row) for row in np.asarray(fractions)]
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:  # whole or not at all: a trace recorded for minutes is not lost to a half-written file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"cannot write trace file {path} ({exc}); choose another --out") from None


def sampled_traces(spec, seed: int, n_devices: int) -> SampledTraces:
    """Resolve participation.trace: "builtin[:k]", "FILE.csv[:k]", or a list of names (cycled over devices)."""
    if isinstance(spec, str):
        source, _, first = spec.partition(":") if not Path(spec).is_file() else (spec, "", "")
        file = read_trace_file(BUILTIN if source == "builtin" else source)
        count = len(file.names)
        if first:
            if not first.isdigit() or not 1 <= int(first) <= count:
                raise ConfigError(f"config: participation.trace = {spec!r}: after ':' give how many of its "
                                  f"{count} traces to draw from (1..{count})")
            count = int(first)
        assignment = np.array([generator(seed, Purpose.TRACE_ASSIGN, 0, k).integers(count) for k in range(n_devices)])
        return SampledTraces(file.names, file.fractions, assignment)
    names, fractions, index = [], [], []
    for entry in spec:
        source, _, name = entry.rpartition("#") if "#" in entry else ("builtin", "", entry)
        file = read_trace_file(BUILTIN if source == "builtin" else source)
        if name not in file.names:
            raise ConfigError(f"config: participation.trace names {entry!r}, but {source} has only "
                              f"{', '.join(file.names)}")
        names.append(name)
        fractions.append(file.fractions[file.names.index(name)])
        index.append(len(names) - 1)
    assignment = np.array([index[k % len(index)] for k in range(n_devices)])
    return SampledTraces(names, fractions, assignment)
