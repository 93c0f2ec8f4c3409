"""Buffered asynchronous aggregation (FedBuff) in whole runs: the rule against an independent NumPy replay
of the log on a quadratic, the log's invariants, determinism, and what it refuses."""

import dataclasses

import numpy as np
import pytest

from edgefed.errors import ConfigError
from edgefed.orchestration import ranks
from edgefed.orchestration import run as runs
from edgefed.runlog import read_resume_point, read_run
from edgefed.runtime.mpi import protocol
from conftest import config_with
from helpers import assert_same_logs, compared, interrupted_then_resumed, run_until
from loopback_mpi import World

N, D, K, LR, M = 8, 6, 3, 0.1, 2
PROFILE = """format = 1
name = "a hand-timed board"
measured = true
[machine]
arch = "any"
cores = 1
memory_mb = 8192  # (the plan holds each rank to it: this process stands in for a rank)
[recommend]
[[speed]]
model = "quadratic"
params = 6
batch = 1
steps_per_s = 1000.0
[power]  # (its energy is logged: the simulator and the ranks must agree on it too)
idle_w = 2.0
busy_w_per_core = 0.5
"""


@pytest.fixture
def problem(tmp_path, quad_file):
    g = np.random.default_rng(3)
    A, b = g.uniform(0.5, 2.0, (N, D)), g.normal(size=(N, D))
    path = quad_file(A, b, n=np.array([3, 1, 2, 4, 1, 1, 2, 5]), x0=g.normal(size=D))
    (tmp_path / "hand.toml").write_text(PROFILE)
    return A, b, path, tmp_path / "hand.toml"


def _config(path, profile, **extra):
    return config_with({"data.kind": "quadratic", "data.path": str(path), "model.dtype": "float64", "rounds": 15,
                        "train.clients_per_round": "all", "train.local_steps": K, "train.lr_local": LR,
                        "participation.mode": "async", "device.profile": str(profile),
                        "device.speed": [1.0, 0.5, 0.25], "async.concurrency": 4, "async.buffer": M,
                        "async.max_staleness": 3, **extra})


@pytest.mark.parametrize("staleness,exponent", [("constant", 0.5), ("polynomial", 0.5), ("polynomial", 2.0)])
def test_fedbuff_follows_a_numpy_replay_of_its_log(tmp_path, problem, staleness, exponent):
    A, b, path, profile = problem
    cfg = _config(path, profile, **{"async.staleness": staleness, "async.staleness_exponent": exponent})
    runs.run(cfg, tmp_path / "a.h5")
    log = read_run(tmp_path / "a.h5")
    tau, late, coeff = log["participation/staleness"], log["participation/late"], log["participation/coeff"]
    versions = [log["trajectory/x"][0]]
    for t in range(1, 16):
        taken = np.flatnonzero((tau[t - 1] >= 0) & ~late[t - 1])
        assert taken.size == M and (tau[t - 1, taken] <= 3).all()  # the buffer, within the staleness bound
        assert (tau[t - 1, late[t - 1]] > 3).all()  # what was discarded was too stale
        step = np.zeros(D)
        for k in taken:
            start = versions[t - 1 - tau[t - 1, k]]
            y = start.copy()
            for _ in range(K):
                y = y - LR * (A[k] * (y - b[k]))
            w = 1.0 if staleness == "constant" else (1.0 + tau[t - 1, k]) ** -exponent
            assert coeff[t - 1, k] == pytest.approx(w / M, rel=1e-15)
            step += w / M * (y - start)
        versions.append(versions[-1] + step)
    np.testing.assert_allclose(log["trajectory/x"], np.array(versions), rtol=0, atol=1e-12)
    assert np.all(np.diff(log["metrics/clock_s"]) >= 0) and log["attrs"]["clock"] == "simulated"
    assert (tau > 0).any()  # concurrency 4, buffer 2: some reports are stale


