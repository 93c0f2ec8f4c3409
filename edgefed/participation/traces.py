"""Participation traces: which devices work in a round and how many of their K steps they complete.

`ReplayTrace` replays a recorded run round by round (its selections and completed steps), so schemes or
algorithms can be compared on exactly the same realized participation, and a deadline run reproduces its
own trajectory bit for bit. `SampledTraces` gives each device a recorded trace of completed fractions and
draws from it every round, as the flexible-participation paper does; the built-in traces were measured by
edgefed itself (edgefed/data/traces.csv, with the command that re-records them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgefed.errors import ConfigError
from edgefed.rng import Purpose, generator


@dataclass(frozen=True)
class ReplayTrace:
    selected: np.ndarray  # (R, N) bool
    steps: np.ndarray  # (R, N) int32

    @classmethod
    def checked(cls, selected, steps, budget, source: str, n_devices: int, rounds: int,
                budgets: np.ndarray) -> "ReplayTrace":
        """A trace that fits this run: the same N, at least R rounds, the same K_k wherever it selected."""
        where = f"participation.trace = {source!r}"
        if selected.shape[1] != n_devices:
            raise ConfigError(f"config: {where} has {selected.shape[1]} devices but this run has {n_devices}")
        if selected.shape[0] < rounds:
            raise ConfigError(f"config: {where} holds {selected.shape[0]} rounds but this run needs {rounds}; "
                              f"lower rounds to at most {selected.shape[0]}")
        selected, steps, budget = selected[:rounds], steps[:rounds], budget[:rounds]
        wrong = selected & (budget != budgets[None, :])
        if wrong.any():
            r, k = np.argwhere(wrong)[0]
            raise ConfigError(f"config: {where} asked device {k} for {budget[r, k]} steps in round {r + 1} but this "
                              f"run's budget is {budgets[k]}; use the same train.local_steps / local_epochs")
        return cls(selected.copy(), steps.astype(np.int32))

    def round(self, round_idx: int) -> tuple[np.ndarray, np.ndarray]:
        """(selected device ids ascending, steps each completes) of round round_idx (1-based)."""
        ids = np.flatnonzero(self.selected[round_idx - 1])
        return ids, self.steps[round_idx - 1, ids]


# ------------------------------------------------------------------------------------------ sampled traces

BUILTIN = Path(__file__).resolve().parent.parent / "data" / "traces.csv"
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
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where} cannot be read ({exc})") from None
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
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


class SampledTraces:
    """Each device follows one trace; each round its completed fraction is drawn from that trace's rounds.

    As in the flexible-participation paper: "each simulated device is randomly assigned a trace. For each
    aggregation round, it randomly samples from its trace to obtain the number of local epochs". Both draws
    come from the device's own streams, so any rank count replays the same steps.
    """

    def __init__(self, names, fractions, assignment: np.ndarray):
        self.names, self.fractions, self.assignment = tuple(names), tuple(fractions), assignment

    def steps(self, seed: int, round_idx: int, device_ids: np.ndarray, budgets: np.ndarray) -> np.ndarray:
        out = np.zeros(len(device_ids), np.int32)
        for i, k in enumerate(device_ids):
            f = self.fractions[self.assignment[k]]
            frac = f[generator(seed, Purpose.TRACE, round_idx, int(k)).integers(f.size)]
            out[i] = min(int(np.floor(frac * budgets[i] + 0.5)), int(budgets[i]))
        return out


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
