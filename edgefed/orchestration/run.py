"""What a run is: prepare everything that can be checked before a log is touched (its memory and disk in
budget.py, its log's header in header.py, a resumed run's checks in resume.py), then drive the engine over a
transport and close the log; `run` does all of it in this process.

Under MPI, ranks.py gives rank 0 the same `prepare` and `drive` around an MPI transport.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgefed import compression, hwprofile
from edgefed import config as config_mod
from edgefed.algorithms import Algorithm, build_algorithm
from edgefed.config import Config
from edgefed.engine.asynchronous import AsyncEngine
from edgefed.engine.rounds import RoundEngine
from edgefed.errors import ConfigError, RankLost
from edgefed.layers import first_spatial, token_ids
from edgefed.memory import peak_rss
from edgefed.models import model_for
from edgefed.orchestration.budget import check_device_memory, check_memory, evaluates_apart
from edgefed.orchestration.header import frozen_text, label_counter, log_header, log_layout, trajectory_every
from edgefed.orchestration.resume import Launch, merged_restarts, same_data, start_weights
from edgefed.outputs import check_output, writable
from edgefed.orchestration.timing import link_speeds, timing_for
from edgefed.participation.budgets import local_budgets
from edgefed.participation.timing import Timing
from edgefed.participation import asynchrony, privacy
from edgefed.participation.sampling import evaluation_sample
from edgefed.participation.traces import ReplayTrace
from edgefed.problems import build_problem
from edgefed.participation.selection import POLICY_CLASSES
from edgefed.runlog import (Header, RunLogWriter, discard_stub, exists_error, hold, let_go, nonfinite_counts, open_run,
                            read_participation, write_stub)
from edgefed.runtime.local import LocalTransport
from edgefed.tracefiles import sampled_traces
from edgefed.width_models import width_models


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
    nonfinite: int = 0  # reports dropped as non-finite, over the whole run (resumed rounds too)
    nonfinite_rounds: int = 0  # rounds in which any was
    applied_rounds: int = 0  # rounds (server updates) that applied an update


class Tally:
    """What the run's last line says of the whole run: its reports dropped as non-finite and the rounds that
    applied an update, counted round by round (and, on --resume, from the rounds the log holds)."""

    def __init__(self, on_round, logged: dict | None = None):
        self.on_round = on_round
        counts = nonfinite_counts(logged or {})
        self.nonfinite, self.nonfinite_rounds = counts["reports"], counts["rounds"]
        self.applied_rounds = len((logged or {}).get("metrics/n_applied", ())) - counts["no_update"]

    def __call__(self, s) -> None:
        self.nonfinite += s.n_dropped
        self.nonfinite_rounds += bool(s.n_dropped)
        self.applied_rounds += bool(s.n_applied)
        if self.on_round is not None:
            self.on_round(s)


def default_log_path(config_path: str | None) -> Path:
    stem = Path(config_path).stem if config_path else "default"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / f"{stem}-{stamp}.h5"
    i = 1
    while path.exists():
        path = Path("runs") / f"{stem}-{stamp}-{i}.h5"
        i += 1
    return path


def problem_key(cfg: Config) -> tuple:
    """What a config's problem is built from: configs with one key have one problem."""
    tokens = token_ids(cfg.model)
    builtin = cfg.model.kind if tokens is not None and cfg.model.kind != "sequential" else None  # (no key sets
    # a built-in model's vocabulary: a message says so)
    return cfg.data, cfg.seed, cfg.model.dtype, cfg.model.loss, first_spatial(cfg.model), tokens, builtin


def problem_and_model(cfg: Config, problems: dict | None = None, start: dict | None = None, convert: bool = True,
                      shard=None):
    """The problem a config describes and the model that trains on it (every process builds them alike);
    problems: built problems by problem_key, taken from and added to (a sweep's plan); start: the state_dict
    the run starts from when model.weights is set (None: model.weights read here, start_weights);
    convert: whether this process may convert a LEAF folder (a device rank reads its coordinator's copy);
    shard: a device rank's shard of the data, read instead of data.path."""
    problem = shared_problem(cfg, problems, convert, shard)
    return model_for(cfg, problem, start_weights(cfg) if start is None else start)