def test_async_runs_are_deterministic_and_fast_boards_report_more(tmp_path, problem):
    _, _, path, profile = problem
    cfg = _config(path, profile, rounds=40)
    runs.run(cfg, tmp_path / "a.h5")
    runs.run(cfg, tmp_path / "b.h5")
    a = read_run(tmp_path / "a.h5")
    assert_same_logs(a, read_run(tmp_path / "b.h5"))
    taken = (a["participation/staleness"] >= 0) & ~a["participation/late"]
    per_device = taken.sum(axis=0)
    assert per_device[[0, 3, 6]].sum() > per_device[[2, 5]].sum()  # speed 1.0 against 0.25


def test_an_async_log_replays_bit_for_bit(tmp_path, problem):
    """trace = RUN.h5 with mode = "async": the recorded order, staleness and clock, the same trajectory."""
    _, _, path, profile = problem
    cfg = _config(path, profile, **{"async.staleness": "polynomial"})
    runs.run(cfg, tmp_path / "orig.h5")
    replay = _config(path, profile, **{"participation.trace": str(tmp_path / "orig.h5"), "rounds": 12})
    runs.run(replay, tmp_path / "replay.h5")
    orig, again = read_run(tmp_path / "orig.h5"), read_run(tmp_path / "replay.h5")
    assert again["attrs"]["clock"] == "replayed"
    for name in ("trajectory/x", "participation/staleness", "participation/coeff", "participation/steps",
                 "participation/selected", "participation/late", "metrics/train_loss"):
        rows = 13 if name in ("trajectory/x", "metrics/train_loss") else 12
        assert again[name].tobytes() == orig[name][:rows].tobytes(), name
    assert again["metrics/clock_s"].tobytes() == orig["metrics/clock_s"][:13].tobytes()
    with pytest.raises(ConfigError, match=r"holds 15 server updates but this run needs 20"):
        runs.run(_config(path, profile, **{"participation.trace": str(tmp_path / "orig.h5"), "rounds": 20}),
                 tmp_path / "long.h5")
    runs.run(config_with({"rounds": 2}), tmp_path / "sync.h5")
    with pytest.raises(ConfigError, match=r"is not an async run's log; replay it with participation.mode = \"trace\""):
        runs.run(_config(path, profile, **{"participation.trace": str(tmp_path / "sync.h5")}), tmp_path / "s.h5")


def test_a_killed_async_run_resumes_to_the_same_log(tmp_path, problem):
    _, _, path, profile = problem
    whole, resumed = interrupted_then_resumed(_config(path, profile), tmp_path, 7)
    assert_same_logs(whole, resumed)
    cfg = _config(path, profile, **{"log.every": 2})
    point = run_until(cfg, tmp_path / "sparse.h5", 4)
    with pytest.raises(ConfigError, match=r"--resume of an async run needs .* \[log\] every = 1"):
        runs.run(cfg, tmp_path / "sparse.h5", resume_point=point)


def _loopback(cfg, path, size=3):
    world, errors = World(size), []
    mains = {0: lambda comm: ranks.run_coordinator(comm, lambda: (cfg, None, path), False, None, lambda line: None,
                                                   errors.append)}
    mains.update({r: ranks.run_device_rank for r in range(1, size)})
    world.run(mains)
    assert not errors, errors
    return world


