"""Every config field checked once, and the defaults that depend on other fields resolved.

The names a key may take come from where they are implemented: algorithms from the algorithm registry,
schemes and weightings from participation/schemes.py, partitions and EMNIST splits from problems/. A
message names the key, the value found and how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from edgefed import hwprofile
from edgefed import layers as layer_lib
from edgefed.algorithms import ALGORITHMS
from edgefed.algorithms import scaffold
from edgefed.config.checks import choice, positive
from edgefed.config.policies import (validate_async, validate_compress, validate_privacy, validate_secagg,
                                     validate_selection, validate_submodel)
from edgefed.config.schema import (Config, DataConfig, DeviceConfig, DynamicsConfig, FedProxConfig, ModelConfig,
                                   ParticipationConfig, TrainConfig)
from edgefed.errors import ConfigError
from edgefed.participation.schemes import SCHEMES, WEIGHTINGS
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
FAULT_KINDS = ("stall", "raise", "slow_link", "memory")
CLOCKS = ("measured", "simulated")
DEADLINE_COVERS = ("compute", "round")
DEFAULT_QUANTILE = 0.8

DEFAULT_CLIENTS = 30
DEFAULT_LOCAL_STEPS = 20
DEFAULT_MU = 0.01  # FedProx's proximal weight: the middle of the paper's {0.001, 0.01, 0.1, 1}


def validate(cfg: Config) -> Config:
    """Check every field and resolve the defaults that depend on other fields."""
    if not 0 <= cfg.seed < 2**64:  # the random streams and the log's attribute hold it as an unsigned 64-bit word
        raise ConfigError(f"config: seed = {cfg.seed} is out of range; give an integer from 0 to {2**64 - 1}")
    positive(cfg.rounds, "rounds", "rounds = 100")
    data = _validate_data(cfg.data)
    model = _validate_model(cfg.model, data)
    train = _validate_train(cfg.train, data)
    choice(cfg.scaffold.option, scaffold.OPTIONS, "scaffold.option")
    choice(cfg.scaffold.init, scaffold.INITS, "scaffold.init")
    choice(cfg.scaffold.control_gradient, scaffold.CONTROL_GRADIENTS, "scaffold.control_gradient")
    fedprox = _validate_fedprox(cfg.fedprox, train.algorithm)
    participation = _validate_participation(cfg.participation)
    if cfg.mpi.threads_per_rank is not None and cfg.mpi.threads_per_rank < 1:
        raise ConfigError(f"config: mpi.threads_per_rank = {cfg.mpi.threads_per_rank} must be at least 1")
    if cfg.mpi.rank_timeout_s is not None:
        positive(cfg.mpi.rank_timeout_s, "mpi.rank_timeout_s", "rank_timeout_s = 30")
    positive(cfg.mpi.rejoin_check_s, "mpi.rejoin_check_s", "rejoin_check_s = 10")
    _validate_away(cfg.mpi.away, cfg.data.clients, cfg.rounds)
    _validate_device(cfg.device, cfg.participation)
    compress = validate_compress(cfg.compress)
    validate_async(cfg, data, train, compress)
    validate_secagg(cfg, train, compress)
    _validate_dynamics(cfg.dynamics, cfg.data.clients, cfg.rounds)
    selection = validate_selection(cfg.selection, participation, train, data.clients, cfg.secagg.enabled)
    validate_privacy(cfg, participation, train)
    submodel = validate_submodel(cfg, train, compress)
    for i, fault in enumerate(cfg.fault):
        choice(fault.kind, FAULT_KINDS, f"fault[{i}].kind")
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
        positive(cfg.log.every, "log.every", "every = 10")
    positive(cfg.log.trajectory_mb, "log.trajectory_mb", "trajectory_mb = 100")
    positive(cfg.log.eval_every, "log.eval_every", "eval_every = 5")
    positive(cfg.data.cache_mb, "data.cache_mb", "cache_mb = 1024")
    if cfg.log.eval_devices is not None:
        positive(cfg.log.eval_devices, "log.eval_devices", "eval_devices = 1000")
    return dataclasses.replace(cfg, data=data, model=model, train=train, fedprox=fedprox, participation=participation,
                               compress=compress, selection=selection, submodel=submodel)


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
    choice(p.mode, PARTICIPATION_MODES, "participation.mode")
    choice(p.scheme, tuple(SCHEMES), "participation.scheme")
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
        positive(p.deadline_s, "participation.deadline_s", "deadline_s = 0.05")
    if p.deadline_s == "adaptive":
        q = DEFAULT_QUANTILE if p.deadline_quantile is None else p.deadline_quantile
        if not 0 < q <= 1:
            raise ConfigError(f"config: participation.deadline_quantile = {q} must lie in (0, 1] (e.g. 0.8: about "
                              "80 % of the selected devices can finish)")
        p = dataclasses.replace(p, deadline_quantile=float(q))
    elif p.deadline_quantile is not None:
        raise ConfigError('config: participation.deadline_quantile applies to deadline_s = "adaptive"; remove it or '
                          'set participation.deadline_s = "adaptive"')
    choice(p.deadline_covers, DEADLINE_COVERS, "participation.deadline_covers")
    if p.clock is not None:
        choice(p.clock, CLOCKS, "participation.clock")
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
                choice(e.policy, ("include", "exclude"), f"{key}.policy")
    arrivals = {e.device: e.round for e in dyn.arrive}
    for i, e in enumerate(dyn.depart):
        if e.device in arrivals and e.round <= arrivals[e.device]:
            raise ConfigError(f"config: dynamics.depart[{i}]: device {e.device} departs in round {e.round}, "
                              f"not after it arrives (round {arrivals[e.device]})")
    if not (dyn.boost >= 1 and math.isfinite(dyn.boost)):
        raise ConfigError(f"config: dynamics.boost = {dyn.boost} must be a finite number >= 1 (the paper uses 3)")


def _validate_away(away, n_clients: int | None, rounds: int) -> None:
    """[[mpi.away]]: device ids, a first round away in 1..rounds, a round back after it; no device away twice at
    once."""
    spans = {}
    for i, e in enumerate(away):
        key = f"mpi.away[{i}]"
        bad = [k for k in e.devices if k < 0 or (n_clients is not None and k >= n_clients)]
        if bad:
            raise ConfigError(f"config: {key}.devices holds {bad[0]}, not a device id (0-based)")
        if not 1 <= e.round <= rounds:
            raise ConfigError(f"config: {key}.round = {e.round} is not a round (1..{rounds})")
        if e.back is not None and e.back <= e.round:
            raise ConfigError(f"config: {key}.back = {e.back} must come after its round ({e.round})")
        end = math.inf if e.back is None else e.back
        for k in e.devices:
            clash = [j for j, (r0, r1) in spans.get(k, []) if r0 < end and e.round < r1]
            if clash:
                raise ConfigError(f"config: {key}: device {k} is already away then (mpi.away[{clash[0]}])")
            spans.setdefault(k, []).append((i, (e.round, end)))


def _validate_data(d: DataConfig) -> DataConfig:
    choice(d.kind, DATA_KINDS, "data.kind")
    if d.clients is not None:
        positive(d.clients, "data.clients", "clients = 30")
    positive(d.min_partition_size, "data.min_partition_size", "min_partition_size = 10")
    positive(d.vocab_size, "data.vocab_size", "vocab_size = 10000")
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
        choice(d.partition, PARTITIONS, "data.partition")
        samples = "partition" if d.samples is None else d.samples
        if samples not in ("partition", "pareto"):
            raise ConfigError(f'config: data.samples = {samples!r} for images: "partition" or "pareto"')
        if samples == "pareto" and d.partition != "iid":
            raise ConfigError('config: data.samples = "pareto" sizes an "iid" partition; drop it or use partition = "iid"')
        split = d.split or ("bymerge" if d.kind == "emnist" else None)
        if d.kind == "emnist":
            choice(split, tuple(EMNIST_SPLITS), "data.split")
        elif split is not None:
            raise ConfigError("config: data.split applies to kind = \"emnist\"; remove it")
        positive(d.dirichlet_alpha, "data.dirichlet_alpha", "dirichlet_alpha = 0.5")
        positive(d.holdout, "data.holdout", "holdout = 2000")
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
            choice(d.samples, SAMPLE_LAWS, "data.samples")
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
        positive(d.dim, "data.dim", "dim = 10")
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
    choice(partition, PARTITIONS + ("natural",), "data.partition")
    if d.kind == "leaf" and partition != "natural":
        raise ConfigError('config: data.partition for LEAF is "natural" (a device per user); remove it')
    if d.kind.startswith("cifar") and partition == "natural":
        raise ConfigError('config: data.partition = "natural" needs each sample\'s device, which CIFAR does not '
                          "have; choose iid, label, shards or dirichlet")
    normalize = d.normalize or own.get("normalize") or ("unit" if d.kind.startswith("cifar") else "none")
    choice(normalize, pool.NORMALIZE, "data.normalize")
    split = d.split
    if d.kind == "cifar100":
        split = split or "fine"
        choice(split, cifar.CIFAR100_SPLITS, "data.split")
    elif split is not None:
        raise ConfigError(f"config: data.split applies to kind = \"emnist\" or \"cifar100\", not {d.kind!r}; "
                          "remove it")
    if d.samples is not None:
        raise ConfigError(f"config: data.samples does not apply to kind = {d.kind!r} (a device holds what the "
                          "partition gives it); remove it")
    if d.classes is not None:
        positive(d.classes, "data.classes", "classes = 10")
        if d.kind.startswith("cifar"):
            raise ConfigError("config: data.classes is fixed by CIFAR; remove it")
    if not 0 < d.test_fraction < 1:
        raise ConfigError(f"config: data.test_fraction = {d.test_fraction} must lie in (0, 1), e.g. 0.1")
    positive(d.dirichlet_alpha, "data.dirichlet_alpha", "dirichlet_alpha = 0.5")
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
    choice(m.kind, MODEL_KINDS, "model.kind")
    if m.kind not in fits:
        raise ConfigError(
            f"config: model.kind = {m.kind!r} does not fit data.kind = {data.kind!r}; use {' or '.join(map(repr, fits))}"
        )
    choice(m.dtype, DTYPES, "model.dtype")
    if not m.hidden or any(h < 1 for h in m.hidden):
        raise ConfigError(f"config: model.hidden = {list(m.hidden)} must list positive layer widths, e.g. [200, 200]")
    choice(m.loss, layer_lib.LOSSES, "model.loss")
    if m.init is not None:
        choice(m.init, layer_lib.INITS, "model.init")
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
    choice(t.algorithm, tuple(ALGORITHMS), "train.algorithm")
    if t.weighting is None:
        t = dataclasses.replace(t, weighting=ALGORITHMS[t.algorithm].default_weighting)
    choice(t.weighting, WEIGHTINGS, "train.weighting")
    choice(t.lr_schedule, LR_SCHEDULES, "train.lr_schedule")
    positive(t.lr_local, "train.lr_local", "lr_local = 0.05")
    positive(t.lr_global, "train.lr_global", "lr_global = 1.0")
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
        positive(t.batch_size, "train.batch_size", "batch_size = 20, or \"full\"")
    if t.local_steps is not None and t.local_epochs is not None:
        raise ConfigError("config: give train.local_steps or train.local_epochs, not both")
    if t.local_epochs is not None:
        positive(t.local_epochs, "train.local_epochs", "local_epochs = 1")
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