def shared_problem(cfg: Config, problems: dict | None = None, convert: bool = True, shard=None):
    """The problem a config describes (problems, convert, shard: as problem_and_model takes them)."""
    key = problem_key(cfg)
    problem = None if problems is None else problems.get(key)
    if problem is None:
        problem = build_problem(*key, convert=convert, shard=shard)
    if problems is not None:
        problems[key] = problem
    return problem


@dataclass(frozen=True)
class Setup:
    """Everything the coordinator decides before the first round."""

    cfg: Config
    algorithm: Algorithm
    problem: object
    model: object
    header: Header
    trace: object | None  # trace mode: a ReplayTrace or SampledTraces
    timing: Timing = field(default_factory=Timing)  # the clock, the boards' times, the deadline policy
    stub: bool = False  # prepare wrote the log's stub (a new path, or a resumed stub): the run's own to remove
    weights: dict | None = None  # the state_dict the run starts from (model.weights): what device ranks get
    widths: object | None = None  # [submodel]: the models of its widths (width_models.WidthModels)
    submodels: object | None = None  # [submodel] as run: each device's width (participation.submodels), with timing


def _trace(cfg: Config, problem):
    spec = cfg.participation.trace
    if cfg.participation.mode == "async":
        return None if spec is None else _recorded_updates(read_participation(spec), spec, problem.n_devices,
                                                           cfg.rounds)
    if cfg.participation.mode != "trace":
        return None
    if isinstance(spec, str) and spec.endswith((".h5", ".hdf5")):
        recorded = read_participation(spec)
        trace = ReplayTrace.checked(recorded, spec, problem.n_devices, cfg.rounds,
                                    local_budgets(cfg.train, problem.n_train))
        if recorded.overselected:  # its quorum S (a private replay clips and noises with it), whatever this says
            per_round = config_mod.parse_toml(recorded.config_toml, spec).get("train", {}).get(
                "clients_per_round", config_mod.TrainConfig().clients_per_round)
            trace = dataclasses.replace(trace, per_round=per_round)
        return trace
    return sampled_traces(spec, cfg.seed, problem.n_devices)


def _recorded_updates(recorded, spec: str, n_devices: int, rounds: int) -> asynchrony.Recorded:
    where = f"participation.trace = {spec!r}"
    if recorded.staleness is None:
        raise ConfigError(f'config: {where} is not an async run\'s log; replay it with participation.mode = "trace"')
    if recorded.staleness.shape[1] != n_devices:
        raise ConfigError(f"config: {where} has {recorded.staleness.shape[1]} devices but this run has {n_devices}")
    if recorded.staleness.shape[0] < rounds:
        raise ConfigError(f"config: {where} holds {recorded.staleness.shape[0]} server updates but this run needs "
                          f"{rounds}; lower rounds to at most {recorded.staleness.shape[0]}")
    considered = [None if v is None else v[:rounds] for v in (recorded.candidate, recorded.utility)]
    return asynchrony.Recorded(recorded.staleness[:rounds], recorded.late[:rounds], recorded.steps[:rounds],
                               recorded.clock_s, *considered)


def prepare(cfg: Config, log_path: Path, *, resume_point=None, force: bool = False, on_info=None,
            launch: Launch | None = None, distributed: bool = False) -> Setup:
    """Check what can be checked before a log is touched, write the log's stub (a kill from here on leaves a
    log to --resume), then build the problem and the log header."""
    on_info = on_info or (lambda line: None)
    if resume_point is None:
        check_output(log_path, force=force, inputs=config_mod.files_read(cfg), example="run.h5", exists=exists_error)
    else:  # continued in place: a new whole file is swapped in, beside it
        writable(log_path)
    hold(log_path, resume_point)  # (the caller lets go: run, or the MPI coordinator)
    restarts = merged_restarts(resume_point.restarts if resume_point else (), launch)
    config_toml = resume_point.config_toml if resume_point else config_mod.to_toml(cfg)
    # a stub, unless it would replace a log (--force replaces one only by a whole new log)
    stub = resume_point.fresh if resume_point else not log_path.exists()
    if stub:  # a new log's path is claimed atomically: another run may be starting on it at this moment
        write_stub(log_path, config_toml, restarts, claim=resume_point is None)
    with released_on_failure(log_path, stub):
        setup = build_setup(cfg, log_path, resume_point, on_info, config_toml, restarts, distributed=distributed)
    return dataclasses.replace(setup, stub=stub)


