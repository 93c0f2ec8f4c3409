"""One run from a validated config: build the problem, model and transport, open the log, drive the engine."""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from edgefed import config as config_mod
from edgefed import hwprofile
from edgefed.config import Config
from edgefed.algorithms.fedavg import FedAvgClient
from edgefed.algorithms.scaffold import ScaffoldClient
from edgefed.errors import ConfigError, ResourceError, RunLogError
from edgefed.models import build_model
from edgefed.problems import build_problem
from edgefed.participation.traces import ReplayTrace, sampled_traces
from edgefed.runlog import Column, Header, RunLogWriter, read_participation, read_resume_point, read_run
from edgefed.runtime.engine import RoundEngine, local_budgets
from edgefed.runtime.local import LocalTransport


@dataclass(frozen=True)
class RunResult:
    path: Path
    rounds_run: int
    wall_s: float
    final_train_loss: float
    final_test_accuracy: float
    best_test_accuracy: float
    best_round: int
    already_complete: bool = False


def default_log_path(config_path: str | None) -> Path:
    stem = Path(config_path).stem if config_path else "default"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / f"{stem}-{stamp}.h5"
    i = 1
    while path.exists():
        path = Path("runs") / f"{stem}-{stamp}-{i}.h5"
        i += 1
    return path


def resolve_config(config_path: str | None, overrides, resume: str | None):
    """The config to run and, when resuming, the resume point (whose config must match)."""
    if resume is None:
        return config_mod.load_config(config_path, overrides), None
    point = read_resume_point(resume)
    stored = config_mod.parse_toml(point.config_toml, f"the config stored in {resume}")
    if config_path is None:
        for item in overrides:
            config_mod.apply_override(stored, item)
        cfg = config_mod.config_from_dict(stored)
    else:
        cfg = config_mod.load_config(config_path, overrides)
    logged = config_mod.config_from_dict(config_mod.parse_toml(point.config_toml))
    diffs = config_mod.same_experiment(cfg, logged)
    if diffs:
        raise RunLogError(
            f"--resume {resume}: the log belongs to a different config (differs in {', '.join(diffs)}); "
            "resume with the config it was started with, or start a new run"
        )
    return logged, point


def client_algorithm(cfg: Config, batch: int | None):
    if cfg.train.algorithm == "scaffold":
        return ScaffoldClient(cfg.scaffold.option, None if cfg.scaffold.control_gradient == "full" else batch)
    return FedAvgClient()


def scaffold_log_layout(cfg: Config, n: int, d: int, dtype) -> dict:
    """The run-log columns and resume state SCAFFOLD adds to FedAvg's."""
    columns = [Column("scaffold/c", (d,), dtype, "stored", "server control c after those rounds")]
    if cfg.log.client_controls:
        columns.append(Column("scaffold/c_clients", (n, d), dtype, "stored", "device controls c_k (row k)"))
    return {"extra_columns": tuple(columns), "slots": (("c", (d,), dtype),),
            "row_states": (("c_clients", (n, d), dtype),)}


def stored_rounds(cfg: Config) -> int:
    return len({0, cfg.rounds} | set(range(cfg.log.every, cfg.rounds + 1, cfg.log.every)))


def check_control_memory(cfg: Config, n: int, d: int, dtype, log_path: Path, on_info) -> None:
    """Report what SCAFFOLD's N x d controls take, and refuse when memory or disk cannot hold them."""
    item = np.dtype(dtype).itemsize
    in_memory = n * d * item
    on_disk = 2 * in_memory + (stored_rounds(cfg) * in_memory if cfg.log.client_controls else 0)
    on_info(f"SCAFFOLD controls: {n} x {d} {np.dtype(dtype).name} = {_size(in_memory)} in memory, "
            f"{_size(on_disk)} in the run log")
    available = psutil.virtual_memory().available
    if in_memory > 0.8 * available:
        hint = "" if np.dtype(dtype) == np.float32 else 'model.dtype = "float32" halves it, or '
        raise ResourceError(f"SCAFFOLD's controls need {_size(in_memory)} but only {_size(available)} of memory "
                            f"is available; {hint}use fewer devices (data.clients)")
    free = shutil.disk_usage(log_path.parent if log_path.parent.exists() else Path.cwd()).free
    if on_disk > free:
        raise ResourceError(f"the run log would need {_size(on_disk)} for SCAFFOLD's controls but the disk has "
                            f"{_size(free)} free; log fewer rounds (log.every), set log.client_controls = false, "
                            'or use model.dtype = "float32"')


