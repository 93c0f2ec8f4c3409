"""Rank roles of a run: in one process (the simulator), or rank 0 coordinating and ranks 1..P-1 hosting devices.

Setup is the only place small Python objects travel (pickled `bcast`/`gather`): rank 0 resolves and checks
the config (a bad one ends every rank with exit 2 and one line from rank 0), device ranks build only their
own devices' data and report whether they could. After that only buffers move (runtime/mpi/).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import socket
from pathlib import Path

import numpy as np

from edgefed import config as config_mod
from edgefed import hwprofile
from edgefed.algorithms import Algorithm, build_algorithm
from edgefed.errors import (EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_RANK_LOST, EXIT_REJOIN, ConfigError,
                            EdgefedError, Interrupted, RankLost, internal_error)
from edgefed.orchestration import run as run_mod
from edgefed.orchestration.budget import check_boards, check_rank_memory, rank_memory
from edgefed.orchestration.resume import Launch
from edgefed.problems.shard import check_made_from, check_shard, identity, shard_name
from edgefed.orchestration.timing import timing_for
from edgefed.runlog import discard_stub, let_go
from edgefed.runtime.mpi import protocol
from edgefed.runtime.mpi.comm import abort_with, mpi_of, wait, world
from edgefed.runtime.mpi.coordinator import MpiTransport, gather_setup, receive_setup, send_setup
from edgefed.runtime.mpi.device_server import DeviceServer, Heart
from edgefed.runtime.mpi.placement import device_owners, round_robin_devices
from edgefed.compression import codecs
from edgefed.runtime.mpi.protocol import Wire
from edgefed.width_models import width_models


def execute(resolve, force: bool, on_round, on_info, on_error, launch: Launch | None = None):
    """Run an experiment in this process or, under mpirun, across the ranks.

    `resolve()` gives (config, resume point, log path). Returns the RunResult on the process that wrote the
    log, or an exit code (device ranks, bad input, an interrupted MPI run); Ctrl-C in this process raises
    Interrupted, naming the log to resume.
    """
    comm = world()
    if comm is not None:
        if comm.Get_rank() != 0:
            return run_device_rank(comm)
        return run_coordinator(comm, resolve, force, on_round, on_info, on_error, launch)
    cfg, point, path = resolve()
    try:
        return run_mod.run(cfg, path, resume_point=point, force=force, on_round=on_round, on_info=on_info,
                           launch=launch)
    except KeyboardInterrupt:
        raise Interrupted(path) from None


def wire_for(cfg, algorithm: Algorithm, n_devices: int, model) -> Wire:
    """The MPI records of a run: the same on every rank, since every rank builds them from the same config."""
    return Wire(n_devices, model.n_trainable, model.dtype, algorithm.reports, tuple(v.name for v in algorithm.server_vectors),
                tuple(v.name for v in algorithm.device_vectors), *codecs(cfg.compress),
                tasks=cfg.participation.mode == "async",
                secagg_bits=cfg.secagg.bits if cfg.secagg.enabled else None)


def check_device_ranks(cfg, n_ranks: int) -> None:
    """[device] lists that name one entry per device rank must match this run's number of device ranks."""
    for key, values, what in (("boards", cfg.device.boards, "boards"), ("contention", cfg.device.contention, "loads")):
        if values and len(values) != n_ranks:
            raise ConfigError(f"config: device.{key} names {len(values)} {what}, but this run has {n_ranks} device "
                              f"ranks; give one per device rank (entry i is rank i + 1)")


def machine() -> tuple[str, list[int]]:
    """(host name, the cores this process may run on)."""
    return socket.gethostname(), run_mod.usable_cores()