@contextmanager
def released_on_failure(log_path: Path, owned: bool):
    """A log this run wrote and that holds no round yet (owned: its stub, or the new log created over it) is
    removed by any failure (bad input, or a bug: nothing worth keeping was written, and the same --out must work
    again); Ctrl-C and a lost rank leave it to --resume (and edgefed launch). A file the run did not write (an
    old log --force would replace) is left as it was."""
    try:
        yield
    except Exception as exc:
        if owned and not isinstance(exc, RankLost):
            discard_stub(log_path)
        raise


def dry_run(cfg: Config, log_path: Path, problems: dict | None = None) -> Setup:
    """Everything a new run checks before its first round (its files read as far as the run reads them, the
    model against the data, memory, disk, deadlines), with nothing written: what a sweep does for each of its
    runs before the first one runs. problems: as problem_and_model takes them."""
    setup = build_setup(cfg, log_path, None, lambda line: None, config_mod.to_toml(cfg), (), problems)
    return timing_for(setup)


def build_setup(cfg: Config, log_path: Path, resume_point, on_info, config_toml: str, restarts: tuple,
                problems: dict | None = None, distributed: bool = False) -> Setup:
    if cfg.data.kind == "synthetic" and cfg.data.clients:  # N is known before its sizes are drawn (minutes at 10^7)
        check_memory(cfg, cfg.data.clients)
    weights = start_weights(cfg, log_path, resume_point, on_info)  # (a bad weights file: said before the data)
    problem, model = model_for(cfg, shared_problem(cfg, problems), weights)
    same_data(resume_point, problem.n_train)
    cfg = config_mod.with_clients(cfg, problem.n_devices)
    trace = _trace(cfg, problem)
    if isinstance(trace, ReplayTrace) and trace.away and not cfg.mpi.away:  # its silences and boosts, as they ran
        cfg = dataclasses.replace(cfg, mpi=dataclasses.replace(cfg.mpi, away=tuple(
            config_mod.AwayConfig(tuple(e["devices"]), e["round"], e.get("back")) for e in trace.away)))
    if isinstance(trace, ReplayTrace) and trace.width is not None:
        ran = sorted(set(trace.width[np.isfinite(trace.width)].tolist()))
        if not cfg.submodel.enabled or not set(ran) <= set(cfg.submodel.widths):
            raise ConfigError(f"config: participation.trace = {cfg.participation.trace!r} ran submodels of widths "
                              f"{ran}; replay it with the same [submodel] table")
    algorithm = build_algorithm(cfg)
    if resume_point is None or resume_point.fresh:  # the config as run: with the clients a problem file fixes
        config_toml = config_mod.to_toml(cfg)
    layout = log_layout(algorithm, cfg, problem.n_devices, model.n_trainable, model.dtype)
    every, stores = trajectory_every(cfg, layout, model.n_trainable, model.dtype)
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, every=every))  # as run; the stored text keeps it unset
    if getattr(problem, "notice", None):
        on_info(problem.notice)
    on_info(f"{problem.describe()}; model {model.kind}, d = {model.n_trainable} {model.dtype.name}{frozen_text(model)}; "
            f"{cfg.train.algorithm}, {cfg.rounds} rounds; {stores}")
    header = log_header(cfg, algorithm, problem, model, layout, config_toml, restarts)
    if cfg.mpi.away:  # the boards away as this world ran (a replay silences and boosts alike)
        header.attrs["away"] = json.dumps([dataclasses.asdict(e) for e in cfg.mpi.away])
    widths = width_models(cfg, problem, model)  # (before the memory check: its process's memory holds them)
    need = check_device_memory(algorithm, cfg, problem, model, log_path, on_info, distributed)
    header.attrs["rank_memory_estimate_mb"] = np.array([need / 2 ** 20])  # (device ranks' added under mpiexec)
    if cfg.privacy.mechanism != "none":
        cfg = privacy.settled(cfg, problem.n_devices, header.attrs, on_info,
                              trace.selected if isinstance(trace, ReplayTrace) else None)
    return Setup(cfg, algorithm, problem, model, header, trace, weights=weights, widths=widths)