def _size(n_bytes: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n_bytes < 1024:
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024
    return f"{n_bytes:.1f} GB"


@dataclass(frozen=True)
class Setup:
    """Everything the coordinator decides before the first round."""

    cfg: Config
    problem: object
    model: object
    header: Header
    trace: ReplayTrace | None
    deadlines: np.ndarray | None = None  # deadline mode: each device's wall-clock budget per round, s


def prepare(cfg: Config, log_path: Path, *, resume_point=None, force: bool = False, on_info=None) -> Setup:
    """Check everything that can be checked before a log is touched; build the problem and the log header."""
    on_info = on_info or (lambda line: None)
    problem = build_problem(cfg)
    cfg = config_mod.with_clients(cfg, problem.n_devices)
    if resume_point is None and log_path.exists() and not force:
        raise RunLogError(f"run log {log_path} already exists; use --resume {log_path} to continue it, "
                          "--force to replace it, or another --out")
    folder = next((p for p in (log_path.parent, *log_path.parent.parents) if p.exists()), Path.cwd())
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise RunLogError(f"cannot write run log {log_path}: {folder} is not a writable folder; choose another --out")
    model = build_model(cfg.model.kind, problem, cfg.model.dtype, cfg.model.hidden, cfg.seed)
    trace = None
    spec = cfg.participation.trace
    if cfg.participation.mode == "trace" and isinstance(spec, str) and spec.endswith((".h5", ".hdf5")):
        recorded = read_participation(spec)
        trace = ReplayTrace.checked(recorded.selected, recorded.steps, recorded.budget, spec,
                                    problem.n_devices, cfg.rounds, local_budgets(cfg, problem.n_train))
    elif cfg.participation.mode == "trace":
        trace = sampled_traces(spec, cfg.seed, problem.n_devices)
    on_info(f"{problem.describe()}; model {model.kind}, d = {model.dim} {model.dtype.name}; "
            f"{cfg.train.algorithm}, {cfg.rounds} rounds")
    layout = {}
    if cfg.train.algorithm == "scaffold":
        layout = scaffold_log_layout(cfg, problem.n_devices, model.dim, model.dtype)
        check_control_memory(cfg, problem.n_devices, model.dim, model.dtype, log_path, on_info)
    header = Header(
        config_toml=resume_point.config_toml if resume_point else config_mod.to_toml(cfg),
        seed=cfg.seed, rounds=cfg.rounds, n_devices=problem.n_devices, dim=model.dim, dtype=model.dtype,
        n_train=problem.n_train, **layout,
        attrs={"problem": problem.describe(), "model": model.kind,
               "train_objective": "(1/N_r) sum_k f_k" if cfg.train.weighting == "uniform" else "sum_k n_k/n F_k"},
    )
    return Setup(cfg, problem, model, header, trace)


def device_deadlines(setup: Setup, owners: np.ndarray | None = None, on_info=None, resume_point=None) -> Setup:
    """Setup with each device's deadline: the configured seconds, or a multiple of the time its budget of
    K_k steps takes on its board, by the hardware profile of the rank hosting it (owners; None: this
    process hosts every device, on [device] profile's board). The deadlines go into the log's attributes;
    a resumed run keeps the ones its log holds, whatever its profiles say now."""
    cfg, p = setup.cfg, setup.cfg.participation
    if p.mode != "deadline":
        return setup
    n = setup.problem.n_devices
    factor = hwprofile.parse_deadline(p.deadline_s)
    logged = None if resume_point is None else resume_point.attrs.get("deadline_s")
    if logged is not None and np.shape(logged) == (n,):
        deadlines = np.asarray(logged, np.float64)
    elif factor is None:
        deadlines = np.full(n, float(p.deadline_s))
    else:
        if setup.model.kind not in hwprofile.MODELS:
            raise ConfigError(f"config: participation.deadline_s = {p.deadline_s!r} needs a profiled model "
                              f"({', '.join(hwprofile.MODELS)}); give the {setup.model.kind} model's deadline in seconds")
        dev = cfg.device
        if owners is None or not dev.boards:
            if dev.profile is None:
                raise ConfigError("config: the simulator runs every device on this machine; set [device] profile "
                                  "to its hardware profile (device.boards applies under mpirun)")
            names = [dev.profile] * n
        else:
            names = [dev.boards[int(r) - 1] for r in owners]
        profiles = {name: hwprofile.load_profile(name) for name in dict.fromkeys(names)}
        budgets = local_budgets(cfg, setup.problem.n_train)
        batches = setup.problem.n_train if cfg.train.batch_size == "full" else np.minimum(cfg.train.batch_size,
                                                                                          setup.problem.n_train)
        model = setup.model
        deadlines = np.array([factor * budgets[k] * profiles[names[k]].step_seconds(model.kind, int(batches[k]),
                                                                                      model.dim) for k in range(n)])
        if on_info is not None:
            parts = []
            for name, prof in profiles.items():
                mine = deadlines[[k for k in range(n) if names[k] == name]]
                estimated = "" if prof.measured else ", estimated speeds"
                parts.append(f"{prof.name} ({name}{estimated}): {mine.min() * 1e3:.1f}..{mine.max() * 1e3:.1f} ms")
            on_info(f"deadlines {factor:g}x the profiled time of each device's steps: " + "; ".join(parts))
    setup.header.attrs["deadline_s"] = deadlines
    return dataclasses.replace(setup, deadlines=deadlines)


def local_transport(cfg: Config, problem, model, device_ids=None, core=None, contention=None) -> LocalTransport:
    """The devices this process hosts (all of them in the simulator); contention: the competitor loads
    (cycled over devices), by default participation.contention."""
    batch = None if cfg.train.batch_size == "full" else cfg.train.batch_size
    loads = cfg.participation.contention if contention is None else contention
    return LocalTransport(problem, model, client_algorithm(cfg, batch), cfg.seed, batch, device_ids,
                          cfg.fault, loads, core)


def check_device_ranks(cfg: Config, n_ranks: int) -> None:
    """[device] lists that name one entry per device rank must match this run's number of device ranks."""
    for key, values, what in (("boards", cfg.device.boards, "boards"), ("contention", cfg.device.contention, "loads")):
        if values and len(values) != n_ranks:
            raise ConfigError(f"config: device.{key} names {len(values)} {what}, but this run has {n_ranks} device "
                              f"ranks; give one per device rank (entry i is rank i + 1)")


def note_warmup(setup: Setup, compiled: list[int], seconds: list[float], on_info) -> None:
    """Record in the log (and say) what compiling the kernels before round 1 cost each process."""
    setup.header.attrs["warmup_compiled"] = np.asarray(compiled, np.int64)
    setup.header.attrs["warmup_s"] = np.asarray(seconds, np.float64)
    if any(compiled):
        on_info(f"compiled {max(compiled)} kernels before round 1 ({max(seconds):.1f} s); "
                "`edgefed warmup` once per machine caches them")


def drive(setup: Setup, transport, log_path: Path, *, resume_point=None, on_round=None) -> RunResult:
    """Open (or continue) the log and run the rounds through `transport`; the transport is closed after."""
    cfg = setup.cfg
    if resume_point is not None and resume_point.complete:
        transport.close()
        return _summary(log_path, resume_point.prefix, 0, 0.0, already_complete=True)
    wall0 = time.perf_counter()
    try:
        log = RunLogWriter.create(log_path, setup.header, resume_point)
    except BaseException:
        transport.close(failed=True)
        raise
    try:
        engine = RoundEngine(cfg, setup.problem.n_train, transport, log, on_round, setup.trace, setup.deadlines)
        if resume_point is None:
            x = setup.model.initial_params()
            engine.start(x)
            done = 0
        else:
            done = resume_point.rounds_done
            x = engine.resume(resume_point.state, done)
        engine.run(x, done)
    except BaseException:
        log.close()  # the log stays valid up to the last completed round, ready for --resume
        transport.close(failed=True)
        raise
    transport.close()
    wall = time.perf_counter() - wall0
    log.close({"status": "complete",
               "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
    return _summary(log_path, read_run(log_path), cfg.rounds - done, wall)


def run(cfg: Config, log_path: Path, *, resume_point=None, force: bool = False, on_round=None,
        on_info=None) -> RunResult:
    """One run in this process (the simulator)."""
    setup = prepare(cfg, log_path, resume_point=resume_point, force=force, on_info=on_info)
    setup = device_deadlines(setup, None, on_info, resume_point)
    transport = local_transport(setup.cfg, setup.problem, setup.model)
    compiled, seconds = transport.warmup()
    note_warmup(setup, [compiled], [seconds], on_info or (lambda line: None))
    return drive(setup, transport, log_path, resume_point=resume_point, on_round=on_round)


def _summary(path, data: dict, rounds_run: int, wall: float, already_complete=False) -> RunResult:
    acc = data["metrics/test_accuracy"]
    loss = data["metrics/train_loss"]
    finite = np.where(np.isfinite(acc))[0]
    best = int(finite[np.argmax(acc[finite])]) if finite.size else 0
    return RunResult(Path(path), rounds_run, wall, float(loss[-1]), float(acc[-1]),
                     float(acc[best]) if finite.size else math.nan, best, already_complete)
