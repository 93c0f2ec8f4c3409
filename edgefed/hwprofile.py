"""Hardware profiles: what a board is and how fast edgefed's kernels run on it.

A profile is a TOML file (format 1): `[machine]` facts, `[recommend]`ed settings, `[[speed]]` entries of
local SGD steps per second (model, parameter count, batch), and, when `edgefed profile` wrote it, start-up
times, per-rank memory, what a device rank costs the board beside its steps ([rank]) and MPI collective
times. A speed entry names a built-in model ("logreg", "mlp",
"cnn") or, with `model = "sequential"`, a layer list by its one-line signature in `layers` (what
`edgefed profile --config CONFIG` measures): a model's key is its name, or "sequential: " + signature. The boards edgefed knows ship in edgefed/hw_profiles/
(the repository's hw_profiles/ links there); `[device] profile = "pi4b"` names one of them, a path names any
other file. Deadlines derived from a profile (`deadline_s = "auto"` or `"1.5x"`) use its `[[speed]]`
entries: the time of K steps at the board's speed (as a device rank takes them: [rank]), times the factor.
"""

from __future__ import annotations

import bisect
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from edgefed.errors import ConfigError

FORMAT = 1
SHIPPED = Path(__file__).resolve().parent / "hw_profiles"
AUTO_FACTOR = 1.1  # "auto": as `trace record`, so an unloaded board just completes its budget
MODELS = ("logreg", "mlp", "cnn", "charlstm")
TIMED = MODELS + ("quadratic",)  # a profile written by hand may time the quadratic too, to play a cluster
_FACTOR = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*x\s*$")


SEQUENTIAL = "sequential"
NAMED = (SEQUENTIAL, "torch")  # models a speed entry names by `layers`: a layer list's signature, a module's


@dataclass(frozen=True)
class Speed:
    model: str
    params: int
    batch: int
    steps_per_s: float
    layers: str = ""  # a sequential model's signature

    @property
    def key(self) -> str:
        return f"{self.model}: {self.layers}" if self.model in NAMED else self.model


@dataclass(frozen=True)
class Power:
    """What a board draws ([power]): idle, and what each fully busy core adds (watts)."""

    idle_w: float
    busy_w_per_core: float


@dataclass(frozen=True)
class RankCost:
    """What a device rank costs its board beside its devices' steps ([rank], measured by `edgefed profile` on
    the board): the share of a device's steps in a deadline window lost to running as a device rank (its
    deadline's chunks, its rank's polls and heartbeats), and per model the seconds of a round's own work (the
    broadcast unpacked, a report packed)."""

    lost_share: float
    round_s: dict  # {model key: seconds}, each at its `round_params` parameters
    round_params: dict  # {model key: parameters}

    def round_seconds(self, model: str, params: int) -> float:
        """A round's own work for a model of `params` parameters: its entry's, else the largest entry's,
        scaled by size (what it copies is the model); 0 without entries."""
        if not self.round_s:
            return 0.0
        key = model if model in self.round_s else max(self.round_s, key=lambda k: self.round_params[k])
        return self.round_s[key] * params / self.round_params[key]