def lanes(cfg, rank: int, machines: list[tuple[str, list[int]]], loaded: bool) -> list[int] | None:
    """The cores device rank `rank` runs its devices on, one lane each: [mpi] threads_per_rank of them, by
    default its share of its host's cores among the host's device ranks (one, beside a CPU competitor)."""
    host, cores = machines[rank]
    mates = [r for r in range(1, len(machines)) if machines[r][0] == host]
    if loaded and not cfg.mpi.threads_per_rank:
        return [cores[(rank - 1) % len(cores)]]
    threads = cfg.mpi.threads_per_rank or max(1, len(cores) // len(mates))
    if threads == 1 and not loaded:
        return None
    first = mates.index(rank) * threads
    return [cores[(first + t) % len(cores)] for t in range(threads)]


def run_coordinator(comm, resolve, force: bool, on_round, on_info, on_error, launch=None) -> int:
    """Rank 0. `resolve()` returns (config, resume point, log path) or raises EdgefedError. A rank lost is
    written to the launcher's status file before the world ends."""
    with contextlib.ExitStack() as held:  # (prepare holds the log for this process to write, until the end)
        return _coordinate(comm, resolve, force, on_round, on_info, on_error, launch, held)


def _coordinate(comm, resolve, force: bool, on_round, on_info, on_error, launch, held: contextlib.ExitStack) -> int:
    machines = comm.allgather(machine())
    point = path = setup = None
    try:
        cfg, point, path = resolve()
        held.callback(let_go, path)
        setup = run_mod.prepare(cfg, path, resume_point=point, force=force, on_info=on_info, launch=launch,
                                distributed=True)  # (it removes its stub itself if it fails)
        with run_mod.released_on_failure(path, setup.stub):
            owners = device_owners(setup.problem.n_devices, comm.Get_size(), setup.cfg.mpi.device_ranks)
            check_device_ranks(setup.cfg, comm.Get_size() - 1)
            setup = timing_for(setup, owners, on_info, point, distributed=True)
            plan_ranks(setup, owners, machines)
            # what the data is, when device ranks read shards of it (which must be of the same)
            data = identity(setup.problem.source) if setup.cfg.data.shards else None
    except EdgefedError as exc:
        _complete(send_setup(comm, {"error": str(exc)}))
        on_error(str(exc))
        return EXIT_BAD_INPUT
    except BaseException as exc:  # a bug: the device ranks must not wait for a config that never comes
        _complete(send_setup(comm, {"error": f"{type(exc).__name__}: {exc}"}))
        raise
    # the weights the run starts from, so that model.weights is read on this board alone
    sent = send_setup(comm, {"config": config_mod.to_toml(setup.cfg),
                             "owners": owners if setup.cfg.mpi.device_ranks else None, "weights": setup.weights,
                             "data": data})
    setup = dataclasses.replace(setup, weights=None)
    try:
        reports = gather_setup(comm, config_mod.rank_timeout(setup.cfg),
                               {rank: host for rank, (host, _) in enumerate(machines)})
        _complete(sent)  # every rank reported, so every rank took its setup
        sent = None  # (its buffer: the weights a run starts from, among the rest)
    except RankLost as exc:  # hung while building its devices: the stub is there to resume
        if launch is not None and launch.status is not None:
            _say_lost(launch.status, exc)
        return abort_with(comm, f"{exc}, building its devices; ending the world (--resume {path} starts the run "
                          "again, edgefed launch does so without the rank)", EXIT_RANK_LOST)
    failures = [f for f, _, _ in reports if f]
    if failures:
        comm.bcast(False, root=0)
        if setup.stub:
            discard_stub(path)
        on_error("; ".join(text for text, _ in failures))
        return EXIT_INTERNAL if any(internal for _, internal in failures) else EXIT_BAD_INPUT
    comm.bcast(True, root=0)
    run_mod.note_warmup(setup, [w[0] for _, w, _ in reports], [w[1] for _, w, _ in reports], on_info)
    threads = {rank + 1: t for rank, (_, _, t) in enumerate(reports)}
    on_info(f"MPI: {comm.Get_size() - 1} device ranks; devices per rank "
            f"{np.bincount(owners, minlength=comm.Get_size())[1:].tolist()}"
            + ("" if set(threads.values()) == {1} else f"; run at once per rank {list(threads.values())}"))
    transport = MpiTransport(comm, wire_for(setup.cfg, setup.algorithm, setup.problem.n_devices, setup.model), owners, threads,
                             rank_timeout_s=config_mod.rank_timeout(setup.cfg),
                             hosts={rank: host for rank, (host, _) in enumerate(machines)})
    try:
        result = run_mod.drive(setup, transport, path, resume_point=point, on_warning=on_info,
                               on_round=_until_a_board_is_back(on_round, launch))
    except KeyboardInterrupt:
        return abort_with(comm, str(Interrupted(path)), EXIT_INTERRUPTED)
    except BoardBack as exc:
        return abort_with(comm, f"{exc} answered again: ending the world after round {exc.round_idx} for edgefed "
                          "launch to start it again with it", EXIT_REJOIN, error=False)
    except RankLost as exc:
        if launch is not None and launch.status is not None:
            _say_lost(launch.status, exc)
        return abort_with(comm, f"{exc}; ending the world (the log {path} holds every completed round; --resume "
                          "continues it, edgefed launch does so without the rank)", EXIT_RANK_LOST)
    except EdgefedError as exc:
        hint = f" (the log {path} holds every completed round; --resume continues it)" if path.exists() else ""
        return abort_with(comm, f"{exc}{hint}", EXIT_BAD_INPUT)
    except BaseException as exc:  # noqa: BLE001 - any failure must take the world down, not hang it
        return abort_with(comm, internal_error(exc), EXIT_INTERNAL)
    return result


class BoardBack(Exception):
    """A board edgefed launch left out is back (the exception's text: its host), after round round_idx."""

    def __init__(self, host: str, round_idx: int):
        super().__init__(host)
        self.round_idx = round_idx


def _until_a_board_is_back(on_round, launch: Launch | None):
    """on_round, then, after any round but the last, a check for the launcher's word that a board is back."""
    flag = None if launch is None else launch.board_back
    if flag is None:
        return on_round

    def watched(s) -> None:
        if on_round is not None:
            on_round(s)
        if 0 < s.round_idx < s.rounds and flag.exists():
            raise BoardBack(flag.read_text(encoding="utf-8").strip() or "a board", s.round_idx)

    return watched


def _complete(sent: list) -> None:
    for req in sent[1:]:  # sent[0] is the buffer, kept alive until here
        wait(req)


def _say_lost(status: Path, lost: RankLost) -> None:
    """Tell the launcher which rank to go on without (one small JSON file, swapped in whole)."""
    tmp = status.with_name(status.name + ".tmp")
    try:
        tmp.write_text(json.dumps({"rank": lost.rank, "host": lost.host, "silent_s": lost.silent_s}))
        os.replace(tmp, status)
    except OSError:
        pass  # the launcher then restarts with every rank, and the rank times out again


def rank_lanes(cfg, rank: int, machines) -> tuple[list[int] | None, tuple]:
    """(device rank `rank`'s lanes, the CPU loads beside its devices)."""
    loads = cfg.participation.contention
    if cfg.device.contention:  # this board's own load, beside each of its devices
        load = cfg.device.contention[rank - 1]
        loads = (load,) if load > 0 else ()
    return lanes(cfg, rank, machines, bool(loads)), loads


def plan_ranks(setup, owners: np.ndarray, machines) -> None:
    """Each device rank's memory estimate, into the log's header, and held to its board's memory ([device]
    boards) before the world builds anything."""
    cfg = setup.cfg
    needs = {}
    for rank in range(1, len(machines)):
        cores, _ = rank_lanes(cfg, rank, machines)
        needs[rank] = rank_memory(cfg, setup.algorithm, setup.problem, setup.model,
                                  np.flatnonzero(owners == rank), len(cores or (None,)))
    # ([device] profile alone may time a workstation's ranks as boards: only a board list names real boards)
    boards = {rank: hwprofile.load_profile(cfg.device.boards[rank - 1]) for rank in needs} if cfg.device.boards else {}
    check_boards(needs, boards)
    attrs = setup.header.attrs
    attrs["rank_memory_estimate_mb"] = np.concatenate([attrs["rank_memory_estimate_mb"][:1],
                                                       [needs[r][0] / 2 ** 20 for r in sorted(needs)]])
    if boards:  # what each rank's board leaves it (rank 0's: none named)
        attrs["rank_board_memory_mb"] = np.array([np.nan] + [boards[r].available_mb for r in sorted(needs)])


def _build_devices(cfg, info, rank: int, machines):
    """A device rank's setup (its devices' data, its lanes, the kernels compiled): (failure or None, transport,
    problem, model, warm-up), so that its failure reaches rank 0 as a report rather than hanging the world; a
    failure is (its line, whether it is an internal error)."""
    failure, transport, problem, model, warm = None, None, None, None, (0, 0.0)
    try:
        shard = Path(cfg.data.shards) / shard_name(rank) if cfg.data.shards else None
        if shard is not None:  # (of other data: said before anything is built from it)
            check_made_from(shard, cfg.data.path, info["data"])
        problem = run_mod.shared_problem(cfg, convert=False, shard=shard)
        owners = info.pop("owners")  # (None: round-robin, each rank's own computed here, no array of every device)
        own = (round_robin_devices(rank, problem.n_devices, len(machines)) if owners is None
               else np.flatnonzero(owners == rank))
        if hasattr(problem, "host"):  # before anything asks for its devices' sizes (the model does)
            problem.host(own)
        weights = info.pop("weights")
        problem, model = run_mod.model_for(cfg, problem, run_mod.start_weights(cfg) if weights is None else weights)
        if shard is not None:
            check_shard(problem, own)
        algorithm = build_algorithm(cfg)
        cores, loads = rank_lanes(cfg, rank, machines)
        widths = width_models(cfg, problem, model)  # (before the memory check: this process holds them)
        check_rank_memory(cfg, algorithm, problem, model, own, len(cores or (None,)))
        transport = run_mod.local_transport(cfg, algorithm, problem, model, device_ids=own, cores=cores,
                                            contention=loads, widths=widths)
        warm = transport.warmup()
    except EdgefedError as exc:
        failure = (f"rank {rank}: {exc}", False)
    except BaseException as exc:  # noqa: BLE001 - reported through rank 0 rather than hanging the world
        failure = (f"rank {rank}: {internal_error(exc)}", True)
    return failure, transport, problem, model, warm


def run_device_rank(comm) -> int:
    """Ranks 1..P-1: build the devices this rank hosts, then serve the coordinator until it says stop."""
    rank = comm.Get_rank()
    machines = comm.allgather(machine())
    info = receive_setup(comm)
    if "error" in info:
        return EXIT_BAD_INPUT
    cfg = config_mod.config_from_dict(config_mod.parse_toml(info["config"]))
    heart = Heart(comm, config_mod.rank_timeout(cfg) / 4)
    failure, transport, problem, model, warm = heart.beating(_build_devices, cfg, info, rank, machines)
    report = np.frombuffer(pickle.dumps((failure, warm, 1 if transport is None else transport.threads)), np.uint8)
    wait(comm.Isend([report, mpi_of(comm).BYTE], dest=0, tag=protocol.TAG_SETUP), also=heart.beat)
    if not comm.bcast(None, root=0):
        if transport is not None:
            transport.close()
        return EXIT_BAD_INPUT
    server = DeviceServer(comm, wire_for(cfg, transport.algorithm, problem.n_devices, model), transport, heart=heart)
    try:
        server.serve()
    except KeyboardInterrupt:  # Ctrl-C reaches every rank; rank 0 says what to do, and ends the world
        transport.close(failed=True)
        return EXIT_INTERRUPTED
    except BaseException as exc:  # noqa: BLE001
        transport.close()
        message = str(exc) if isinstance(exc, EdgefedError) else internal_error(exc)
        return abort_with(comm, message, EXIT_BAD_INPUT if isinstance(exc, EdgefedError) else EXIT_INTERNAL)
    transport.close()
    return 0