def local_transport(cfg: Config, algorithm: Algorithm, problem, model, device_ids=None, cores=None,
                    contention=None, widths=None) -> LocalTransport:
    """The devices this process hosts (all of them in the simulator), run in a lane per core of `cores`
    (None in the simulator: [mpi] threads_per_rank lanes on cores 0.., one unpinned lane by default);
    contention: the competitor loads (cycled over devices), by default participation.contention; widths:
    [submodel]'s width models when already built (else built here)."""
    batch = None if cfg.train.batch_size == "full" else cfg.train.batch_size
    loads = cfg.participation.contention if contention is None else contention
    if cores is None and cfg.mpi.threads_per_rank and cfg.mpi.threads_per_rank > 1:
        usable = usable_cores()
        cores = [usable[t % len(usable)] for t in range(cfg.mpi.threads_per_rank)]
    return LocalTransport(problem, model, algorithm, cfg.seed, batch, device_ids, cfg.fault, loads, cores,
                          compression.codecs(cfg.compress)[0], link_speeds(cfg, problem.n_devices),
                          secagg=cfg.secagg if cfg.secagg.enabled else None, scheme=cfg.participation.scheme,
                          report_losses=POLICY_CLASSES[cfg.selection.policy].reads_losses,
                          privacy=cfg.privacy if cfg.privacy.mechanism == "distributed" else None,
                          evaluated=evaluation_sample(cfg.seed, problem.n_devices, cfg.log.eval_devices),
                          cache_mb=cfg.data.cache_mb, eval_apart=evaluates_apart(cfg),
                          widths=width_models(cfg, problem, model) if widths is None else widths)


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity: taskset and cgroups may leave fewer than all)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def compile_notice(cfg: Config, model, on_info):
    """What a run says before it compiles kernels into an empty cache: which, that it is this once, and (when
    the run names a board profile that measured it) about how long."""
    if on_info is None:
        return None

    def say(names: list[str], dtype) -> None:
        eta = ""
        if cfg.device.profile is not None:
            profile = hwprofile.load_profile(cfg.device.profile)
            seconds = profile.compile_seconds(model.kind)
            if seconds is not None:
                eta = f"; about {seconds:.0f} s on a {profile.name} (its profile)"
        on_info(f"compiling {', '.join(names)} ({np.dtype(dtype).name}) into this machine's kernel cache: only "
                f"this once, every later run loads them (`edgefed warmup` compiles them ahead){eta}")

    return say


def note_warmup(setup: Setup, compiled: list[int], seconds: list[float], on_info) -> None:
    """Record in the log (and say) what compiling the kernels before round 1 cost each process."""
    setup.header.attrs["warmup_compiled"] = np.asarray(compiled, np.int64)
    setup.header.attrs["warmup_s"] = np.asarray(seconds, np.float64)
    if any(compiled):
        on_info(f"compiled {max(compiled)} kernels before round 1 ({max(seconds):.1f} s); "
                "`edgefed warmup` once per machine caches them")


class DivergenceWatch:
    """Says once, without stopping the run, when the train loss turns non-finite or grows by orders of
    magnitude over the first one evaluated: a run that diverges otherwise finishes silently."""

    GROWTH = 1e3

    def __init__(self, on_round, on_warning):
        self.on_round, self.on_warning = on_round, on_warning
        self.first, self.said = None, False

    def __call__(self, s) -> None:
        if self.on_round is not None:
            self.on_round(s)
        if self.said or not s.evaluated:
            return
        loss = s.train_loss
        if self.first is None and math.isfinite(loss):
            self.first = loss
        elif self.first is not None and (not math.isfinite(loss) or abs(loss) > self.GROWTH * max(abs(self.first), 1e-12)):
            self.said = True
            grown = "is not finite" if not math.isfinite(loss) else f"has grown {loss / self.first:.3g}x to {loss:.4g}"
            self.on_warning(f"warning: the train loss {grown} at round {s.round_idx} (it was {self.first:.4g}): the "
                            "run diverges; a smaller train.lr_local usually cures it")