@dataclass(frozen=True)
class Profile:
    name: str
    source: str  # file it came from
    measured: bool  # written by `edgefed profile` on the board itself (else: estimates with sources)
    machine: dict
    recommend: dict
    speeds: tuple[Speed, ...]
    extra: dict = field(default_factory=dict)  # startup, memory, mpi: reported, not used by the runtime
    power: Power | None = None  # [power]; None: the board's energy is not computed
    rank: RankCost | None = None  # [rank]; None: a device rank is taken to cost its board nothing

    @property
    def available_mb(self) -> float:
        """What the board leaves a rank: its memory less what its own system takes (machine.system_mb)."""
        return float(self.machine["memory_mb"]) - float(self.machine.get("system_mb", 0))

    def compile_seconds(self, kind: str) -> float | None:
        """Seconds this board spends compiling a model's kernels into an empty cache (the profile's startup
        compile_s: cold start minus warm start): the built-in kind's entry, else the longest it has (a layer
        list of its own compiles what they do, or less); None when it has none."""
        table = self.extra.get("startup", {}).get("compile_s", {})
        if kind in table:
            return float(table[kind])
        return max(map(float, table.values())) if table else None

    def times(self, model: str) -> bool:
        """Whether the profile has a speed for this model (its key)."""
        return any(s.key == model for s in self.speeds)

    def step_seconds(self, model: str, batch: int, params: int) -> float:
        """Seconds per local step of `model` with `params` parameters at `batch`, from this board's speeds.

        The measured entry of that model at that batch, scaled by parameter count (a step's work is
        proportional to it); between or beyond measured batches the time per step is taken as linear in
        the batch (fixed cost + per-sample cost), through the two nearest; with one entry, proportional.
        """
        entries = sorted((s for s in self.speeds if s.key == model), key=lambda s: s.batch)
        if not entries:
            raise ConfigError(not_timed(self, model))
        times = [(s.batch, 1.0 / s.steps_per_s / s.params) for s in entries]  # seconds per step per parameter
        batches = [b for b, _ in times]
        if batch in batches:
            per_param = times[batches.index(batch)][1]
        elif len(times) == 1:
            per_param = times[0][1] * batch / times[0][0]
        else:
            i = min(max(bisect.bisect_left(batches, batch), 1), len(times) - 1)
            (b0, t0), (b1, t1) = times[i - 1], times[i]
            per_param = t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
            if per_param <= 0:  # extrapolated below the fixed cost: fall back to proportional
                per_param = t0 * batch / b0
        return per_param * params

    def rank_step_seconds(self, model: str, batch: int, params: int) -> float:
        """step_seconds as a device rank's device takes them: the share it loses to running as one ([rank])."""
        share = 0.0 if self.rank is None else self.rank.lost_share
        return self.step_seconds(model, batch, params) / (1.0 - share)

    def comm_seconds(self, model: str, params: int) -> float | None:
        """Seconds to broadcast a model of `params` parameters and gather one report, from the `[mpi]` times
        `edgefed profile` measured under mpirun, scaled by size from the model's entry (a model without one:
        from the largest measured, since what moves is only its size); None without them."""
        collectives = self.extra.get("mpi", {}).get("collective", [])
        entries = [c for c in collectives if c.get("model") == model] or collectives  # its size is what counts
        if not entries:
            return None
        c = max(entries, key=lambda c: float(c["params"]))
        return (float(c["bcast_ms"]) + float(c["gather_ms"])) / 1e3 * params / float(c["params"])


def not_timed(profile: Profile, model: str) -> str:
    """The one line that says a profile does not time a model, and how to make one that does."""
    known = ", ".join(sorted({s.model for s in profile.speeds})) or "none"
    return (f"hardware profile {profile.name} ({profile.source}) has no speed for the model {model!r} (it times: "
            f"{known}); measure it on that board with `edgefed profile --config CONFIG --out FILE` and use that file")


def parse_deadline(value) -> float | None:
    """The factor of a profile-derived deadline ("auto" or "1.5x"), or None for a fixed number of seconds."""
    if not isinstance(value, str):
        return None
    if value.strip() == "auto":
        return AUTO_FACTOR
    m = _FACTOR.match(value)
    if not m or not float(m.group(1)) > 0:
        raise ConfigError(f'config: participation.deadline_s = {value!r}; give seconds (0.05), "auto" or a '
                          f'multiple of the profiled time like "1.5x"')
    return float(m.group(1))


def names_a_file(name: str) -> bool:
    """Whether a [device] profile or boards entry is a path to a profile file, not a shipped profile's name."""
    return name.endswith(".toml") or "/" in name or "\\" in name


def resolve_path(name: str) -> Path:
    """A shipped profile's name ("pi4b"), or a path to a profile file."""
    return Path(name) if names_a_file(name) else SHIPPED / f"{name}.toml"


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.toml"))


def load_profile(name: str) -> Profile:
    path = resolve_path(name)
    if not path.is_file():
        hint = "" if path.parent != SHIPPED else f" (shipped: {', '.join(shipped_names())})"
        raise ConfigError(f"hardware profile {name!r} not found at {path}{hint}; "
                          f"name a shipped one or write one with `edgefed profile --out {path}`")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"hardware profile {path} cannot be read ({exc}); regenerate it with edgefed profile") from None
    return profile_from_dict(raw, str(path))


