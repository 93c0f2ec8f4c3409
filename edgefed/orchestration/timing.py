"""How a run keeps time, decided before round 1: the clock (measured, simulated from the boards' profiles,
or a replayed log's), each device's simulated step and link times, and the deadline policy (fixed seconds,
a multiple of the profiled time, or adaptive)."""

from __future__ import annotations

import dataclasses

import numpy as np

from edgefed import hwprofile
from edgefed.compression import codecs
from edgefed.errors import ConfigError
from edgefed.participation.budgets import local_budgets
from edgefed.participation.energy import BoardPower
from edgefed.participation.submodels import ASSIGN_SPEED, Submodels, assign_by_speed, mean_step_s
from edgefed.participation.timing import Boards, Timing
from edgefed.orchestration.header import energy_column, energy_read_column
from edgefed.participation.asynchrony import Recorded
from edgefed.participation.traces import ReplayTrace


def board_names(cfg, n_devices: int, owners: np.ndarray | None) -> list[str] | None:
    """Each device's board (a profile name): its rank's under mpirun with [device] boards, else [device]
    profile for every device; None when neither names one."""
    dev = cfg.device
    if owners is not None and dev.boards:
        return [dev.boards[int(r) - 1] for r in owners]
    if dev.profile is not None:
        return [dev.profile] * n_devices
    return None


def _board_step_seconds(setup, names, profiles: dict, model=None) -> np.ndarray:
    """Each device's seconds per local step on its board, at its batch (the profiles' [[speed]], by name), as a
    device rank takes them (less the share its [rank] loses). model: a submodel width's (default: the run's);
    a profile that does not time it times it as the run's model per parameter."""
    cfg, problem = setup.cfg, setup.problem
    model = setup.model if model is None else model
    batches = problem.n_train if cfg.train.batch_size == "full" else np.minimum(cfg.train.batch_size, problem.n_train)
    key, whole = model.profile_key(), setup.model.profile_key()
    keys = {name: key if prof.times(key) else whole for name, prof in profiles.items()}
    return np.array([profiles[names[k]].rank_step_seconds(keys[names[k]], int(batches[k]), model.n_trainable)
                     for k in range(problem.n_devices)])


def _comm_seconds(setup, names, profiles, params: int | None = None) -> np.ndarray:
    """Each device's seconds of a round besides its steps: its profile's collectives, plus its rank's own work
    of a round ([rank] round_s); NaN where the profile has neither. params: a submodel width's (default: the
    run's model's)."""
    key, params = setup.model.profile_key(), setup.model.n_trainable if params is None else params

    def seconds(prof) -> float:
        comm = prof.comm_seconds(key, params)
        own = None if prof.rank is None or not prof.rank.round_s else prof.rank.round_seconds(key, params)
        return np.nan if comm is None and own is None else (comm or 0.0) + (own or 0.0)

    of_board = {name: seconds(prof) for name, prof in profiles.items()}  # (a profile once, not once a device)
    return np.array([of_board[name] for name in names])


def link_speeds(cfg, n_devices: int) -> np.ndarray | None:
    """Each device's shaped link, megabits per second ([device] link_mbps cycled; None: not shaped)."""
    mbps = cfg.device.link_mbps
    return np.array([mbps[k % len(mbps)] for k in range(n_devices)], np.float64) if mbps else None


def round_bytes(cfg, algorithm, model) -> int:
    """What a selected device's round moves: the broadcast (x, server vectors) and its report, encoded."""
    uplink, downlink = codecs(cfg.compress)
    return ((1 + len(algorithm.server_vectors)) * downlink.nbytes(model.n_trainable, model.dtype)
            + len(algorithm.reports) * uplink.nbytes(model.n_trainable, model.dtype))