def drive(setup: Setup, transport, log_path: Path, *, resume_point=None, on_round=None,
          on_warning=None) -> RunResult:
    """Open (or continue) the log and run the rounds through `transport`; the transport is closed after."""
    cfg = setup.cfg
    if resume_point is not None and resume_point.fresh:
        resume_point = None  # nothing was completed: start from the beginning, over the stub
    tally = on_round = Tally(on_round, None if resume_point is None else resume_point.logged)
    if on_warning is not None:
        on_round = DivergenceWatch(on_round, on_warning)
    if resume_point is not None and resume_point.complete:
        transport.close()
        return _summary(log_path, resume_point.logged, 0, 0.0, tally, already_complete=True)
    new = resume_point is None  # (from here the file at log_path is this run's own: a whole new log)
    with released_on_failure(log_path, new and setup.stub):
        try:
            log = RunLogWriter.create(log_path, setup.header, resume_point)
        except BaseException:
            transport.close(failed=True)
            raise
    with released_on_failure(log_path, new), _closed_on_failure(log, transport):
        engine_class = AsyncEngine if cfg.participation.mode == "async" else RoundEngine
        engine = engine_class(cfg, setup.algorithm, setup.problem.n_train, transport, log, on_round, setup.trace,
                              setup.timing, label_counter(setup.problem, transport), setup.submodels)
        if resume_point is None:
            engine.start(setup.model.initial_params())
            done = 0
        else:
            done = resume_point.rounds_done
            engine.resume(resume_point.state, done, resume_point.logged)
        wall0 = time.perf_counter()  # the rounds alone: the log, the engine and round 0's metrics are start-up
        engine.run(done)
    wall = time.perf_counter() - wall0
    # complete before the devices are let go: a rank lost in the final drain then costs nothing logged
    peaks = transport.peak_rss()  # this process is rank 0, and the only one in the simulator
    ranks = np.arange(len(setup.header.attrs["rank_memory_estimate_mb"]))
    log.close({"status": "complete",
               "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "rank_peak_rss_mb": np.array([peak_rss() if r == 0 else peaks.get(int(r), np.nan) for r in ranks],
                                            np.float64) / 2 ** 20})
    transport.close()
    with open_run(log_path) as f:  # the two metrics, not the whole log (a large federation's is gigabytes)
        metrics = {name: f[name][()] for name in ("metrics/test_accuracy", "metrics/train_loss")}
    return _summary(log_path, metrics, cfg.rounds - done, wall, tally)


@contextmanager
def _closed_on_failure(log: RunLogWriter, transport):
    try:
        yield
    except BaseException:
        log.close()  # the log stays valid up to the last completed round, ready for --resume
        transport.close(failed=True)
        raise


def run(cfg: Config, log_path: Path, *, resume_point=None, force: bool = False, on_round=None,
        on_info=None, launch: Launch | None = None) -> RunResult:
    """One run in this process (the simulator)."""
    try:
        setup = prepare(cfg, log_path, resume_point=resume_point, force=force, on_info=on_info, launch=launch)
        setup = dataclasses.replace(setup, weights=None)  # (the model holds them: for device ranks only)
        with released_on_failure(log_path, setup.stub):
            setup = timing_for(setup, None, on_info, resume_point)
            transport = local_transport(setup.cfg, setup.algorithm, setup.problem, setup.model, widths=setup.widths)
            try:
                compiled, seconds = transport.warmup(compile_notice(setup.cfg, setup.model, on_info))
            except BaseException:
                transport.close(failed=True)
                raise
        note_warmup(setup, [compiled], [seconds], on_info or (lambda line: None))
        return drive(setup, transport, log_path, resume_point=resume_point, on_round=on_round, on_warning=on_info)
    finally:
        let_go(log_path)


def _summary(path, data: dict, rounds_run: int, wall: float, tally: Tally, already_complete=False) -> RunResult:
    acc = data["metrics/test_accuracy"]
    loss = data["metrics/train_loss"]
    finite = np.where(np.isfinite(acc))[0]
    best = int(finite[np.argmax(acc[finite])]) if finite.size else 0
    return RunResult(Path(path), rounds_run, wall, float(loss[-1]), float(acc[-1]),
                     float(acc[best]) if finite.size else math.nan, best, already_complete, tally.nonfinite,
                     tally.nonfinite_rounds, tally.applied_rounds)
