"""TOML config -> frozen dataclasses, validated once, with messages that name the key and how to fix it.

The keys are the contract of DESIGN 3.2. `load_config` reads a file (or the built-in default), applies
`--set table.key=value` overrides, and returns a `Config` whose every field is checked and resolved (for
example `model.kind` filled in from `data.kind`). `to_toml` writes the effective config back out; the run log
stores that text, and `--resume` compares it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from edgefed import hwprofile
from edgefed.errors import ConfigError

DATA_KINDS = ("synthetic", "quadratic", "mnist", "emnist")
MODEL_KINDS = ("logreg", "mlp", "cnn", "quadratic")
MODELS_FOR_DATA = {"synthetic": ("logreg", "mlp"), "quadratic": ("quadratic",), "mnist": ("mlp", "cnn", "logreg"),
                   "emnist": ("cnn", "mlp", "logreg")}
PARTITIONS = ("iid", "label", "shards", "dirichlet")
EMNIST_SPLITS = ("byclass", "bymerge", "balanced", "letters", "digits", "mnist")
DTYPES = ("float32", "float64")
ALGORITHMS = ("fedavg", "scaffold")
DEFAULT_WEIGHTING = {"fedavg": "count_selected", "scaffold": "uniform"}  # scaffold: seed 002's 1/S
SCAFFOLD_OPTIONS = ("I", "II")
SCAFFOLD_INITS = ("zero", "gradient")
CONTROL_GRADIENTS = ("oracle", "full")
WEIGHTINGS = ("uniform", "count_global", "count_selected")
LR_SCHEDULES = ("constant", "staircase")
SAMPLE_LAWS = ("lognormal", "pareto")
PARTICIPATION_MODES = ("full", "trace", "deadline")
FAULT_KINDS = ("stall", "raise")
SCHEMES = ("A", "B", "C")

DEFAULT_CLIENTS = 30
DEFAULT_LOCAL_STEPS = 20
PARETO_DEFAULT_MAX = 5000


@dataclass(frozen=True)
class DataConfig:
    kind: str = "synthetic"
    clients: int | None = None  # N; None: 30 for synthetic, the file's N for a quadratic file
    path: str | None = None
    alpha: float = 1.0
    beta: float = 1.0
    iid: bool = False
    samples: str | int | None = None  # synthetic: "lognormal" (FedProx, default), "pareto" or a count;
    # images: "partition" (default: as the partition gives) or "pareto" (with partition = "iid")
    samples_min: int = 50  # Pareto scale (floor)
    samples_max: int | None = None  # cap; None: uncapped for lognormal (as FedProx), 5000 for pareto
    test_fraction: float = 0.1
    noise_std: float = 0.0  # quadratic oracle noise
    dim: int = 10  # generated quadratic (no path) only
    split: str | None = None  # EMNIST split; None: "bymerge" (the flexible-participation paper's)
    partition: str = "iid"  # images: "iid", "label", "shards", "dirichlet"
    dirichlet_alpha: float = 0.5
    holdout: int = 2000  # images held out for testing when data.path holds only the test files


@dataclass(frozen=True)
class ModelConfig:
    kind: str | None = None  # None: the data's natural model
    dtype: str = "float32"
    hidden: tuple[int, ...] = (200, 200)  # mlp hidden layers (McMahan et al.'s 2NN)


@dataclass(frozen=True)
class TrainConfig:
    algorithm: str = "fedavg"
    weighting: str | None = None  # None: count_selected for fedavg, uniform for scaffold
    clients_per_round: int | float | str = 10
    local_steps: int | None = None  # K; None: 20 unless local_epochs is given
    local_epochs: int | float | None = None  # E; K_k = ceil(E * n_k / B) per device
    batch_size: int | str = 20
    lr_local: float = 0.05
    lr_global: float = 1.0
    lr_schedule: str = "constant"


@dataclass(frozen=True)
class ScaffoldConfig:
    option: str = "II"  # control update: "I" c_k+ = g_k(x), "II" c_k - c + (x - y_k) / (s_k lr)
    init: str = "zero"  # "zero", or "gradient": c_k^0 = full local gradient at x_0 (the seed's rates)
    control_gradient: str = "oracle"  # option I's g_k(x): "oracle" (one minibatch, as the seed) or "full"


@dataclass(frozen=True)
class ParticipationConfig:
    mode: str = "full"  # "full": K steps; "trace": the steps a trace gives; "deadline": what fits in deadline_s
    scheme: str = "B"
    trace: str | tuple[str, ...] | None = None  # trace mode: "builtin[:k]", a trace file, a run log, or names
    deadline_s: float | str | None = None  # deadline mode: seconds per device and round, or "auto" / "1.5x":
    # that multiple of the time K steps take on the device's board ([device] profiles; "auto" = 1.1x)
    grace_s: float = 1.0  # a device silent past deadline + grace is recorded inactive for the round
    contention: tuple[float, ...] = ()  # CPU competitor load per device (cycled), as the paper's 0..0.9


@dataclass(frozen=True)
class ArrivalConfig:
    device: int
    round: int  # the first round the device is part of the federation


@dataclass(frozen=True)
class DepartureConfig:
    device: int
    round: int  # the first round the device is gone
    policy: str = "exclude"  # "exclude": shift the objective; "include": keep it (the device just falls silent)


@dataclass(frozen=True)
class DynamicsConfig:
    arrive: tuple[ArrivalConfig, ...] = ()
    depart: tuple[DepartureConfig, ...] = ()
    fast_reboot: bool = False  # boost an arriving device's coefficient by 1 + (b - 1) / (r - r0 + 1)^2
    boost: float = 3.0  # b


@dataclass(frozen=True)
class MpiConfig:
    device_ranks: tuple[int, ...] = ()  # rank hosting each device; empty: round-robin over ranks 1..P-1


@dataclass(frozen=True)
class DeviceConfig:
    profile: str | None = None  # hardware profile of the boards: a name in hw_profiles/ or a .toml file
    boards: tuple[str, ...] = ()  # under MPI, each device rank's board (entry i: rank i + 1), overriding profile
    contention: tuple[float, ...] = ()  # under MPI, the CPU competitor load on each device rank's board
    # (entry i: rank i + 1), for every device it hosts; overrides participation.contention there


@dataclass(frozen=True)
class FaultConfig:
    """A fault injected into one device's local work in one round, to test what the runtime does."""

    device: int
    round: int
    kind: str = "stall"  # "stall": sleep `seconds` (a hung device); "raise": fail with an error
    seconds: float = 0.0


