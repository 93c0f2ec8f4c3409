"""Every config field checked once, and the defaults that depend on other fields resolved.

The names a key may take come from where they are implemented: algorithms from the algorithm registry,
schemes and weightings from participation/schemes.py, partitions and EMNIST splits from problems/. A
message names the key, the value found and how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from pathlib import Path

from edgefed import compression, hwprofile
from edgefed import layers as layer_lib
from edgefed.algorithms import ALGORITHMS
from edgefed.algorithms import scaffold
from edgefed.participation import schemes
from edgefed.secagg import crypto as secagg_crypto
from edgefed.secagg import fixedpoint
from edgefed.secagg import protocol as secagg_protocol
from edgefed.config.schema import (CompressConfig, Config, DataConfig, DeviceConfig, DynamicsConfig, FedProxConfig, ModelConfig,
                                   ParticipationConfig, SelectionConfig, TrainConfig)
from edgefed.errors import ConfigError
from edgefed.participation import asynchrony
from edgefed.participation import privacy
from edgefed.participation.schemes import SCHEMES, WEIGHTINGS
from edgefed.participation.selection import OORT_DEFAULTS, POLICIES, oort_settings
from edgefed.participation.timing import overselected
from edgefed.problems.idx import EMNIST_SPLITS
from edgefed.problems import cifar, compact, leaf, pool
from edgefed.problems.partition import PARTITIONS

DATA_KINDS = ("synthetic", "quadratic", "mnist", "emnist", "arrays", "leaf", "cifar10", "cifar100")
MODEL_KINDS = ("logreg", "mlp", "cnn", "charlstm", "sequential", "torch", "quadratic")
_ANY = ("sequential", "torch")  # a user's model: on every data kind with samples
MODELS_FOR_DATA = {"synthetic": ("logreg", "mlp") + _ANY, "quadratic": ("quadratic",),
                   "mnist": ("mlp", "cnn", "logreg") + _ANY, "emnist": ("cnn", "mlp", "logreg") + _ANY,
                   "arrays": ("logreg", "mlp", "cnn", "charlstm") + _ANY,
                   "leaf": ("cnn", "mlp", "logreg", "charlstm") + _ANY,
                   "cifar10": ("cnn", "mlp", "logreg") + _ANY, "cifar100": ("cnn", "mlp", "logreg") + _ANY}
DTYPES = ("float32", "float64")
LR_SCHEDULES = ("constant", "staircase")
SAMPLE_LAWS = ("lognormal", "pareto")
PARTICIPATION_MODES = ("full", "trace", "deadline", "async")
ASYNC_ALGORITHMS = ("fedavg", "fedprox")
FAULT_KINDS = ("stall", "raise", "slow_link", "memory")
CLOCKS = ("measured", "simulated")
DEADLINE_COVERS = ("compute", "round")
DEFAULT_QUANTILE = 0.8

DEFAULT_CLIENTS = 30
DEFAULT_LOCAL_STEPS = 20
DEFAULT_MU = 0.01  # FedProx's proximal weight: the middle of the paper's {0.001, 0.01, 0.1, 1}


def _choice(value, choices, key: str) -> None:
    if value not in choices:
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        fix = f"choose one of {', '.join(map(repr, choices))}"
        if hint and not _other_number(str(value), hint[0]):  # (float16 is no typo of float64: there is no float16)
            fix = f"did you mean {hint[0]!r}? ({fix})"
        raise ConfigError(f"config: {key} = {value!r} is not known; {fix}")


def _other_number(a: str, b: str) -> bool:
    """Whether two names differ in their numbers alone (float16 and float64, int4 and int8)."""
    letters = lambda text: "".join(ch for ch in text if not ch.isdigit())  # noqa: E731
    return a != b and letters(a) == letters(b)


def _positive(value, key: str, example: str) -> None:
    if not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise ConfigError(f"config: {key} = {value!r} must be positive (e.g. {example})")


def validate(cfg: Config) -> Config:
    """Check every field and resolve the defaults that depend on other fields."""
    if not 0 <= cfg.seed < 2**64:  # the random streams and the log's attribute hold it as an unsigned 64-bit word
        raise ConfigError(f"config: seed = {cfg.seed} is out of range; give an integer from 0 to {2**64 - 1}")
    _positive(cfg.rounds, "rounds", "rounds = 100")
    data = _validate_data(cfg.data)
    model = _validate_model(cfg.model, data)
    train = _validate_train(cfg.train, data)
    _choice(cfg.scaffold.option, scaffold.OPTIONS, "scaffold.option")
    _choice(cfg.scaffold.init, scaffold.INITS, "scaffold.init")
    _choice(cfg.scaffold.control_gradient, scaffold.CONTROL_GRADIENTS, "scaffold.control_gradient")
    fedprox = _validate_fedprox(cfg.fedprox, train.algorithm)
    participation = _validate_participation(cfg.participation)
    if cfg.mpi.threads_per_rank is not None and cfg.mpi.threads_per_rank < 1:
        raise ConfigError(f"config: mpi.threads_per_rank = {cfg.mpi.threads_per_rank} must be at least 1")
    if cfg.mpi.rank_timeout_s is not None:
        _positive(cfg.mpi.rank_timeout_s, "mpi.rank_timeout_s", "rank_timeout_s = 30")
    _validate_device(cfg.device, cfg.participation)
    compress = _validate_compress(cfg.compress)
    _validate_async(cfg, data, train, compress)
    _validate_secagg(cfg, train, compress)
    _validate_dynamics(cfg.dynamics, cfg.data.clients, cfg.rounds)
    selection = _validate_selection(cfg.selection, participation, train, data.clients, cfg.secagg.enabled)
    _validate_privacy(cfg, participation, train)
    for i, fault in enumerate(cfg.fault):
        _choice(fault.kind, FAULT_KINDS, f"fault[{i}].kind")
        if fault.device < 0 or (cfg.data.clients is not None and fault.device >= cfg.data.clients):
            raise ConfigError(f"config: fault[{i}].device = {fault.device} is not a device id (0-based)")
        if not 1 <= fault.round <= cfg.rounds:
            raise ConfigError(f"config: fault[{i}].round = {fault.round} is not a round (1..{cfg.rounds})")
        if not (fault.seconds >= 0 and math.isfinite(fault.seconds)):
            raise ConfigError(f"config: fault[{i}].seconds = {fault.seconds} must be a finite number >= 0")
        if not (fault.mb >= 0 and math.isfinite(fault.mb)) or (fault.mb > 0) != (fault.kind == "memory"):
            raise ConfigError(f"config: fault[{i}].mb = {fault.mb}: the memory a kind = \"memory\" fault takes, a "
                              "finite number > 0 there and nowhere else")
    if cfg.log.every is not None:
        _positive(cfg.log.every, "log.every", "every = 10")
    _positive(cfg.log.trajectory_mb, "log.trajectory_mb", "trajectory_mb = 100")
    _positive(cfg.log.eval_every, "log.eval_every", "eval_every = 5")
    _positive(cfg.data.cache_mb, "data.cache_mb", "cache_mb = 1024")
    if cfg.log.eval_devices is not None:
        _positive(cfg.log.eval_devices, "log.eval_devices", "eval_devices = 1000")
    return dataclasses.replace(cfg, data=data, model=model, train=train, fedprox=fedprox, participation=participation,
                               compress=compress, selection=selection)


def _validate_privacy(cfg: Config, p: ParticipationConfig, t: TrainConfig) -> None:
    d = cfg.privacy
    _choice(d.mechanism, privacy.MECHANISMS, "privacy.mechanism")
    _choice(d.noise_source, privacy.NOISE_SOURCES, "privacy.noise_source")
    _positive(d.clip, "privacy.clip", "clip = 1.0")
    if d.noise_multiplier is not None and not (d.noise_multiplier >= 0 and math.isfinite(d.noise_multiplier)):
        raise ConfigError(f"config: privacy.noise_multiplier = {d.noise_multiplier} must be a finite number >= 0")
    if d.epsilon is not None:
        _positive(d.epsilon, "privacy.epsilon", "epsilon = 8.0")
    if not 0 < d.target_quantile < 1:
        raise ConfigError(f"config: privacy.target_quantile = {d.target_quantile} must lie in (0, 1) (Andrew et al.: "
                          "0.5, the median update norm)")
    _positive(d.clip_lr, "privacy.clip_lr", "clip_lr = 0.2")
    if d.quantile_noise is not None:
        _positive(d.quantile_noise, "privacy.quantile_noise", "quantile_noise = 1.5")
    if d.adaptive_clip and d.mechanism == "distributed":
        raise ConfigError("config: privacy.adaptive_clip with mechanism = \"distributed\" would need the count of "
                          "unclipped updates summed securely too; use mechanism = \"central\" or a fixed clip")
    if d.delta is not None and not 0 < d.delta < 1:
        raise ConfigError(f"config: privacy.delta = {d.delta} must lie in (0, 1) (e.g. 1e-5, below 1 / N)")
    if d.mechanism == "none":
        return
    if d.mechanism == "distributed" and not cfg.secagg.enabled:
        raise ConfigError('config: privacy.mechanism = "distributed" has each device add its share of the noise '
                          'before secure aggregation masks it: set [secagg] enabled = true (or use "central")')
    if (d.noise_multiplier is None) == (d.epsilon is None):
        raise ConfigError("config: [privacy] needs exactly one of noise_multiplier (z) and epsilon (a target over "
                          "the planned rounds, which sets z)")
    clash = [(key, why) for key, used, why in (
        ('train.algorithm = "scaffold"', t.algorithm == "scaffold",
         "its control variates are a second sum the clip does not bound"),
        ("[secagg] enabled = true", cfg.secagg.enabled and d.mechanism == "central",
         'the coordinator sees only the masked sum and cannot clip a device\'s part: use mechanism = '
         '"distributed"'),
    ) if used]
    if clash:
        key, why = clash[0]
        raise ConfigError(f"config: [privacy] mechanism = {d.mechanism!r} does not take {key}: {why}")


# each policy's own parameters
POLICY_KEYS = {"uniform": (), "fedcs": ("candidates",), "power_of_choice": ("candidates",),
               "oort": tuple(OORT_DEFAULTS) + ("preferred_s", "pacer_delta")}


def _validate_selection(s: SelectionConfig, p: ParticipationConfig, t: TrainConfig, n: int | None,
                        cfg_secagg: bool) -> SelectionConfig:
    _choice(s.policy, POLICIES, "selection.policy")
    for key in POLICY_KEYS["oort"] + ("candidates",):
        if getattr(s, key) is not None and key not in POLICY_KEYS[s.policy]:
            owners = " and ".join(repr(name) for name, keys in POLICY_KEYS.items() if key in keys)
            raise ConfigError(f"config: selection.{key} is a parameter of policy {owners}, not of {s.policy!r}; "
                              "remove it or choose that policy")
    replay = p.mode == "trace" and isinstance(p.trace, str) and p.trace.endswith((".h5", ".hdf5"))
    deadline = p.mode == "deadline" or (p.mode == "async" and p.deadline_s is not None)
    if s.policy == "fedcs" and not deadline and not replay:  # a replay takes the logged selection
        raise ConfigError('config: selection.policy = "fedcs" takes the devices whose work fits the deadline: set '
                          'participation.mode = "deadline" (or "async") and participation.deadline_s')
    if s.policy in ("oort", "power_of_choice") and cfg_secagg:
        raise ConfigError(f"config: selection.policy = {s.policy!r} reads each device's training loss in the clear, "
                          "which [secagg] exists to hide; use \"uniform\" or \"fedcs\" (speeds only) with secure "
                          "aggregation")
    if s.candidates is not None:
        _positive(s.candidates, "selection.candidates", "candidates = 20")
        if n is not None and s.candidates > n:
            raise ConfigError(f"config: selection.candidates = {s.candidates} exceeds the {n} devices (data.clients)")
        count = t.clients_per_round
        if isinstance(count, int) and s.candidates < overselected(count, p.overselect, math.inf):
            count = overselected(count, p.overselect, math.inf)
            raise ConfigError(f"config: selection.candidates = {s.candidates} is fewer than the {count} devices a "
                              "round selects (train.clients_per_round, and participation.overselect's more); "
                              f"ask at least {count}")
    if s.policy != "oort":
        return s
    checked, s = s, oort_settings(s)  # the values as run; the config keeps what was set
    if not (s.alpha >= 0 and math.isfinite(s.alpha)):
        raise ConfigError(f"config: selection.alpha = {s.alpha} must be a finite number >= 0 (Oort's: 2)")
    for key in ("exploration", "exploration_min"):
        if not 0 <= getattr(s, key) <= 1:
            raise ConfigError(f"config: selection.{key} = {getattr(s, key)} must lie in [0, 1] (a share of S)")
    for key in ("exploration_decay", "cut_off"):
        if not 0 < getattr(s, key) <= 1:
            raise ConfigError(f"config: selection.{key} = {getattr(s, key)} must lie in (0, 1] (Oort's: "
                              f"{OORT_DEFAULTS[key]})")
    if s.exploration_min > s.exploration:
        raise ConfigError(f"config: selection.exploration_min = {s.exploration_min} exceeds selection.exploration "
                          f"= {s.exploration}; the share only decays to its floor")
    _positive(s.pacer_step, "selection.pacer_step", "pacer_step = 20")
    if s.preferred_s is not None:
        _positive(s.preferred_s, "selection.preferred_s", "preferred_s = 30.0")
    if s.pacer_delta is not None and not (s.pacer_delta >= 0 and math.isfinite(s.pacer_delta)):
        raise ConfigError(f"config: selection.pacer_delta = {s.pacer_delta} must be a finite number of seconds >= 0")
    return checked


def _validate_async(cfg: Config, data: DataConfig, train: TrainConfig, compress: CompressConfig) -> None:
    a = cfg.asynchronous
    _positive(a.concurrency, "async.concurrency", "concurrency = 10")
    _positive(a.buffer, "async.buffer", "buffer = 5")
    _choice(a.staleness, asynchrony.STALENESS, "async.staleness")
    if not (a.staleness_exponent >= 0 and math.isfinite(a.staleness_exponent)):
        raise ConfigError(f"config: async.staleness_exponent = {a.staleness_exponent} must be a finite number >= 0")
    if a.max_staleness < 0:
        raise ConfigError(f"config: async.max_staleness = {a.max_staleness} must be at least 0")
    if cfg.participation.mode != "async":
        return
    if train.algorithm not in ASYNC_ALGORITHMS:
        raise ConfigError(f'config: participation.mode = "async" runs FedBuff over FedAvg or FedProx local updates, '
                          f'not {train.algorithm!r} (SCAFFOLD\'s controls need synchronous rounds); set '
                          'train.algorithm = "fedavg" or "fedprox"')
    p = cfg.participation
    clash = [(key, fix) for key, used, fix in (
        ("dynamics.arrive/depart", cfg.dynamics.arrive or cfg.dynamics.depart, "remove them"),
        ("participation.overselect", p.overselect > 0, "remove it"),
        ('participation.deadline_covers = "round"', p.deadline_covers == "round", "remove it (a task's deadline "
                                                                                   "bounds its local work)"),
        ('train.lr_schedule = "staircase"', train.lr_schedule == "staircase", "remove it (it counts rounds)"),
        ("compress.downlink", compress.downlink != "none", "remove it"),
        ("compress.error_feedback", compress.error_feedback, "set compress.error_feedback = false"),
        ("[[fault]]", bool(cfg.fault), "remove them")) if used]
    if clash:
        key, fix = clash[0]
        raise ConfigError(f'config: participation.mode = "async" does not take {key} yet; {fix}, or run '
                          'synchronous rounds')
    n = data.clients
    for key, value in (("concurrency", a.concurrency), ("buffer", a.buffer)):
        if n is not None and value > n:
            raise ConfigError(f"config: async.{key} = {value} exceeds the {n} devices (data.clients)")


def _validate_secagg(cfg: Config, train: TrainConfig, compress: CompressConfig) -> None:
    s = cfg.secagg
    _choice(s.bits, fixedpoint.BITS, "secagg.bits")
    _positive(s.clip, "secagg.clip", "clip = 10.0")
    _choice(s.key_source, secagg_protocol.KEY_SOURCES, "secagg.key_source")
    if s.neighbours is not None and s.neighbours < 1:
        raise ConfigError(f"config: secagg.neighbours = {s.neighbours} must be at least 1")
    if s.threshold is not None and s.threshold < 2:
        raise ConfigError(f"config: secagg.threshold = {s.threshold} would let one device's shares unmask its own "
                          "update; use at least 2")
    shares = None if s.neighbours is None else secagg_protocol.degree(s.neighbours) + 1
    if shares is not None and s.threshold is not None and s.threshold > shares:
        raise ConfigError(f"config: secagg.threshold = {s.threshold} exceeds the {shares} shares a device makes "
                          f"(its {shares - 1} neighbours, secagg.neighbours rounded up to even, and itself); "
                          f"use at most {shares}")
    if not s.enabled:
        return
    if train.clients_per_round == 1:
        raise ConfigError("config: [secagg] enabled = true with train.clients_per_round = 1 would show the one "
                          "device's update (every round would be aborted); select at least 2")
    if train.algorithm == "scaffold":
        raise ConfigError('config: [secagg] enabled = true sums one vector, x\'s update; SCAFFOLD\'s controls '
                          'need a second sum with weights of their own; set train.algorithm = "fedavg" or "fedprox"')
    p = cfg.participation
    clash = [(key, fix) for key, used, fix in (
        ('participation.mode = "async"', p.mode == "async", "run synchronous rounds"),
        ("compress.uplink", compress.uplink != "none", 'set compress.uplink = "none" (a masked update looks '
                                                      "random: nothing to compress)"),
        ("participation.scheme = " + repr(p.scheme), p.scheme not in schemes.DEVICE_MULTIPLIERS,
         "choose a rule a device can pre-scale its update for")) if used]
    if clash:
        key, fix = clash[0]
        raise ConfigError(f"config: [secagg] enabled = true does not take {key}; {fix}, or disable [secagg]")
    secagg_crypto.available()


def _validate_compress(c: CompressConfig) -> CompressConfig:
    _choice(c.uplink, compression.KINDS, "compress.uplink")
    _choice(c.downlink, compression.KINDS, "compress.downlink")
    if not 0 < c.topk_fraction <= 1:
        raise ConfigError(f"config: compress.topk_fraction = {c.topk_fraction} must lie in (0, 1] "
                          "(the share of coordinates a top-k message keeps, e.g. 0.01)")
    if c.error_feedback is None:
        return dataclasses.replace(c, error_feedback=c.uplink in compression.LOSSY)
    if c.error_feedback and c.uplink not in compression.LOSSY:
        raise ConfigError(f'config: compress.error_feedback = true needs a lossy compress.uplink (fp16, int8, topk), '
                          f'not {c.uplink!r}; remove error_feedback or choose an uplink')
    return c


def _validate_fedprox(f: FedProxConfig, algorithm: str) -> FedProxConfig:
    if algorithm != "fedprox":
        if f.mu is not None:
            raise ConfigError(f'config: fedprox.mu applies to train.algorithm = "fedprox", not {algorithm!r}; '
                              'remove the [fedprox] table or set train.algorithm = "fedprox"')
        return f
    if f.mu is None:
        return dataclasses.replace(f, mu=DEFAULT_MU)
    if not (f.mu >= 0 and math.isfinite(f.mu)):
        raise ConfigError(f"config: fedprox.mu = {f.mu} must be a finite number >= 0 (e.g. mu = 0.01; 0 is FedAvg)")
    return f


def _validate_device(dev: DeviceConfig, p: ParticipationConfig) -> None:
    for i, load in enumerate(dev.contention):
        if not 0 <= load < 1:
            raise ConfigError(f"config: device.contention[{i}] = {load} must lie in [0, 1) (a CPU share)")
    for i, name in enumerate(dev.boards):
        if not name.strip():
            raise ConfigError(f"config: device.boards[{i}] is empty; name a hardware profile (e.g. \"pi4b\")")
    if dev.profile is not None and not dev.profile.strip():
        raise ConfigError('config: device.profile is empty; name a hardware profile (e.g. "pi4b") or a .toml file')
    for i, speed in enumerate(dev.speed):
        if not (speed > 0 and math.isfinite(speed)):
            raise ConfigError(f"config: device.speed[{i}] = {speed} must be a positive number (1.0: the board's speed)")
    for i, mbps in enumerate(dev.link_mbps):
        if not (mbps > 0 and math.isfinite(mbps)):
            raise ConfigError(f"config: device.link_mbps[{i}] = {mbps} must be a positive number of megabits "
                              "per second (e.g. 20 for a Pi's Wi-Fi)")
    if isinstance(p.deadline_s, str) and p.deadline_s != "adaptive" and dev.profile is None and not dev.boards:
        raise ConfigError(f"config: participation.deadline_s = {p.deadline_s!r} derives each deadline from the "
                          "board's hardware profile; set [device] profile = \"NAME\" (shipped: "
                          f"{', '.join(hwprofile.shipped_names())}) or write one with `edgefed profile --out FILE`")


def _validate_participation(p: ParticipationConfig) -> ParticipationConfig:
    _choice(p.mode, PARTICIPATION_MODES, "participation.mode")
    _choice(p.scheme, tuple(SCHEMES), "participation.scheme")
    if p.mode == "deadline" and p.deadline_s is None:
        raise ConfigError('config: participation.mode = "deadline" needs participation.deadline_s (e.g. 0.05, '
                          '"auto" or "adaptive")')
    if p.mode == "async" and p.deadline_s == "adaptive":
        raise ConfigError('config: participation.deadline_s = "adaptive" needs synchronous rounds; give an async '
                          'task\'s deadline in seconds or as a multiple of its profiled time ("1.5x")')
    if p.deadline_s is not None and p.mode not in ("deadline", "async"):
        raise ConfigError(f'config: participation.deadline_s applies to mode = "deadline" or "async", not {p.mode!r}')
    if isinstance(p.deadline_s, str):  # an async task stops at its deadline as a round's device does
        if p.deadline_s != "adaptive":
            hwprofile.parse_deadline(p.deadline_s)
    elif p.deadline_s is not None:
        _positive(p.deadline_s, "participation.deadline_s", "deadline_s = 0.05")
    if p.deadline_s == "adaptive":
        q = DEFAULT_QUANTILE if p.deadline_quantile is None else p.deadline_quantile
        if not 0 < q <= 1:
            raise ConfigError(f"config: participation.deadline_quantile = {q} must lie in (0, 1] (e.g. 0.8: about "
                              "80 % of the selected devices can finish)")
        p = dataclasses.replace(p, deadline_quantile=float(q))
    elif p.deadline_quantile is not None:
        raise ConfigError('config: participation.deadline_quantile applies to deadline_s = "adaptive"; remove it or '
                          'set participation.deadline_s = "adaptive"')
    _choice(p.deadline_covers, DEADLINE_COVERS, "participation.deadline_covers")
    if p.clock is not None:
        _choice(p.clock, CLOCKS, "participation.clock")
    if not (p.overselect >= 0 and math.isfinite(p.overselect)):
        raise ConfigError(f"config: participation.overselect = {p.overselect} must be a finite number >= 0 "
                          "(e.g. 0.3: select 30 % more devices than needed)")
    if p.overselect > 0 and isinstance(p.trace, str) and p.trace.endswith((".h5", ".hdf5")):
        raise ConfigError("config: participation.overselect does not apply to a replayed run log, whose selection "
                          "and applied reports are the log's; remove it")
    if p.mode == "trace" and not p.trace:
        raise ConfigError('config: participation.mode = "trace" needs participation.trace: "builtin", "builtin:k", '
                          "a trace file, a run log to replay, or a list of trace names")
    replay = isinstance(p.trace, str) and p.trace.endswith((".h5", ".hdf5"))
    if p.mode == "async" and p.trace is not None and not replay:
        raise ConfigError('config: participation.trace with mode = "async" replays an async run\'s log: give its '
                          'RUN.h5')
    if p.mode not in ("trace", "async") and p.trace is not None:
        raise ConfigError(f'config: participation.trace applies to mode = "trace", not {p.mode!r}')
    if not (p.grace_s >= 0 and math.isfinite(p.grace_s)):
        raise ConfigError(f"config: participation.grace_s = {p.grace_s} must be a finite number >= 0")
    for i, load in enumerate(p.contention):
        if not 0 <= load < 1:
            raise ConfigError(f"config: participation.contention[{i}] = {load} must lie in [0, 1) (a CPU share)")
    return p


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
    _positive(d.min_partition_size, "data.min_partition_size", "min_partition_size = 10")
    _positive(d.vocab_size, "data.vocab_size", "vocab_size = 10000")
    if d.shards is not None and d.kind not in ("arrays", "leaf"):
        convert = f"convert it (edgefed data convert {d.path} DATA.h5) and give " if d.path else "give "
        raise ConfigError(f"config: data.shards are a compact arrays file's, not kind = {d.kind!r}'s; {convert}"
                          'kind = "arrays", path = DATA.h5')
    if d.kind != "leaf" and (d.vocab is not None or d.vocab_size != DataConfig.vocab_size):
        raise ConfigError(f"config: data.vocab{'' if d.vocab is not None else '_size'} applies to LEAF Sent140 "
                          f"(kind = \"leaf\"), not {d.kind!r}; remove it")
    if d.vocab is not None and not Path(d.vocab).is_file():
        raise ConfigError(f"config: data.vocab = {d.vocab!r} is not a file; give a text file of words, one a line")
    if d.kind in FILE_KINDS:
        return _validate_file_data(d)
    if d.partition is None:
        d = dataclasses.replace(d, partition="iid")
    for key in ("normalize", "classes"):
        if getattr(d, key) is not None:
            raise ConfigError(f"config: data.{key} applies to kind = \"arrays\", \"leaf\", \"cifar10\" or "
                              f"\"cifar100\", not {d.kind!r}; remove it")
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
            _choice(split, tuple(EMNIST_SPLITS), "data.split")
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


FILE_KINDS = ("arrays", "leaf", "cifar10", "cifar100")
FILE_PATHS = {"arrays": "the .npz or .h5 file of your arrays", "leaf": "a LEAF data folder (train/ and test/)",
              "cifar10": "the cifar-10-batches-py folder", "cifar100": "the cifar-100-python folder"}


def _validate_file_data(d: DataConfig) -> DataConfig:
    """A dataset from files: arrays, LEAF, CIFAR."""
    if d.path is None:
        raise ConfigError(f"config: data.kind = {d.kind!r} needs data.path, {FILE_PATHS[d.kind]} (nothing is "
                          "downloaded)")
    own = compact.defaults(d.path) if d.kind == "arrays" else {}  # (a converted file carries its kind's)
    partition = d.partition or own.get("partition") or ("natural" if d.kind == "leaf" else "iid")
    _choice(partition, PARTITIONS + ("natural",), "data.partition")
    if d.kind == "leaf" and partition != "natural":
        raise ConfigError('config: data.partition for LEAF is "natural" (a device per user); remove it')
    if d.kind.startswith("cifar") and partition == "natural":
        raise ConfigError('config: data.partition = "natural" needs each sample\'s device, which CIFAR does not '
                          "have; choose iid, label, shards or dirichlet")
    normalize = d.normalize or own.get("normalize") or ("unit" if d.kind.startswith("cifar") else "none")
    _choice(normalize, pool.NORMALIZE, "data.normalize")
    split = d.split
    if d.kind == "cifar100":
        split = split or "fine"
        _choice(split, cifar.CIFAR100_SPLITS, "data.split")
    elif split is not None:
        raise ConfigError(f"config: data.split applies to kind = \"emnist\" or \"cifar100\", not {d.kind!r}; "
                          "remove it")
    if d.samples is not None:
        raise ConfigError(f"config: data.samples does not apply to kind = {d.kind!r} (a device holds what the "
                          "partition gives it); remove it")
    if d.classes is not None:
        _positive(d.classes, "data.classes", "classes = 10")
        if d.kind.startswith("cifar"):
            raise ConfigError("config: data.classes is fixed by CIFAR; remove it")
    if not 0 < d.test_fraction < 1:
        raise ConfigError(f"config: data.test_fraction = {d.test_fraction} must lie in (0, 1), e.g. 0.1")
    _positive(d.dirichlet_alpha, "data.dirichlet_alpha", "dirichlet_alpha = 0.5")
    clients = d.clients if d.clients is not None or partition == "natural" else 100
    return dataclasses.replace(d, partition=partition, normalize=normalize, split=split, clients=clients)


def _validate_model(m: ModelConfig, data: DataConfig) -> ModelConfig:
    fits = MODELS_FOR_DATA[data.kind]
    if m.kind is None:
        own = compact.defaults(data.path) if data.kind == "arrays" else {}
        task = leaf.text_task(data.path) if data.kind == "leaf" else own.get("text_task")
        if task == "sent140":
            raise ConfigError(f"config: data.path = {data.path!r} holds LEAF Sent140, which has no built-in model; give "
                              '[model] kind = "sequential" with layers, e.g. [{type = "embedding", num = 10002, dim = '
                              '50}, {type = "lstm", hidden = 64}, {type = "dense", out = 2}]')
        m = dataclasses.replace(m, kind="charlstm" if task == "shakespeare" else own.get("model") or fits[0])
    _choice(m.kind, MODEL_KINDS, "model.kind")
    if m.kind not in fits:
        raise ConfigError(
            f"config: model.kind = {m.kind!r} does not fit data.kind = {data.kind!r}; use {' or '.join(map(repr, fits))}"
        )
    _choice(m.dtype, DTYPES, "model.dtype")
    if not m.hidden or any(h < 1 for h in m.hidden):
        raise ConfigError(f"config: model.hidden = {list(m.hidden)} must list positive layer widths, e.g. [200, 200]")
    _choice(m.loss, layer_lib.LOSSES, "model.loss")
    if m.init is not None:
        _choice(m.init, layer_lib.INITS, "model.init")
    if m.loss == "mse" and data.kind != "arrays":
        raise ConfigError(f'config: model.loss = "mse" trains on float targets, which only data.kind = "arrays" '
                          f'holds (y_train of floats), not {data.kind!r}; use loss = "cross_entropy"')
    if m.weights is None and m.weights_round is not None:
        raise ConfigError("config: model.weights_round picks a round of the run log model.weights names; give "
                          "model.weights, or remove weights_round")
    if m.weights_round is not None and m.weights_round < 0:  # (its type: config/reading.py's _coerce)
        raise ConfigError(f"config: model.weights_round = {m.weights_round!r} must be a round, an integer >= 0")
    if m.weights is not None and m.kind == "quadratic":
        raise ConfigError("config: model.weights does not apply to the quadratic model (x_0 comes from the "
                          "problem); remove it")
    given = [key for key in ("module", "factory") if getattr(m, key) is not None]
    if m.kind == "torch":
        missing = [key for key in ("module", "factory") if key not in given]
        if missing:
            raise ConfigError(f'config: model.kind = "torch" needs model.{missing[0]}: the Python file of your '
                              "module and the function in it that builds it, factory(input_shape, n_classes)")
        if m.layers or m.init is not None:
            raise ConfigError(f'config: model.{"layers" if m.layers else "init"} does not apply to kind = "torch" '
                              "(the module is its own layers and initializes itself); remove it")
        return m
    if given:
        raise ConfigError(f'config: model.{given[0]} applies to kind = "torch", not {m.kind!r}; set model.kind = '
                          '"torch" or remove it')
    if m.kind == "sequential":
        return dataclasses.replace(m, layers=layer_lib.check_layers(m.layers))
    if m.layers:
        raise ConfigError(f'config: model.layers applies to kind = "sequential", not {m.kind!r}; set model.kind = '
                          '"sequential" or remove the layers')
    if m.loss != "cross_entropy":
        raise ConfigError(f'config: model.loss = {m.loss!r} needs kind = "sequential" (the built-in {m.kind} is a '
                          "classifier); give the layers of your model")
    return m


def _validate_train(t: TrainConfig, data: DataConfig) -> TrainConfig:
    _choice(t.algorithm, tuple(ALGORITHMS), "train.algorithm")
    if t.weighting is None:
        t = dataclasses.replace(t, weighting=ALGORITHMS[t.algorithm].default_weighting)
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
    count, d = overselected(cfg.clients_per_round_count(n_clients), cfg.participation.overselect, n_clients), \
        cfg.selection.candidates
    if d is not None and not count <= d <= n_clients:
        fix = f"ask at least {count}" if d < count else f"ask at most {n_clients}"
        raise ConfigError(f"config: selection.candidates = {d} must lie between the {count} devices a round selects "
                          f"(with over-selection's) and the {n_clients} of the federation; {fix}")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, clients=n_clients))
    return validate(cfg)  # device ids in [[dynamics.*]] and [[fault]] now checked against this N