def timing_for(setup, owners: np.ndarray | None = None, on_info=None, resume_point=None, distributed: bool = False):
    """Setup with its Timing. owners: the rank hosting each device under mpirun (None: this process hosts
    every device, on [device] profile's board). A resumed run keeps the clock and deadlines its log holds,
    whatever its profiles say now; the log's attributes record them."""
    cfg, p, n = setup.cfg, setup.cfg.participation, setup.problem.n_devices
    attrs = {} if resume_point is None else resume_point.attrs
    names = board_names(cfg, n, owners)
    key = setup.model.profile_key()
    untimed = None  # a profile the run names that does not time its model
    profiles = {} if names is None else {name: hwprofile.load_profile(name) for name in dict.fromkeys(names)}
    if names is not None:
        untimed = next((prof for prof in profiles.values() if not prof.times(key)), None)
        factor = None if p.deadline_s in (None, "adaptive") else hwprofile.parse_deadline(p.deadline_s)
        if untimed is not None and (p.clock == "simulated" or factor is not None
                                    or (setup.model.kind != "quadratic" and p.clock is None and not distributed
                                        and cfg.device.profile is not None and not attrs.get("clock"))):
            raise ConfigError(hwprofile.not_timed(untimed, key))  # the run needs the board's speed for its model
    profiled = names is not None and untimed is None
    boards = board_step = speed = None
    if profiled:
        board_step = _board_step_seconds(setup, names, profiles)
        speed = np.array([cfg.device.speed[k % len(cfg.device.speed)] if cfg.device.speed else 1.0 for k in range(n)])
        boards = Boards(board_step / speed, _comm_seconds(setup, names, profiles))
    replay = ((isinstance(setup.trace, ReplayTrace) and setup.trace.clock_s is not None)
              or (isinstance(setup.trace, Recorded) and setup.trace.clock_s is not None))
    clock = attrs.get("clock") or ("replayed" if replay else p.clock) or (
        "simulated" if profiled and not distributed and cfg.device.profile is not None else "measured")
    timed = isinstance(setup.trace, Recorded) or (clock == "simulated" and boards is not None)
    if p.mode == "async" and not timed and not distributed:
        raise ConfigError('config: participation.mode = "async" in the simulator runs on the simulated clock: set '
                          '[device] profile (a real federation\'s time is measured under mpirun)')
    resuming = resume_point is not None and not resume_point.complete and not resume_point.fresh
    if p.mode == "async" and resuming and not timed:
        raise ConfigError("--resume of an async run on a measured clock cannot restore the tasks that were in "
                          "flight; its log replays exactly (participation.trace = RUN.h5), or run it again")
    if p.mode == "async" and resuming and cfg.log.every != 1:
        raise ConfigError(f"--resume of an async run needs every server model its tasks in flight started from, "
                          f"which [log] every = 1 keeps; this log has every = {cfg.log.every}: run it again")
    if clock == "simulated" and boards is None:
        raise ConfigError('config: participation.clock = "simulated" times each device by its board\'s profile; '
                          'set [device] profile (or boards under mpirun), a profile that times the run\'s model')
    deadlines = _deadlines(setup, board_step, profiles, names, on_info, attrs)
    submodels, moved = None, round_bytes(cfg, setup.algorithm, setup.model)
    if setup.widths is not None:  # a width's steps and slice take their own time: the clock charges each device's
        submodels, width_step = _submodels(setup, names, profiles, deadlines, speed, on_info)
        moved = submodels.slice_bytes(moved, submodels.device_width)
        if boards is not None:
            comm = np.stack([_comm_seconds(setup, names, profiles, setup.widths.n_params(w)) for w in submodels.widths])
            boards = Boards(width_step, comm[np.searchsorted(submodels.widths, submodels.device_width), np.arange(n)])
    timing = Timing(clock=str(clock), boards=boards, deadlines=deadlines,
                    quantile=p.deadline_quantile if p.deadline_s == "adaptive" else None, covers=p.deadline_covers,
                    overselect=p.overselect,
                    link_delays={(f.device, f.round): f.seconds for f in cfg.fault if f.kind == "slow_link"},
                    link_mbps=link_speeds(cfg, n), round_bytes=moved)
    hosts = np.zeros(n, np.int64) if owners is None or not distributed else np.asarray(owners, np.int64) - 1
    power, said = board_power(names, profiles, hosts, timing)
    if said:
        (on_info or (lambda line: None))(said)
    setup.header.attrs["clock"] = timing.clock
    # whose late devices were over-selected surplus, outside the rounds' weights (a replay weighs alike)
    setup.header.attrs["overselected"] = p.overselect > 0 or (isinstance(setup.trace, ReplayTrace)
                                                              and setup.trace.overselected)
    if deadlines is not None:
        setup.header.attrs["deadline_s"] = deadlines
    if names is not None and timing.clock == "measured":  # what the summary holds each real board to
        setup.header.attrs["device_board"] = hosts.astype(np.int32)
        if boards is not None:
            setup.header.attrs["profile_step_s"] = boards.step_s
    header = setup.header
    if power is None and resume_point is not None and "participation/energy_j" in resume_point.logged:
        power = BoardPower(np.zeros(n, np.int64), np.array([np.nan]), np.array([np.nan]))  # (its rows go on, NaN)
    if power is not None:
        reads = (timing.clock == "measured" and distributed) or (
            resume_point is not None and "participation/energy_read_j" in resume_point.logged)  # (its rows go on)
        timing = dataclasses.replace(timing, power=power, reads_energy=reads)
        read = (energy_read_column(n),) if reads else ()
        header = dataclasses.replace(header, extra_columns=header.extra_columns + (energy_column(n),) + read)
    return dataclasses.replace(setup, timing=timing, header=header, submodels=submodels)