@dataclass(frozen=True)
class LogConfig:
    path: str | None = None
    every: int = 1
    eval_every: int = 1
    client_controls: bool = False  # also log every device's SCAFFOLD control at the stored rounds


@dataclass(frozen=True)
class Config:
    seed: int = 0
    rounds: int = 100
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    scaffold: ScaffoldConfig = field(default_factory=ScaffoldConfig)
    participation: ParticipationConfig = field(default_factory=ParticipationConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dynamics: DynamicsConfig = field(default_factory=DynamicsConfig)
    mpi: MpiConfig = field(default_factory=MpiConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    fault: tuple[FaultConfig, ...] = ()

    @property
    def n_clients(self) -> int:
        return self.data.clients

    def clients_per_round_count(self, n_clients: int) -> int:
        """S for a federation of n_clients: a count, McMahan's max(ceil(C*N), 1), or all."""
        s = self.train.clients_per_round
        if s == "all":
            return n_clients
        if isinstance(s, float):
            return max(math.ceil(s * n_clients - 1e-9), 1)  # 0.07 * 100 is 7.000000000000001 in floats
        return s


TABLES = {f.name: f.default_factory for f in dataclasses.fields(Config) if f.default_factory is not dataclasses.MISSING}
TOP_KEYS = tuple(f.name for f in dataclasses.fields(Config) if f.name not in TABLES)  # seed, rounds, fault


# --------------------------------------------------------------------------- reading


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read CONFIG.toml (None: the built-in default), apply `table.key=value` overrides, validate."""
    raw = {} if path is None else read_toml(path)
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw)


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


def apply_override(raw: dict, item: str) -> None:
    """`train.local_steps=10`: the value is read as TOML, or taken as a bare string if it is not TOML."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {item!r} is not KEY=VALUE; write it like --set train.local_steps=10")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
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
        tables[name] = _build(cls, sub, name)
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


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _describe(value) -> str:
    for t in (bool, int, float, str):
        if isinstance(value, t):
            return _TYPE_NAMES[t]
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


# --------------------------------------------------------------------------- validation


def _choice(value, choices, key: str) -> None:
    if value not in choices:
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        fix = f"did you mean {hint[0]!r}?" if hint else f"choose one of {', '.join(map(repr, choices))}"
        raise ConfigError(f"config: {key} = {value!r} is not known; {fix}")


def _positive(value, key: str, example: str) -> None:
    if not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"config: {key} = {value!r} must be positive (e.g. {example})")