def test_under_ranks_reports_come_as_they_finish_and_the_simulator_replays_them(tmp_path, problem):
    """A measured async run across ranks (tasks point to point, reports in arrival order, evaluations while
    tasks run), then its log replayed in the simulator to the same trajectory, bit for bit."""
    _, _, path, profile = problem
    cfg = _config(path, profile, **{"participation.clock": "measured"})
    world = _loopback(cfg, tmp_path / "mpi.h5")
    tasks = [size for src, dest, tag, size in world.sent if src == 0 and tag == protocol.TAG_TASK]
    assert len(tasks) >= 15 * M  # every taken report was a task sent to its rank
    mpi = read_run(tmp_path / "mpi.h5")
    assert mpi["attrs"]["clock"] == "measured" and np.all(np.diff(mpi["metrics/clock_s"]) >= 0)
    taken = (mpi["participation/staleness"] >= 0) & ~mpi["participation/late"]
    assert (taken.sum(axis=1) == M).all()
    replay = _config(path, profile, **{"participation.trace": str(tmp_path / "mpi.h5")})
    runs.run(replay, tmp_path / "replay.h5")
    again = read_run(tmp_path / "replay.h5")
    for name in ("trajectory/x", "participation/staleness", "participation/coeff", "participation/steps",
                 "metrics/train_loss", "metrics/clock_s"):
        assert again[name].tobytes() == mpi[name].tobytes(), name
    # on the simulated clock the ranks compute the schedule's tasks as the simulator does: the same bytes
    runs.run(cfg := _config(path, profile, **{"participation.clock": "simulated"}), tmp_path / "sim.h5")
    _loopback(cfg, tmp_path / "ranks.h5")
    assert_same_logs(sim := read_run(tmp_path / "sim.h5"), read_run(tmp_path / "ranks.h5"))
    assert "participation/energy_j" in compared(sim)


def test_a_task_stops_at_its_deadline_on_ranks_and_a_measured_run_is_not_resumed(tmp_path, problem):
    _, _, path, profile = problem
    cfg = _config(path, profile, **{"participation.clock": "measured", "participation.deadline_s": 0.002,
                                    "train.local_steps": 10**7, "rounds": 4})
    _loopback(cfg, tmp_path / "d.h5")
    log = read_run(tmp_path / "d.h5")
    taken = (log["participation/staleness"] >= 0) & ~log["participation/late"]
    steps = log["participation/steps"][taken]
    assert (steps > 0).all() and (steps < 10**7).all()  # each task did what fit in 2 ms, and it counts
    assert (log["participation/coeff"][taken] > 0).all()
    point = dataclasses.replace(read_resume_point(tmp_path / "d.h5"), complete=False)
    world, errors = World(3), []
    mains = {0: lambda comm: ranks.run_coordinator(comm, lambda: (cfg, point, tmp_path / "d.h5"), False, None,
                                                   lambda line: None, errors.append)}
    mains.update({r: ranks.run_device_rank for r in (1, 2)})
    world.run(mains)
    assert errors and "--resume of an async run on a measured clock cannot restore the tasks" in errors[0]


def test_fedprox_runs_async_and_what_async_refuses_is_said_in_one_line(tmp_path, problem):
    _, _, path, profile = problem
    runs.run(_config(path, profile, **{"train.algorithm": "fedprox", "rounds": 4}), tmp_path / "p.h5")
    assert read_run(tmp_path / "p.h5")["participation/coeff"].sum() > 0
    with pytest.raises(ConfigError, match=r"is an async run's log .*; replay it with participation.mode = \"async\""):
        runs.run(config_with({"participation.mode": "trace", "participation.trace": str(tmp_path / "p.h5"),
                              "rounds": 2}), tmp_path / "r.h5")
    with pytest.raises(ConfigError, match=r'mode = "async" runs FedBuff over FedAvg or FedProx .* not \'scaffold\''):
        _config(path, profile, **{"train.algorithm": "scaffold"})
    with pytest.raises(ConfigError, match=r'does not take participation.overselect yet'):
        _config(path, profile, **{"participation.overselect": 0.5})
    with pytest.raises(ConfigError, match=r"async.buffer = 9 exceeds the 8 devices"):
        _config(path, profile, **{"async.buffer": 9, "data.clients": 8})
    with pytest.raises(ConfigError, match=r"async.concurrency = 40 exceeds the 30 devices"):  # the default N
        config_with({"participation.mode": "async", "async.concurrency": 40})
    with pytest.raises(ConfigError, match=r"does not take compress.error_feedback yet; set compress.error_feedback = "
                                          r"false"):
        _config(path, profile, **{"compress.uplink": "int8"})
    no_board = config_with({"participation.mode": "async", "rounds": 2})
    with pytest.raises(ConfigError, match=r'"async" in the simulator runs on the simulated clock: set \[device\] profile'):
        runs.run(no_board, tmp_path / "n.h5")
    assert not (tmp_path / "n.h5").exists()