def board_power(names: list[str] | None, profiles: dict, hosts: np.ndarray, timing: Timing):
    """(each device's board and what it draws, what to say of it): on a simulated or replayed clock every
    device is a board of its own (as the simulator times it); on a measured one a rank's devices share its
    board (hosts: rank - 1; in the simulator, this process's: 0). None where no profile names a board, where
    none of them has [power], or where a replayed clock has no step times to charge (said once). profiles:
    the boards' profiles by name."""
    if names is None:
        return None, None
    missing = sorted(name for name, prof in profiles.items() if prof.power is None)
    if len(missing) == len(profiles):
        which = f"profile {missing[0]} has" if len(missing) == 1 else f"profiles {', '.join(missing)} have"
        return None, (f"energy: not computed (hardware {which} no [power]; add idle_w and busy_w_per_core with "
                      "their sources to compute it)")
    if timing.clock != "measured" and timing.boards is None:
        return None, ("energy: not computed (a replayed clock charges simulated busy time, which needs profiles that "
                      "time the model)")
    n = len(names)
    if timing.clock != "measured":
        board, of_board = np.arange(n), list(names)
    else:
        board, of_board = hosts, [None] * (int(hosts.max(initial=0)) + 1)
        for k, b in enumerate(board.tolist()):
            of_board[b] = names[k]
    watts = [profiles[name].power if name is not None else None for name in of_board]
    idle = np.array([np.nan if w is None else w.idle_w for w in watts])
    busy = np.array([np.nan if w is None else w.busy_w_per_core for w in watts])
    note = (f"energy: modelled from the [power] of {', '.join(sorted(set(profiles) - set(missing)))}"
            + (f"; not computed for devices on {', '.join(missing)} (no [power])" if missing else ""))
    return BoardPower(board, idle, busy), note


def _submodels(setup, names, profiles, deadlines, speed, on_info) -> tuple[Submodels, np.ndarray | None]:
    """([submodel] as the coordinator runs it: each device's width, assigned as configured; each device's
    seconds a step at its width at its speed (device.speed), None without profiles). A width's step time is its profile's
    own speed entry where the profile times the width's layer list, else the whole model's per parameter
    (hwprofile's rule), at the device's batch."""
    cfg, widths = setup.cfg, setup.widths
    s, n = cfg.submodel, setup.problem.n_devices
    step = None
    if speed is not None:
        step = np.stack([_board_step_seconds(setup, names, profiles, widths.models[w]) for w in widths.widths]) / speed
    if s.assign != ASSIGN_SPEED:
        if len(s.assign) != n:  # (a data file's N is known once it is read)
            raise ConfigError(f"config: submodel.assign lists {len(s.assign)} widths for {n} devices; give one a "
                              'device, or assign = "speed"')
        device_width = np.asarray(s.assign, np.float64)
    elif step is None or deadlines is None:
        device_width = np.full(n, widths.widths[-1])
        if on_info is not None:
            why = "no board profile times the model" if step is None else "the run has no fixed deadline"
            on_info(f"submodel: assign = \"speed\", but {why}: every device trains width {widths.widths[-1]:g}")
    else:
        device_width = assign_by_speed(widths.widths, step, local_budgets(cfg.train, setup.problem.n_train),
                                       deadlines)
    if on_info is not None:
        shares = ", ".join(f"{w:g}: {int(np.count_nonzero(device_width == w))}" for w in widths.widths)
        on_info(f"submodel {s.method}: devices per width {shares}")
    plan = Submodels(s.method, widths.widths, widths.positions, device_width)
    return plan, None if step is None else mean_step_s(s.method, widths.widths, step, device_width)


def _deadlines(setup, board_step, profiles, names, on_info, attrs) -> np.ndarray | None:
    """The fixed deadline policies: the configured seconds, or a multiple of the time each device's budget
    of K_k steps takes on its board (its profile's speed, not its simulated relative speed)."""
    cfg, p, n = setup.cfg, setup.cfg.participation, setup.problem.n_devices
    if p.mode not in ("deadline", "async") or p.deadline_s in (None, "adaptive"):
        return None
    logged = attrs.get("deadline_s")
    if logged is not None and np.shape(logged) == (n,):
        return np.asarray(logged, np.float64)
    factor = hwprofile.parse_deadline(p.deadline_s)
    if factor is None:
        return np.full(n, float(p.deadline_s))
    if board_step is None:
        raise ConfigError("config: the simulator runs every device on this machine; set [device] profile "
                          "to its hardware profile (device.boards applies under mpirun)")
    deadlines = factor * local_budgets(cfg.train, setup.problem.n_train) * board_step
    if on_info is not None:
        parts = []
        for name, prof in profiles.items():
            mine = deadlines[[k for k in range(n) if names[k] == name]]
            estimated = "" if prof.measured else ", estimated speeds"
            parts.append(f"{prof.name} ({name}{estimated}): {mine.min() * 1e3:.1f}..{mine.max() * 1e3:.1f} ms")
        on_info(f"deadlines {factor:g}x the profiled time of each device's steps: " + "; ".join(parts))
    return deadlines
