"""What a run is: resolve its config, prepare everything that can be checked before a log is touched,
then drive the engine over a transport and close the log; `run` does all of it in this process.

Under MPI, ranks.py gives rank 0 the same `prepare` and `drive` around an MPI transport.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

from edgefed import compression, hwprofile
from edgefed import config as config_mod
from edgefed.algorithms import Algorithm, build_algorithm
from edgefed.config import Config
from edgefed.engine.asynchronous import AsyncEngine
from edgefed.engine.rounds import RoundEngine
from edgefed.errors import ConfigError, EdgefedError, RankLost, ResourceError, RunLogError
from edgefed.layers import first_spatial, token_ids
from edgefed.memory import memory_limit, peak_rss, size_text
from edgefed.models import FeatureProblem, build_model
from edgefed.orchestration.weights import read_weights, resumed_weights
from edgefed.outputs import check_output, writable
from edgefed.orchestration.timing import link_speeds, timing_for
from edgefed.participation.budgets import local_budgets
from edgefed.participation.timing import Timing, overselected
from edgefed.participation import asynchrony, privacy
from edgefed.participation.sampling import evaluation_sample
from edgefed.participation.traces import ReplayTrace
from edgefed.problems import build_problem
from edgefed.participation.selection import POLICY_CLASSES, build_policy
from edgefed.runlog import (Column, Header, RunLogWriter, discard_stub, exists_error, hold, let_go, nonfinite_counts,
                            open_run, read_participation, read_resume_point, read_run, write_stub)
from edgefed.runtime.local import LocalTransport
from edgefed.tracefiles import sampled_traces


@dataclass(frozen=True)
class Launch:
    """What `edgefed launch` tells the run it starts: where to say that a rank was lost, and the restarts of
    this launch so far (each a dict of runlog.RESTART's fields), to be kept in the log."""

    status: Path | None = None
    restarts: tuple = ()


def merged_restarts(logged: tuple, launch: Launch | None) -> tuple:
    """The log's restarts from earlier launches, then this launch's (it passes all of its own every time)."""
    if launch is None or not launch.restarts:
        return tuple(logged)
    ours = {r["launch"] for r in launch.restarts}
    return tuple(r for r in logged if r["launch"] not in ours) + tuple(launch.restarts)


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

    def __init__(self, on_round, prefix: dict | None = None):
        self.on_round = on_round
        counts = nonfinite_counts(prefix or {})
        self.nonfinite, self.nonfinite_rounds = counts["reports"], counts["rounds"]
        self.applied_rounds = len((prefix or {}).get("metrics/n_applied", ())) - counts["no_update"]

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


def resolve_config(config_path: str | None, overrides, resume: str | None):
    """The config to run and, when resuming, the resume point (whose config must match)."""
    if resume is None:
        return config_mod.load_config(config_path, overrides), None
    point = read_resume_point(resume)
    where = f"the config stored in {resume}"
    if config_path is None:
        stored, _ = config_mod.stored_config(point.config_toml, where)
        for item in overrides:
            config_mod.apply_override(stored, item)
            config_mod.absolute_paths(stored, Path.cwd())
        cfg = config_mod.config_from_dict(stored)
    else:
        cfg = config_mod.load_config(config_path, overrides)
    logged, diffs = config_mod.log_differences(cfg, point.config_toml, where)
    if diffs:
        raise RunLogError(
            f"--resume {resume}: the log belongs to a different config (differs in {', '.join(diffs)}); "
            "resume with the config it was started with, or start a new run"
        )
    return config_mod.with_placement(logged, cfg), point


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
    the run starts from when model.weights is set (start_weights), read from the file when not given;
    convert: whether this process may convert a LEAF folder (a device rank reads its coordinator's copy);
    shard: a device rank's shard of the data, read instead of data.path."""
    key = problem_key(cfg)
    problem = None if problems is None else problems.get(key)
    if problem is None:
        problem = build_problem(*key, convert=convert, shard=shard)
    if problems is not None:
        problems[key] = problem
    model = build_model(cfg.model, problem, cfg.seed, memory_limit(), minibatch_rows(cfg, problem))
    if cfg.model.weights is not None:
        if start is None:
            start = read_weights(cfg.model.weights, cfg.model.weights_round)
        model.load_weights(start, f"config: model.weights = {cfg.model.weights!r}")
    if model.prefix:  # the samples pass the frozen prefix once, when a device's data is built
        problem = FeatureProblem(problem, model)
    threads = cfg.mpi.threads_per_rank or 1
    if threads > 1 and getattr(model, "one_lane", False):
        raise ConfigError(f"config: mpi.threads_per_rank = {threads}, but model.module draws random numbers in "
                          "training (dropout) from PyTorch's one generator per process, so its devices run one at a "
                          "time per process; remove threads_per_rank and use more ranks")
    return problem, model


def log_layout(algorithm: Algorithm, cfg: Config, n: int, d: int, dtype) -> dict:
    """The run-log columns and resume state an algorithm's vectors (and the wire's: error-feedback residuals,
    the devices' copy of a compressed downlink) add to FedAvg's (Header fields)."""
    columns = [Column(v.column, (d,), dtype, "stored", v.meaning) for v in algorithm.server_vectors]
    if cfg.log.client_controls:
        columns += [Column(v.column, (n, d), dtype, "stored", v.meaning) for v in algorithm.device_vectors]
    slots = [v.name for v in algorithm.server_vectors]
    if cfg.compress.downlink != "none":
        slots += [compression.replica_name(name) for name in ("x", *slots)]
    if cfg.participation.mode == "async":
        columns.append(Column("participation/staleness", (n,), np.int32, "round",
                              "async: tau = t - 1 - v of the device's report in server update t (-1: none)", -1))
    if cfg.secagg.enabled:
        columns += [
            Column("participation/secagg_s", (n,), np.float32, "round",
                   "secure aggregation: the device's time on keys, shares, masks and reveals, s (NaN: not selected)",
                   np.nan),
            Column("participation/secagg_bytes", (n,), np.int64, "round",
                   "secure aggregation: the protocol's messages the device sent (keys, sealed shares, reveals), "
                   "bytes; its masked input is bytes_up"),
            Column("metrics/secagg_clipped", (), np.int64, "round",
                   "secure aggregation: coordinates the clip cut, summed over the applied devices (masked like "
                   "their updates: no one device's count is seen)"),
            Column("metrics/secagg_aborted", (), np.bool_, "round",
                   "secure aggregation could not unmask the round (too few survivors): nothing was applied")]
    if cfg.privacy.mechanism == "central":  # (distributed: the devices clip, unseen)
        columns.append(Column("participation/clipped", (n,), np.bool_, "round",
                              "differential privacy: the device's contribution a_k Delta_k was longer than "
                              "privacy.clip and was scaled to it"))
    if cfg.privacy.adapts:
        columns.append(Column("metrics/privacy_clip", (), np.float64, "round",
                              "adaptive clipping: the clip C the round used (Andrew et al.'s quantile estimate)"))
    if cfg.privacy.mechanism != "none":
        columns += [
            Column("metrics/epsilon", (), np.float64, "round+1",
                   "differential privacy: the epsilon spent after the round, at the log's privacy_delta (RDP "
                   "accountant, Poisson-sampled Gaussian)", np.nan)]
    if cfg.selection.policy != "uniform":
        columns += [
            Column("participation/candidate", (n,), np.bool_, "round",
                   f"the selection policy ({cfg.selection.policy}) considered the device for the round"),
            Column("participation/utility", (n,), np.float64, "round",
                   "the policy's score of a considered device when it selected (fedcs: predicted seconds; oort: "
                   "utility; power_of_choice: local loss; NaN: not considered)", np.nan)]
    rows = [v.name for v in algorithm.device_vectors]
    if cfg.compress.error_feedback:
        rows += [compression.residual_name(r) for r in algorithm.reports]
    policy = build_policy(cfg.selection, cfg.seed, np.zeros(n, np.int64), cfg.rounds)
    schedule = (("privacy_clip", (1,), np.float64),) if cfg.privacy.adapts else ()
    if cfg.participation.mode == "async" and cfg.selection.policy != "uniform":  # the tasks in flight, for --resume
        schedule += (("async_flight", (cfg.asynchronous.concurrency, 5), np.float64),
                     ("async_counters", (2,), np.int64))
    return {"extra_columns": tuple(columns),
            "slots": tuple((name, (d,), dtype) for name in slots) + tuple(policy.state) + schedule,
            "row_states": tuple((name, (n, d), dtype) for name in rows)}


def stored_rounds(rounds: int, every: int) -> int:
    """Rounds whose model the log stores: 0, every k-th, and the last."""
    return rounds // every + 1 + (1 if rounds % every else 0)


def trajectory_every(cfg: Config, header_layout: dict, d: int, dtype) -> tuple[int, str]:
    """([log] every as run, what the log stores, in words). Unset, every round is stored unless that would
    exceed [log] trajectory_mb: then every k-th, k the smallest that fits (round 0 and R always). An async
    run stores every round: its --resume starts tasks from any of them."""
    row = np.dtype(dtype).itemsize * d + sum(np.dtype(c.dtype).itemsize * int(np.prod(c.row_shape))
                                             for c in header_layout["extra_columns"] if c.rows == "stored")
    budget = cfg.log.trajectory_mb * 1e6
    every, why = cfg.log.every, ""
    if every is None:
        every = 1
        if cfg.participation.mode == "async":
            why = " (async: --resume needs them all)"
        elif stored_rounds(cfg.rounds, 1) * row > budget:
            cap = max(int(budget // row), 2)
            every = max(1, -(-cfg.rounds // max(cap - 1, 1)))
            while every < cfg.rounds and stored_rounds(cfg.rounds, every) > cap:
                every += 1
            over = "" if stored_rounds(cfg.rounds, every) * row <= budget else ", over budget: set trajectory_mb"
            why = f" to keep within [log] trajectory_mb = {cfg.log.trajectory_mb:g}{over}"
    n = stored_rounds(cfg.rounds, every)
    what = "every round" if every == 1 else f"every {every} rounds"
    return every, f"log: the model {what}{why}, {n} of {cfg.rounds + 1} ({size_text(n * row)})"


KERNEL_BYTES = 64 * 2 ** 20  # what loading a run's compiled kernels adds to the process (measured: 56-61 MB for
# each built-in model, LLVM's own state the most of it; benchmarks/RESULTS.md, "Data at the edge")
PER_DEVICE_BYTES = 700  # what the coordinator keeps per device (weights, sizes, label counts, a round's log rows,
# the selection's and the clock's arrays): benchmarks/scale.py's peaks grow 0.44 KB a device from 10^5 to
# 10^6 (637 -> 1028 MB); 700 leaves room for what that slope hides
RANK_DEVICE_BYTES = 100  # what a device rank keeps per device of the federation (sizes, owners, the command
# record's per-device fields: about 70 B by their dtypes; not measured apart)


def memory_need(cfg: Config, n: int, data_bytes: int = 0, state_bytes: int = 0, state_what: str = "",
                device_bytes: int = PER_DEVICE_BYTES, model_bytes: int = 0) -> tuple[int, list[str], int]:
    """(bytes, their parts in words, of them the runtime's) a process needs: this process as it stands (the runtime, the problem) and
    its kernels, the model's further buffers, N devices' bookkeeping at device_bytes each, the devices' data it
    may hold (data_held), the devices' vectors."""
    runtime = psutil.Process().memory_info().rss + KERNEL_BYTES
    per_device = n * device_bytes
    parts = [f"{size_text(runtime)} the runtime"]
    parts += [f"{size_text(model_bytes)} the model's buffers (its lanes' workspaces, a round's updates)"] if model_bytes else []
    parts += [f"{size_text(per_device)} for {n:,} devices' bookkeeping"]
    parts += [f"{size_text(data_bytes)} of their data (up to data.cache_mb)"] if data_bytes else []
    parts += [f"{size_text(state_bytes)} {state_what}"] if state_bytes else []
    return runtime + model_bytes + per_device + data_bytes + state_bytes, parts, runtime


def check_memory(cfg: Config, n: int, data_bytes: int = 0, state_bytes: int = 0, state_what: str = "",
                 device_bytes: int = PER_DEVICE_BYTES, model_bytes: int = 0) -> int:
    """Refuse, before anything large is built, a run whose estimate (memory_need) exceeds what this process may
    use; one line with the estimate, the limit and what would fit. Returns the estimate."""
    need, parts, runtime = memory_need(cfg, n, data_bytes, state_bytes, state_what, device_bytes, model_bytes)
    limit, what = memory_limit()
    if need <= limit:
        return need
    if runtime + model_bytes + data_bytes >= limit:  # no number of devices fits: the model is what is too large
        raise ResourceError(f"this run needs about {size_text(need)} of memory ({', '.join(parts)}) but {what} is "
                            f"{size_text(limit)}; use a smaller model, smaller minibatches (train.batch_size), fewer "
                            "devices a round, fewer mpi.threads_per_rank" + (" or a smaller data.cache_mb"
                                                                             if data_bytes else ""))
    fit = max(int((limit - runtime - model_bytes - data_bytes) // (device_bytes + state_bytes / max(n, 1))), 0)
    smaller = ", a smaller data.cache_mb, or log.eval_devices (evaluation builds every device)" if data_bytes else ""
    raise ResourceError(f"this run needs about {size_text(need)} of memory ({', '.join(parts)}) but {what} is "
                        f"{size_text(limit)}; about {fit:,} devices would fit in this process: use fewer devices "
                        f"(data.clients) or fewer per rank (more ranks under mpiexec){smaller}")


def data_held(cfg: Config, problem, own: np.ndarray | None = None) -> int:
    """The most of the devices' data a process hosting `own` (None: every device) holds at once: the devices a
    run can build there (the rounds' selections and the evaluated ones; every hosted one when all are
    evaluated), the largest first, up to data.cache_mb and the one device its cache keeps beyond it."""
    if not hasattr(problem, "device_bytes"):
        return 0
    sizes = problem.device_bytes()
    sizes = sizes if own is None else sizes[own]
    if not sizes.size:
        return 0
    built = sizes.size if cfg.log.eval_devices is None else min(
        sizes.size, touched_rows(cfg, problem.n_devices) + cfg.log.eval_devices)
    largest = np.partition(sizes, sizes.size - built)[sizes.size - built:] if built < sizes.size else sizes
    return int(min(largest.sum(), cfg.data.cache_mb * 2 ** 20 + largest.max()))


def minibatch_rows(cfg: Config, problem) -> int:
    """The most samples one local step holds at once: the minibatch, or the largest device's (a full batch)."""
    largest = int(np.max(problem.n_train, initial=1))
    return largest if cfg.train.batch_size == "full" else min(int(cfg.train.batch_size), largest)


MPI_COPIES = 3  # a round's report vectors under mpiexec, in the process that holds them: as computed (or
# decoded), as the wire's records, and MPI's own copy of a large message (measured: the MNIST CNN, 50 devices
# a round over 2 device ranks, 1.18 GB at rank 0 and 0.78 GB at each device rank, against 0.71 GB in one process)


def model_bytes(cfg: Config, algorithm: Algorithm, problem, model, lanes: int, hosted: int | None = None,
                distributed: bool = False) -> int:
    """What a run's model costs beyond the one built (its parameters, which the process holds already): the
    workspaces of a model for each lane and of one for evaluation where it runs apart, a round's report vectors (a row per selected device this process holds, and
    its residual with error feedback; MPI_COPIES under mpiexec) and the server's vectors (x, its update and sum,
    the algorithm's). hosted: the devices of a device rank (None: every device, the coordinator's view)."""
    n = problem.n_devices
    per_round = (cfg.asynchronous.concurrency if cfg.participation.mode == "async"
                 else overselected(cfg.clients_per_round_count(n), cfg.participation.overselect, n))
    rows = min(per_round, n if hosted is None else hosted) * len(algorithm.reports)
    rows *= (2 if cfg.compress.error_feedback else 1) * (MPI_COPIES if distributed else 1)
    server = (4 if hosted is None else 1) + 2 * len(algorithm.server_vectors)  # a device rank: the broadcast
    vectors = (rows + server) * model.dim * np.dtype(model.dtype).itemsize
    models = lanes + (1 if lanes and evaluates_apart(cfg) else 0)  # (workspaces are made when first used)
    return models * model.memory_bytes(minibatch_rows(cfg, problem)) + vectors


def touched_rows(cfg: Config, n: int) -> int:
    """The most devices a report can change in a run: rounds x the devices a round selects (a replayed
    log's or an async run's selections are not counted here: all of them)."""
    p = cfg.participation
    replay = p.mode == "trace" and isinstance(p.trace, str) and p.trace.endswith((".h5", ".hdf5"))
    if replay or p.mode == "async":
        return n
    per_round = overselected(cfg.clients_per_round_count(n), cfg.participation.overselect, n)
    return min(n, cfg.rounds * per_round)


def held_rows(algorithm: Algorithm, cfg: Config, n: int) -> int:
    """The most devices whose vectors a run holds (sparse state): those a report can change, or all of them
    when they start from anything but zero."""
    return touched_rows(cfg, n) if algorithm.zero_start else n


def residual_bytes(algorithm: Algorithm, cfg: Config, n: int, d: int, dtype) -> int:
    """Error feedback's residuals: a row per report vector of each device a report changed (zero before)."""
    if not cfg.compress.error_feedback:
        return 0
    return len(algorithm.reports) * touched_rows(cfg, n) * d * np.dtype(dtype).itemsize


def _rank_terms(cfg: Config, algorithm: Algorithm, problem, model, own: np.ndarray, lanes: int) -> tuple:
    """memory_need's terms for a device rank hosting `own` with `lanes` lanes: the devices' data it may hold,
    the vectors of its devices a run can touch, and its lanes' models."""
    n = problem.n_devices
    touched = min(own.size, touched_rows(cfg, n))
    rows = len(algorithm.device_vectors) * (touched if algorithm.zero_start else own.size)
    rows += len(algorithm.reports) * touched if cfg.compress.error_feedback else 0
    state = rows * model.dim * np.dtype(model.dtype).itemsize
    return (cfg, n, data_held(cfg, problem, own), state, "its devices' vectors", RANK_DEVICE_BYTES,
            model_bytes(cfg, algorithm, problem, model, lanes, own.size, distributed=True))


def rank_memory(cfg: Config, algorithm: Algorithm, problem, model, own: np.ndarray, lanes: int) -> tuple[int, list]:
    """A device rank's estimate (memory_need): what rank 0 holds a board to before the world builds anything
    (this process stands in for the rank's runtime: the same software and problem)."""
    return memory_need(*_rank_terms(cfg, algorithm, problem, model, own, lanes))[:2]


def check_rank_memory(cfg: Config, algorithm: Algorithm, problem, model, own: np.ndarray, lanes: int) -> int:
    """A device rank's estimate before it builds its devices, against what its machine has."""
    return check_memory(*_rank_terms(cfg, algorithm, problem, model, own, lanes))


def check_boards(needs: dict[int, tuple[int, list]], boards: dict) -> None:
    """Each device rank's estimate against its board's memory less what the board's own system takes
    (hwprofile: machine.system_mb): a rank that cannot fit its board is refused before the world builds
    anything, in one line naming the board."""
    for rank, board in sorted(boards.items()):  # (rank -> its board's hwprofile.Profile)
        need, parts = needs[rank]
        name = Path(board.source).stem
        if need > board.available_mb * 2 ** 20:
            memory, system = board.machine["memory_mb"], board.machine.get("system_mb", 0)
            raise ResourceError(
                f"board {name} (rank {rank}) has {memory} MB, of which its system takes {system} MB: "
                f"{board.available_mb:.0f} MB for the rank, which needs about {size_text(need)} ({', '.join(parts)}); "
                "give the rank fewer devices (more boards), a smaller data.cache_mb or train.batch_size, or a "
                "smaller model")


def check_device_memory(algorithm: Algorithm, cfg: Config, problem, model, log_path: Path, on_info,
                        distributed: bool = False) -> int:
    """Report what the devices' vectors (SCAFFOLD's controls: a row for each device a run can touch, or all
    N) and error feedback's residuals can take, and refuse when memory (with the model's lanes and a round's
    vectors, in one process) or disk cannot hold them. Returns this process's estimate."""
    vectors = algorithm.device_vectors
    n, d, dtype = problem.n_devices, model.dim, model.dtype
    data_bytes = 0 if distributed else data_held(cfg, problem)  # (under mpiexec the device ranks hold it)
    residuals = residual_bytes(algorithm, cfg, n, d, dtype)
    held_model = model_bytes(cfg, algorithm, problem, model, 0 if distributed else cfg.mpi.threads_per_rank or 1,
                             distributed=distributed)  # (under mpiexec the coordinator hosts no device)
    if not vectors:
        return check_memory(cfg, n, data_bytes, residuals, "error feedback's residuals", model_bytes=held_model)
    owner, noun = vectors[0].owner, " and ".join(dict.fromkeys(v.noun for v in vectors))
    item = np.dtype(dtype).itemsize
    held = held_rows(algorithm, cfg, n)
    in_memory = len(vectors) * held * d * item
    whole = len(vectors) * n * d * item  # what [log] client_controls stores every stored round
    on_disk = 2 * in_memory + (stored_rounds(cfg.rounds, cfg.log.every) * whole if cfg.log.client_controls else 0)
    shape = f"{held} x {d}" if len(vectors) == 1 else f"{len(vectors)} x {held} x {d}"
    touched = "" if held == n else f" (held for the {held:,} of {n:,} devices {cfg.rounds} rounds can touch)"
    on_info(f"{owner} {noun}: {shape} {np.dtype(dtype).name} = {size_text(in_memory)} in memory, "
            f"{size_text(on_disk)} in the run log{touched}")
    available = psutil.virtual_memory().available
    if in_memory > 0.8 * available:
        hint = "" if np.dtype(dtype) == np.float32 else 'model.dtype = "float32" halves it, or '
        raise ResourceError(f"{owner}'s {noun} need {size_text(in_memory)} but only {size_text(available)} of memory "
                            f"is available; {hint}use fewer devices (data.clients)"
                            f"{'' if held == n else ', fewer rounds or fewer devices a round'}")
    need = check_memory(cfg, n, data_bytes, in_memory + residuals,
                        f"{owner}'s {noun}" + (" and the residuals" if residuals else ""), model_bytes=held_model)
    free = shutil.disk_usage(log_path.parent if log_path.parent.exists() else Path.cwd()).free
    if on_disk > free:
        raise ResourceError(f"the run log would need {size_text(on_disk)} for {owner}'s {noun} but the disk has "
                            f"{size_text(free)} free; log fewer rounds (log.every), set log.client_controls = false, "
                            'or use model.dtype = "float32"')
    return need


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
        setup = _prepared(cfg, log_path, resume_point, on_info, config_toml, restarts, distributed=distributed)
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


def _frozen_text(model) -> str:
    """What of the model trains, when some of it is frozen, and whether its frozen prefix's outputs are cached."""
    frozen = model.frozen_values.size
    if not frozen:
        return ""
    cached = (f" (the frozen layers' outputs computed once per device: {model.n_features} features a sample)"
              if model.prefix else "")
    return f" trained, {frozen:,} frozen{cached}"


def start_weights(cfg: Config, log_path: Path, resume_point, on_info) -> dict | None:
    """The state_dict the run starts from (None: drawn from the seed): model.weights read, or for a resumed run
    the one its log started from, whatever the file holds now (a warning says when it moved or changed)."""
    if cfg.model.weights is None:
        return None
    if resume_point is None or resume_point.fresh:
        return read_weights(cfg.model.weights, cfg.model.weights_round)
    weights, warning = resumed_weights(cfg.model.weights, cfg.model.weights_round, log_path)
    if warning:
        on_info(warning)
    return weights


def _same_data(resume_point, n_train: np.ndarray) -> None:
    """A resumed run must train on the data it started with: the devices' sample counts the log keeps are a
    fingerprint of the data and its partition (a changed file, or a partition drawn otherwise)."""
    logged = None if resume_point is None or resume_point.fresh else resume_point.n_train
    if logged is None or np.array_equal(logged, n_train):
        return
    if logged.shape != n_train.shape:
        raise RunLogError(f"--resume: the log's run had {logged.size} devices but its data now gives {n_train.size}; "
                          "resume with the data the run started with")
    k = int(np.flatnonzero(logged != n_train)[0])
    raise RunLogError(f"--resume: device {k} trained on {int(logged[k])} samples in the log's run but its data now "
                      f"gives it {int(n_train[k])}: the data file or its partition changed since the run started; "
                      "resume with the data it started with, or start a new run")


def plan(cfg: Config, log_path: Path, problems: dict | None = None) -> Setup:
    """Everything a new run checks before its first round (its files read as far as the run reads them, the
    model against the data, memory, disk, deadlines), with nothing written: what a sweep does for each of its
    runs before the first one runs. problems: as problem_and_model takes them."""
    setup = _prepared(cfg, log_path, None, lambda line: None, config_mod.to_toml(cfg), (), problems)
    return timing_for(setup)


def _prepared(cfg: Config, log_path: Path, resume_point, on_info, config_toml: str, restarts: tuple,
              problems: dict | None = None, distributed: bool = False) -> Setup:
    if cfg.data.kind == "synthetic" and cfg.data.clients:  # N is known before its sizes are drawn (minutes at 10^7)
        check_memory(cfg, cfg.data.clients)
    weights = start_weights(cfg, log_path, resume_point, on_info)
    problem, model = problem_and_model(cfg, problems, weights)
    _same_data(resume_point, problem.n_train)
    cfg = config_mod.with_clients(cfg, problem.n_devices)
    trace = _trace(cfg, problem)
    algorithm = build_algorithm(cfg)
    if resume_point is None or resume_point.fresh:  # the config as run: with the clients a problem file fixes
        config_toml = config_mod.to_toml(cfg)
    layout = log_layout(algorithm, cfg, problem.n_devices, model.dim, model.dtype)
    every, stores = trajectory_every(cfg, layout, model.dim, model.dtype)
    cfg = dataclasses.replace(cfg, log=dataclasses.replace(cfg.log, every=every))  # as run; the stored text keeps it unset
    if getattr(problem, "notice", None):
        on_info(problem.notice)
    on_info(f"{problem.describe()}; model {model.kind}, d = {model.dim} {model.dtype.name}{_frozen_text(model)}; "
            f"{cfg.train.algorithm}, {cfg.rounds} rounds; {stores}")
    need = check_device_memory(algorithm, cfg, problem, model, log_path, on_info, distributed)
    attrs = {"problem": problem.describe(), "model": model.kind,
             "train_objective": "(1/N_r) sum_k f_k" if cfg.train.weighting == "uniform" else "sum_k n_k/n F_k",
             "rank_memory_estimate_mb": np.array([need / 2 ** 20])}  # (device ranks' added under mpiexec)
    header = Header(
        config_toml=config_toml, restarts=restarts,
        seed=cfg.seed, rounds=cfg.rounds, n_devices=problem.n_devices, dim=model.dim, dtype=model.dtype,
        n_train=problem.n_train, label_counts=_label_counts(problem), frozen=model.frozen_values,
        **layout,
        attrs=attrs,
    )
    if hasattr(problem, "sample_shape"):  # what rebuilds the model's layers from the config (edgefed export)
        header.attrs["sample_shape"] = np.asarray(problem.sample_shape, np.int64)
        header.attrs["model_outputs"] = int(problem.n_outputs)
    if getattr(problem, "partition_draws", None) is not None:  # the dirichlet partition: its draws (1: the first)
        header.attrs["partition_draws"] = int(problem.partition_draws)
    normalization = problem.input_normalization() if hasattr(problem, "input_normalization") else None
    if normalization is not None:  # what the model's inputs were: the exported model wants the same
        header.attrs["input_shift"], header.attrs["input_scale"] = (np.asarray(v, np.float64) for v in normalization)
    if model.prefix:  # what the devices' samples are
        header.attrs["features_cached"] = (f"the frozen prefix's outputs ({model.n_features} values a sample: program "
                                           f"operations 1..{model.prefix}), computed once per device")
    if model.kind == "torch":  # its bits repeat on this machine and torch build only
        header.attrs["torch_version"] = str(model.torch.__version__)
        header.attrs["bits"] = ("repeat on the same machine and torch build; not promised across CPUs (PyTorch's "
                                "kernels choose their own summation order)")
    if cfg.secagg.enabled:  # which keys a run used: the test mode's are reproducible from the config
        header.attrs["secagg_key_source"] = cfg.secagg.key_source
    if cfg.log.eval_devices is not None:
        if cfg.log.eval_devices > problem.n_devices:
            raise ConfigError(f"config: log.eval_devices = {cfg.log.eval_devices} exceeds the {problem.n_devices} "
                              "devices; lower it, or leave it out to evaluate every device")
        header.attrs["eval_devices"] = cfg.log.eval_devices
    if cfg.privacy.mechanism != "none":
        cfg = resolved_privacy(cfg, problem.n_devices, header.attrs, on_info, trace)
    return Setup(cfg, algorithm, problem, model, header, trace, weights=weights)


def _label_counts(problem) -> np.ndarray | None:
    """/devices/label_counts as the log starts: every device's, or (a large generated federation) -1 rows
    the run fills as it builds each device's data."""
    if not hasattr(problem, "label_counts"):
        return None
    if getattr(problem, "labels_later", False):
        return np.full((problem.n_devices, problem.n_classes), -1, np.int64)
    return problem.label_counts()


def label_counter(problem, transport):
    """ids -> their label counts, for a log that fills them as devices are built (None: counted at the start);
    in one process from the transport's built data, under MPI rank 0 builds the selected devices' itself."""
    if not getattr(problem, "labels_later", False):
        return None
    data = transport.data if isinstance(transport, LocalTransport) else problem.device
    return lambda ids: np.stack([problem.labels_of(data(int(k))) for k in ids]) if len(ids) else None


def resolved_privacy(cfg: Config, n: int, attrs: dict, on_info, trace=None) -> Config:
    """The config as run with z and delta settled (z solved for an epsilon target over the planned rounds),
    and the log's attributes that say what the run's epsilon means."""
    d = cfg.privacy
    privacy.available()
    q = privacy.sampling_rate(cfg, n, trace.selected if isinstance(trace, ReplayTrace) else None)
    delta = privacy.default_delta(n) if d.delta is None else d.delta
    z = d.noise_multiplier if d.epsilon is None else privacy.noise_for(d.epsilon, delta, q, cfg.rounds)
    attrs.update(privacy_mechanism=d.mechanism, privacy_noise_multiplier=float(z), privacy_clip=float(d.clip),
                 privacy_delta=float(delta), privacy_sampling_rate=float(q), privacy_noise_source=d.noise_source)
    sigma_b = d.quantile_noise
    if d.adapts:  # the count of unclipped updates is released too: its noise shares the budget
        reports = cfg.asynchronous.buffer if cfg.participation.mode == "async" else cfg.clients_per_round_count(n)
        sigma_b = reports / 20.0 if sigma_b is None else sigma_b
        if not math.isfinite(privacy.update_noise(z, sigma_b)):
            raise ConfigError(f"config: privacy.adaptive_clip needs the count's noise 2 sigma_b above z = {z:.4g}, but "
                              f"sigma_b = {sigma_b:g}; raise privacy.quantile_noise or select more devices a round")
        attrs.update(privacy_quantile_noise=float(sigma_b), privacy_update_noise=privacy.update_noise(z, sigma_b))
    target = "" if d.epsilon is None else f" (for epsilon {d.epsilon:g} over {cfg.rounds} rounds)"
    on_info(f"privacy: {d.mechanism} noise, z = {z:.4g}{target}, clip C = {d.clip:g}, delta = {delta:.3g}, "
            f"q = {'M' if cfg.participation.mode == 'async' else 'S'}/N = {q:.3g}")
    # as run: z in place of the target (the ranks are sent this config; the log keeps the one given)
    return dataclasses.replace(cfg, privacy=dataclasses.replace(d, noise_multiplier=float(z), epsilon=None,
                                                                delta=float(delta), quantile_noise=sigma_b))


def local_transport(cfg: Config, algorithm: Algorithm, problem, model, device_ids=None, cores=None,
                    contention=None) -> LocalTransport:
    """The devices this process hosts (all of them in the simulator), run in a lane per core of `cores`
    (None in the simulator: [mpi] threads_per_rank lanes on cores 0.., one unpinned lane by default);
    contention: the competitor loads (cycled over devices), by default participation.contention."""
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
                          cache_mb=cfg.data.cache_mb, eval_apart=evaluates_apart(cfg))


def evaluates_apart(cfg: Config) -> bool:
    """Whether evaluation may overlap a worker still computing (so it needs a model of its own)."""
    return cfg.participation.mode in ("deadline", "async") or cfg.participation.overselect > 0


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
    tally = on_round = Tally(on_round, None if resume_point is None else resume_point.prefix)
    if on_warning is not None:
        on_round = DivergenceWatch(on_round, on_warning)
    if resume_point is not None and resume_point.complete:
        transport.close()
        return _summary(log_path, resume_point.prefix, 0, 0.0, tally, already_complete=True)
    wall0 = time.perf_counter()
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
                              setup.timing, label_counter(setup.problem, transport))
        if resume_point is None:
            engine.start(setup.model.initial_params())
            done = 0
        else:
            done = resume_point.rounds_done
            engine.resume(resume_point.state, done, resume_point.prefix)
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
            transport = local_transport(setup.cfg, setup.algorithm, setup.problem, setup.model)
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