def validate(cfg: Config) -> Config:
    """Check every field and resolve the defaults that depend on other fields."""
    if cfg.seed < 0:
        raise ConfigError(f"config: seed = {cfg.seed} must be a non-negative integer")
    _positive(cfg.rounds, "rounds", "rounds = 100")
    data = _validate_data(cfg.data)
    model = _validate_model(cfg.model, data)
    train = _validate_train(cfg.train, data)
    _choice(cfg.scaffold.option, SCAFFOLD_OPTIONS, "scaffold.option")
    _choice(cfg.scaffold.init, SCAFFOLD_INITS, "scaffold.init")
    _choice(cfg.scaffold.control_gradient, CONTROL_GRADIENTS, "scaffold.control_gradient")
    _validate_participation(cfg.participation)
    _validate_device(cfg.device, cfg.participation)
    _validate_dynamics(cfg.dynamics, cfg.data.clients, cfg.rounds)
    for i, fault in enumerate(cfg.fault):
        _choice(fault.kind, FAULT_KINDS, f"fault[{i}].kind")
        if fault.device < 0 or (cfg.data.clients is not None and fault.device >= cfg.data.clients):
            raise ConfigError(f"config: fault[{i}].device = {fault.device} is not a device id (0-based)")
        if not 1 <= fault.round <= cfg.rounds:
            raise ConfigError(f"config: fault[{i}].round = {fault.round} is not a round (1..{cfg.rounds})")
    _positive(cfg.log.every, "log.every", "every = 10")
    _positive(cfg.log.eval_every, "log.eval_every", "eval_every = 5")
    return dataclasses.replace(cfg, data=data, model=model, train=train)


def _validate_device(dev: DeviceConfig, p: ParticipationConfig) -> None:
    for i, load in enumerate(dev.contention):
        if not 0 <= load < 1:
            raise ConfigError(f"config: device.contention[{i}] = {load} must lie in [0, 1) (a CPU share)")
    for i, name in enumerate(dev.boards):
        if not name.strip():
            raise ConfigError(f"config: device.boards[{i}] is empty; name a hardware profile (e.g. \"pi4b\")")
    if dev.profile is not None and not dev.profile.strip():
        raise ConfigError('config: device.profile is empty; name a hardware profile (e.g. "pi4b") or a .toml file')
    if isinstance(p.deadline_s, str) and dev.profile is None and not dev.boards:
        raise ConfigError(f"config: participation.deadline_s = {p.deadline_s!r} derives each deadline from the "
                          "board's hardware profile; set [device] profile = \"NAME\" (shipped: "
                          f"{', '.join(hwprofile.shipped_names())}) or write one with `edgefed profile --out FILE`")