def profile_from_dict(raw: dict, source: str) -> Profile:
    def bad(key, why):
        return ConfigError(f"hardware profile {source}: {key} {why}")

    if raw.get("format") != FORMAT:
        raise bad("format", f"must be {FORMAT}, found {raw.get('format')!r}")
    for key in ("name",):
        if not isinstance(raw.get(key), str):
            raise bad(key, "must be a string")
    machine, recommend = raw.get("machine", {}), raw.get("recommend", {})
    if not isinstance(machine, dict) or not isinstance(recommend, dict):
        raise bad("[machine]/[recommend]", "must be tables")
    for key in ("arch", "cores", "memory_mb"):
        if key not in machine:
            raise bad(f"machine.{key}", "is missing")
    system = machine.get("system_mb", 0)
    if isinstance(system, bool) or not isinstance(system, (int, float)) or not 0 <= system < machine["memory_mb"]:
        raise bad("machine.system_mb", f"must be a number of MB in [0, memory_mb), found {system!r}")
    speeds = []
    for i, entry in enumerate(raw.get("speed", [])):
        where = f"speed[{i}]"
        if not isinstance(entry, dict):
            raise bad(where, "must be a table ([[speed]])")
        model, params, batch, sps = (entry.get(k) for k in ("model", "params", "batch", "steps_per_s"))
        layers = entry.get("layers", "")
        if model not in TIMED + NAMED:
            raise bad(f"{where}.model", f"must be one of {', '.join(TIMED + NAMED)}, found {model!r}")
        if (model in NAMED) != bool(layers) or not isinstance(layers, str):
            raise bad(f"{where}.layers", 'names the model of a model = "sequential" or "torch" (and only of one)')
        for key, value in (("params", params), ("batch", batch)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(f"{where}.{key}", f"must be a positive integer, found {value!r}")
        if not isinstance(sps, (int, float)) or isinstance(sps, bool) or not sps > 0 or not math.isfinite(sps):
            raise bad(f"{where}.steps_per_s", f"must be a positive number, found {sps!r}")
        prefix = entry.get("prefix_samples_per_s", 0.0)  # (reported: the one-off pass is not on the clock)
        if not isinstance(prefix, (int, float)) or isinstance(prefix, bool) or prefix < 0 or not math.isfinite(prefix):
            raise bad(f"{where}.prefix_samples_per_s", f"must be a number >= 0, found {prefix!r}")
        speed = Speed(model, params, batch, float(sps), layers)
        if any(s.key == speed.key and s.batch == batch for s in speeds):
            raise bad(where, f"repeats model {speed.key!r} at batch {batch}; keep one entry per model and batch")
        speeds.append(speed)
    extra = {k: raw[k] for k in ("startup", "memory", "mpi") if k in raw}
    return Profile(raw["name"], source, bool(raw.get("measured", False)), machine, recommend, tuple(speeds), extra,
                   _power(raw.get("power"), bad), _rank(raw.get("rank"), bad))


def _finite(value, low: float, high: float = math.inf) -> bool:
    return (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            and low <= value < high)


def _rank(table, bad) -> RankCost | None:
    """[rank] checked: lost_share in [0, 1), round_s {model: seconds >= 0} and round_params {model: > 0}."""
    if table is None:
        return None
    if not isinstance(table, dict):
        raise bad("[rank]", "must be a table (lost_share, round_s, round_params)")
    share = table.get("lost_share", 0.0)
    if not _finite(share, 0.0, 1.0):
        raise bad("rank.lost_share", f"must be a share of the window in [0, 1), found {share!r}")
    seconds, params = table.get("round_s", {}), table.get("round_params", {})
    if not isinstance(seconds, dict) or not isinstance(params, dict):
        raise bad("rank.round_s", "and rank.round_params must be tables {model = number}")
    for model, value in seconds.items():
        if not _finite(value, 0.0):
            raise bad(f"rank.round_s.{model}", f"must be a finite number of seconds >= 0, found {value!r}")
        count = params.get(model)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise bad(f"rank.round_params.{model}", f"must be the model's parameter count (> 0), found {count!r}")
    return RankCost(float(share), {k: float(v) for k, v in seconds.items()}, {k: int(params[k]) for k in seconds})


def _power(table, bad) -> Power | None:
    """[power] checked: idle_w and busy_w_per_core, finite watts >= 0 (absent: no energy for the board)."""
    if table is None:
        return None
    if not isinstance(table, dict):
        raise bad("[power]", "must be a table (idle_w, busy_w_per_core)")
    values = []
    for key in ("idle_w", "busy_w_per_core"):
        value = table.get(key)
        if value is None:
            raise bad(f"power.{key}", "is missing (watts; see the shipped profiles for their sources)")
        if not _finite(value, 0.0):
            raise bad(f"power.{key}", f"must be a finite number of watts >= 0, found {value!r}")
        values.append(float(value))
    return Power(*values)


def profile_toml(data: dict, comment: str = "") -> str:
    """A profile dict as TOML, under a comment (its sources or how it was measured)."""
    return "".join(f"# {line}\n" if line else "#\n" for line in comment.splitlines()) + tomli_w.dumps(data)