def _validate_participation(p: ParticipationConfig) -> None:
    _choice(p.mode, PARTICIPATION_MODES, "participation.mode")
    _choice(p.scheme, SCHEMES, "participation.scheme")
    if p.mode == "deadline":
        if p.deadline_s is None:
            raise ConfigError('config: participation.mode = "deadline" needs participation.deadline_s (e.g. 0.05)')
        if isinstance(p.deadline_s, str):
            hwprofile.parse_deadline(p.deadline_s)
        else:
            _positive(p.deadline_s, "participation.deadline_s", "deadline_s = 0.05")
    elif p.deadline_s is not None:
        raise ConfigError(f'config: participation.deadline_s applies to mode = "deadline", not {p.mode!r}')
    if p.mode == "trace" and not p.trace:
        raise ConfigError('config: participation.mode = "trace" needs participation.trace: "builtin", "builtin:k", '
                          "a trace file, a run log to replay, or a list of trace names")
    if p.mode != "trace" and p.trace is not None:
        raise ConfigError(f'config: participation.trace applies to mode = "trace", not {p.mode!r}')
    if not (p.grace_s >= 0 and math.isfinite(p.grace_s)):
        raise ConfigError(f"config: participation.grace_s = {p.grace_s} must be a finite number >= 0")
    for i, load in enumerate(p.contention):
        if not 0 <= load < 1:
            raise ConfigError(f"config: participation.contention[{i}] = {load} must lie in [0, 1) (a CPU share)")


def _validate_dynamics(dyn: DynamicsConfig, n_clients: int | None, rounds: int) -> None:
    for kind, events in (("arrive", dyn.arrive), ("depart", dyn.depart)):
        seen = set()
        for i, e in enumerate(events):
            key = f"dynamics.{kind}[{i}]"
            if e.device < 0 or (n_clients is not None and e.device >= n_clients):
                raise ConfigError(f"config: {key}.device = {e.device} is not a device id (0-based)")
            if not 1 <= e.round <= rounds:
                raise ConfigError(f"config: {key}.round = {e.round} is not a round (1..{rounds})")
            if e.device in seen:
                raise ConfigError(f"config: {key}: device {e.device} can {kind} only once")
            seen.add(e.device)
            if kind == "depart":
                _choice(e.policy, ("include", "exclude"), f"{key}.policy")
    arrivals = {e.device: e.round for e in dyn.arrive}
    for i, e in enumerate(dyn.depart):
        if e.device in arrivals and e.round <= arrivals[e.device]:
            raise ConfigError(f"config: dynamics.depart[{i}]: device {e.device} departs in round {e.round}, "
                              f"not after it arrives (round {arrivals[e.device]})")
    if not (dyn.boost >= 1 and math.isfinite(dyn.boost)):
        raise ConfigError(f"config: dynamics.boost = {dyn.boost} must be a finite number >= 1 (the paper uses 3)")


def _validate_data(d: DataConfig) -> DataConfig:
    _choice(d.kind, DATA_KINDS, "data.kind")
    if d.clients is not None:
        _positive(d.clients, "data.clients", "clients = 30")
    if d.kind in ("mnist", "emnist"):
        if d.path is None:
            raise ConfigError(f"config: data.kind = {d.kind!r} needs data.path, the folder of its IDX files "
                              "(nothing is downloaded)")
        _choice(d.partition, PARTITIONS, "data.partition")
        samples = "partition" if d.samples is None else d.samples
        if samples not in ("partition", "pareto"):
            raise ConfigError(f'config: data.samples = {samples!r} for images: "partition" or "pareto"')
        if samples == "pareto" and d.partition != "iid":
            raise ConfigError('config: data.samples = "pareto" sizes an "iid" partition; drop it or use partition = "iid"')
        split = d.split or ("bymerge" if d.kind == "emnist" else None)
        if d.kind == "emnist":
            _choice(split, EMNIST_SPLITS, "data.split")
        elif split is not None:
            raise ConfigError("config: data.split applies to kind = \"emnist\"; remove it")
        _positive(d.dirichlet_alpha, "data.dirichlet_alpha", "dirichlet_alpha = 0.5")
        _positive(d.holdout, "data.holdout", "holdout = 2000")
        d = dataclasses.replace(d, samples=samples, split=split, clients=d.clients or 100)
    if d.kind == "synthetic":
        if d.samples is None:
            d = dataclasses.replace(d, samples="lognormal")
        if d.path is not None:
            raise ConfigError("config: data.path does not apply to kind = \"synthetic\" (it is generated); remove it")
        for key in ("alpha", "beta"):
            value = getattr(d, key)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"config: data.{key} = {value} must be a finite number >= 0")
        if isinstance(d.samples, str):
            _choice(d.samples, SAMPLE_LAWS, "data.samples")
        elif d.samples < 2:
            raise ConfigError(f"config: data.samples = {d.samples}; a device needs at least 2 samples (one to train, "
                              'one to test), e.g. samples = 200, or "lognormal" / "pareto"')
        if d.samples_min < 2:
            raise ConfigError(f"config: data.samples_min = {d.samples_min}; a device needs at least 2 samples")
        if d.samples_max is not None and d.samples_max < d.samples_min:
            raise ConfigError(f"config: data.samples_max = {d.samples_max} is below samples_min = {d.samples_min}")
        if not 0 < d.test_fraction < 1:
            raise ConfigError(f"config: data.test_fraction = {d.test_fraction} must lie in (0, 1), e.g. 0.1")
        if d.clients is None:
            d = dataclasses.replace(d, clients=DEFAULT_CLIENTS)
    if d.kind == "quadratic":
        if not (d.noise_std >= 0 and math.isfinite(d.noise_std)):
            raise ConfigError(f"config: data.noise_std = {d.noise_std} must be a finite number >= 0")
        _positive(d.dim, "data.dim", "dim = 10")
        if d.path is None and d.clients is None:
            d = dataclasses.replace(d, clients=DEFAULT_CLIENTS)
    return d


def _validate_model(m: ModelConfig, data: DataConfig) -> ModelConfig:
    fits = MODELS_FOR_DATA[data.kind]
    if m.kind is None:
        m = dataclasses.replace(m, kind=fits[0])
    _choice(m.kind, MODEL_KINDS, "model.kind")
    if m.kind not in fits:
        raise ConfigError(
            f"config: model.kind = {m.kind!r} does not fit data.kind = {data.kind!r}; use {' or '.join(map(repr, fits))}"
        )
    _choice(m.dtype, DTYPES, "model.dtype")
    if not m.hidden or any(h < 1 for h in m.hidden):
        raise ConfigError(f"config: model.hidden = {list(m.hidden)} must list positive layer widths, e.g. [200, 200]")
    return m


def _validate_train(t: TrainConfig, data: DataConfig) -> TrainConfig:
    _choice(t.algorithm, ALGORITHMS, "train.algorithm")
    if t.weighting is None:
        t = dataclasses.replace(t, weighting=DEFAULT_WEIGHTING[t.algorithm])
    _choice(t.weighting, WEIGHTINGS, "train.weighting")
    _choice(t.lr_schedule, LR_SCHEDULES, "train.lr_schedule")
    _positive(t.lr_local, "train.lr_local", "lr_local = 0.05")
    _positive(t.lr_global, "train.lr_global", "lr_global = 1.0")
    s = t.clients_per_round
    if isinstance(s, str):
        if s != "all":
            raise ConfigError(
                f"config: train.clients_per_round = {s!r}; give a count (10), a fraction in (0, 1] (0.1) or \"all\""
            )
    elif isinstance(s, float):
        if not 0 < s <= 1:
            raise ConfigError(
                f"config: train.clients_per_round = {s} is a fraction and must lie in (0, 1]; "
                "write an integer for a count"
            )
    elif s < 1:
        raise ConfigError(f"config: train.clients_per_round = {s} must be at least 1")
    if data.clients is not None:
        check_clients_per_round(t, data.clients)
    if isinstance(t.batch_size, str):
        if t.batch_size != "full":
            raise ConfigError(f"config: train.batch_size = {t.batch_size!r}; give a positive integer or \"full\"")
    else:
        _positive(t.batch_size, "train.batch_size", "batch_size = 20, or \"full\"")
    if t.local_steps is not None and t.local_epochs is not None:
        raise ConfigError("config: give train.local_steps or train.local_epochs, not both")
    if t.local_epochs is not None:
        _positive(t.local_epochs, "train.local_epochs", "local_epochs = 1")
    elif t.local_steps is None:
        t = dataclasses.replace(t, local_steps=DEFAULT_LOCAL_STEPS)
    elif t.local_steps < 1:
        raise ConfigError(f"config: train.local_steps = {t.local_steps}; K must be at least 1 (e.g. local_steps = 20)")
    return t


def check_clients_per_round(t: TrainConfig, n_clients: int) -> None:
    s = t.clients_per_round
    if isinstance(s, int) and s > n_clients:
        raise ConfigError(
            f"config: train.clients_per_round = {s} exceeds the {n_clients} devices (data.clients); "
            f"use at most {n_clients} or \"all\""
        )


def with_clients(cfg: Config, n_clients: int) -> Config:
    """The config once the problem has fixed N (a quadratic file decides it)."""
    if cfg.data.clients is not None and cfg.data.clients != n_clients:
        raise ConfigError(
            f"config: data.clients = {cfg.data.clients} but the problem file {cfg.data.path} has {n_clients} devices; "
            "remove data.clients or make them agree"
        )
    check_clients_per_round(cfg.train, n_clients)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, clients=n_clients))
    return validate(cfg)  # device ids in [[dynamics.*]] and [[fault]] now checked against this N


# --------------------------------------------------------------------------- writing


def to_dict(cfg: Config) -> dict:
    """The config as plain TOML-able data; None fields are left out (they mean "default")."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = {k: list(v) if isinstance(v, tuple) else v
                           for k, v in dataclasses.asdict(value).items() if v is not None}
        elif isinstance(value, tuple):
            if value:
                out[f.name] = [dataclasses.asdict(item) for item in value]
        elif value is not None:
            out[f.name] = value
    return out


def to_toml(cfg: Config) -> str:
    return toml_text(to_dict(cfg))


def toml_text(data: dict) -> str:
    """Plain keys, then tables (a dict inside a table is written inline), then arrays of tables, as TOML."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, (dict, list))]
    for name, table in data.items():
        if isinstance(table, dict):
            lines.append(f"\n[{name}]")
            for k, v in table.items():
                if isinstance(v, dict):
                    inner = ", ".join(f"{ik} = {_toml_value(iv)}" for ik, iv in v.items())
                    lines.append(f"{k} = {{ {inner} }}")
                elif not _is_tables(v):
                    lines.append(f"{k} = {_toml_value(v)}")
            for key, tables in table.items():
                if _is_tables(tables):
                    for sub in tables:
                        lines.append(f"\n[[{name}.{key}]]")
                        lines.extend(f"{k} = {_toml_value(v)}" for k, v in sub.items())
    for name, tables in data.items():
        if isinstance(tables, list):
            for table in tables:
                lines.append(f"\n[[{name}]]")
                lines.extend(f"{k} = {_toml_value(v)}" for k, v in table.items())
    return "\n".join(lines) + "\n"


def _is_tables(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(item, dict) for item in v)


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        text = repr(v)
        return text if any(ch in text for ch in ".en") else text + ".0"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def same_experiment(a: Config, b: Config) -> list[str]:
    """Keys (table.key) where two configs differ, ignoring where the log is written."""
    da, db = to_dict(a), to_dict(b)
    for d in (da, db):
        d.get("log", {}).pop("path", None)
    diffs = []
    for key in sorted(set(da) | set(db)):
        va, vb = da.get(key), db.get(key)
        if key == "participation":  # a replay may name its trace by another path; the trace itself is checked
            for d in (va, vb):
                (d or {}).pop("trace", None)
        if isinstance(va, dict) or isinstance(vb, dict):
            va, vb = va or {}, vb or {}
            diffs += [f"{key}.{k}" for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)]
        elif va != vb:
            diffs.append(key)
    return diffs
