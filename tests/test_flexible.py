"""Flexible participation (Ruan et al.): schemes on traced rounds, traces, replay, arrivals and departures."""

import subprocess
import sys

import numpy as np
import pytest

from edgefed import config as config_mod
from edgefed.analysis.logs import Run
from edgefed.analysis.summary import summary_lines
from edgefed.orchestration import run as runs
from edgefed.errors import ConfigError
from edgefed.participation import schemes
from edgefed.participation.dynamics import Dynamics
from edgefed.tracefiles import BUILTIN, read_trace_file, sampled_traces, write_trace_file
from conftest import config_with
from helpers import assert_same_logs, interrupted_then_resumed


def quad(quad_file, N=4, d=3, seed=0):
    g = np.random.default_rng(seed)
    A, b = g.uniform(0.5, 2.0, (N, d)), g.normal(0, 2, (N, d))
    return A, b, quad_file(A, b, x0=np.zeros(d))


def constant_traces(tmp_path, fractions):
    """A trace file whose trace k always completes fractions[k] of the budget; returns the per-device list."""
    path = tmp_path / "const.csv"
    write_trace_file(path, [f"t{k}" for k in range(len(fractions))], np.array(fractions)[None, :], {"note": "test"})
    return [f"{path}#t{k}" for k in range(len(fractions))]


def run_quad(run_experiment, path, **extra):
    base = {"data.kind": "quadratic", "data.path": str(path), "model.dtype": "float64", "rounds": 3,
            "train.clients_per_round": "all", "train.local_steps": 8, "train.lr_local": 0.1,
            "train.weighting": "uniform", "log.eval_every": 1000}
    base.update(extra)
    return run_experiment(base)


@pytest.mark.parametrize("scheme,expected", [
    ("A", [4 / 2 * 0.25, 0.0, 0.0, 4 / 2 * 0.25]),  # only complete devices, scaled by |S| / K_r = 4 / 2
    ("B", [0.25, 0.25, 0.25, 0.25]),
    ("C", [0.25, 0.25 * 8 / 4, 0.25 * 8 / 2, 0.25]),  # K / s_k
])
def test_scheme_coefficients_on_traced_rounds(tmp_path, quad_file, run_experiment, scheme, expected):
    _, _, path = quad(quad_file)
    traces = constant_traces(tmp_path, [1.0, 0.5, 0.25, 1.0])
    log = run_quad(run_experiment, path, **{"participation.mode": "trace", "participation.trace": traces,
                                            "participation.scheme": scheme})
    assert log["participation/steps"][0].tolist() == [8, 4, 2, 8]
    np.testing.assert_allclose(log["participation/coeff"], np.tile(expected, (3, 1)), rtol=1e-15)


def test_scheme_a_with_no_complete_device_changes_nothing(tmp_path, quad_file, run_experiment):
    _, _, path = quad(quad_file)
    traces = constant_traces(tmp_path, [0.5, 0.0, 0.25, 0.75])
    for scheme in ("A", "C"):
        log = run_quad(run_experiment, path, **{"participation.mode": "trace", "participation.trace": traces,
                                                "participation.scheme": scheme})
        if scheme == "A":
            assert np.all(log["trajectory/x"] == 0) and log["metrics/n_applied"].tolist() == [0, 0, 0]
            assert not log["participation/coeff"].any()
        else:  # C: s_k = 0 weighs 0, the others K / s_k
            assert log["participation/coeff"][0].tolist() == [0.25 * 2, 0.0, 0.25 * 4, 0.25 * 8 / 6]
            assert log["metrics/n_applied"].tolist() == [3, 3, 3]


def test_scheme_c_reaches_the_optimum_where_b_is_biased(tmp_path, quad_file, run_experiment):
    """Devices completing 100/50/25/75 % of K = 8 steps every round, exact gradients, staircase lr 0.2/r.

    Scheme B weighs device k by its steps, so it converges to the optimum of sum_k s_k f_k; Scheme C
    rescales by K/s_k and converges to the optimum of (1/N) sum_k f_k. What remains of C's error after R
    rounds is the client drift of K local steps, O(lr_R) = O(0.2/400): measured 1.7e-3 at R = 400 (4e-4 at
    R = 2000), so 0.01 is a safe bound; B stays at distance 0.79.
    """
    A, b, path = quad(quad_file)
    fractions = np.array([1.0, 0.5, 0.25, 0.75])
    traces = constant_traces(tmp_path, fractions)
    optimum = (A * b).sum(axis=0) / A.sum(axis=0)
    biased = (A * b * fractions[:, None]).sum(axis=0) / (A * fractions[:, None]).sum(axis=0)
    final = {}
    for scheme in ("B", "C"):
        log = run_quad(run_experiment, path, **{"participation.mode": "trace", "participation.trace": traces,
                                                "participation.scheme": scheme, "rounds": 400,
                                                "train.lr_local": 0.2, "train.lr_schedule": "staircase",
                                                "log.every": 100})
        final[scheme] = log["trajectory/x"][-1]
    assert np.linalg.norm(final["C"] - optimum) < 0.01
    assert np.linalg.norm(final["B"] - optimum) > 0.5
    assert np.linalg.norm(final["B"] - biased) < 0.01


def test_sampled_traces_draw_from_the_assigned_trace(tmp_path):
    file = read_trace_file(BUILTIN)
    assert file.names[:5] == ("cpu0", "cpu30", "cpu50", "cpu70", "cpu90") and len(file.names) == 8
    assert "trace record" in file.meta["command"]
    traces = sampled_traces("builtin:2", seed=3, n_devices=40)
    assert set(traces.assignment) == {0, 1}  # the first two traces only
    budgets = np.full(40, 100)
    steps = traces.steps(3, 7, np.arange(40), budgets)
    for k in range(40):
        allowed = np.floor(file.fractions[traces.assignment[k]] * 100 + 0.5)
        assert steps[k] in allowed
    assert np.array_equal(steps, traces.steps(3, 7, np.arange(40), budgets))  # a pure function of the stream
    explicit = sampled_traces(("cpu90", "bw-low"), seed=0, n_devices=5)
    assert explicit.assignment.tolist() == [0, 1, 0, 1, 0] and explicit.names == ("cpu90", "bw-low")
    with pytest.raises(ConfigError, match="give how many of its 8 traces"):
        sampled_traces("builtin:9", 0, 4)
    with pytest.raises(ConfigError, match="has only cpu0"):
        sampled_traces(("cpu99",), 0, 4)


def test_replay_gives_the_same_participation_to_every_scheme(tmp_path, run_experiment):
    common = {"rounds": 8, "data.clients": 8, "train.clients_per_round": 5, "train.local_steps": 10,
              "participation.mode": "trace", "participation.trace": "builtin", "log.eval_every": 100}
    recorded = run_experiment(common, name="recorded.h5")
    again = run_experiment({**common, "participation.trace": str(tmp_path / "recorded.h5")})
    assert again["trajectory/x"].tobytes() == recorded["trajectory/x"].tobytes()
    other = run_experiment({**common, "participation.trace": str(tmp_path / "recorded.h5"),
                            "participation.scheme": "C"})
    assert np.array_equal(other["participation/steps"], recorded["participation/steps"])
    assert np.array_equal(other["participation/selected"], recorded["participation/selected"])
    assert other["trajectory/x"].tobytes() != recorded["trajectory/x"].tobytes()
    for override, message in (({"data.clients": 9}, "has 8 devices but this run has 9"),
                              ({"rounds": 9}, "holds 8 rounds but this run needs 9"),
                              ({"train.local_steps": 11}, "this run's budget is 11")):
        with pytest.raises(ConfigError, match=message):
            run_experiment({**common, "participation.trace": str(tmp_path / "recorded.h5"), **override})


def test_membership_learning_rate_restart_and_boost(run_experiment):
    log = run_experiment({
        "rounds": 12, "data.clients": 6, "train.clients_per_round": "all", "train.local_steps": 5,
        "train.lr_schedule": "staircase", "train.lr_local": 0.6, "train.weighting": "count_global",
        "dynamics.fast_reboot": True, "log.eval_every": 100,
    } | {"dynamics.arrive": [{"device": 2, "round": 4}],
         "dynamics.depart": [{"device": 4, "round": 7, "policy": "exclude"},
                             {"device": 5, "round": 9, "policy": "include"}]})
    active, selected = log["participation/active"], log["participation/selected"]
    assert not active[:3, 2].any() and active[3:, 2].all()  # arrives in round 4
    assert active[:6, 4].all() and not active[6:, 4].any()  # excluded from round 7
    assert active[:, 5].all()  # included: stays in the objective ...
    assert np.all(log["participation/steps"][8:, 5] == 0)  # ... but never reports from round 9
    assert not (selected & ~active).any()
    # staircase restarts at eta_0 after each objective shift (rounds 4 and 7), not at the include-departure
    shift = np.array([0, 0, 0, 3, 3, 3, 6, 6, 6, 6, 6, 6])
    np.testing.assert_allclose(log["metrics/lr"], 0.6 / (np.arange(1, 13) - shift), rtol=1e-15)
    n = log["devices/n_train"].astype(float)
    for r in (4, 5, 6):  # rounds 4..6: devices 0..5 active; device 2's weight boosted by 1 + 2 / (r - 3)^2
        w = n[2] / n[active[r - 1]].sum()
        assert log["participation/coeff"][r - 1, 2] == pytest.approx(w * (1 + 2 / (r - 3) ** 2), rel=1e-12)
    w_other = n[0] / n[active[7]].sum()
    assert log["participation/coeff"][7, 0] == pytest.approx(w_other, rel=1e-12)


def test_a_board_away_silences_its_devices_and_fast_reboot_boosts_their_return(tmp_path, run_experiment):
    """[[mpi.away]] (what edgefed launch writes): devices 1 and 3 away in rounds 3..5 (back in round 6), in the
    objective all along; with fast-reboot their coefficients from round 6 are the run's without it times
    1 + (b - 1) / (r - 6 + 1)^2 (b = 3), every other one the same; the config resumes and validates."""
    base = {"rounds": 8, "data.clients": 4, "train.clients_per_round": "all", "train.local_steps": 4,
            "log.eval_every": 100, "mpi.away": [{"devices": [1, 3], "round": 3, "back": 6}]}
    plain = run_experiment(base)
    boosted = run_experiment({**base, "dynamics.fast_reboot": True}, "boosted.h5")
    steps, active = boosted["participation/steps"], boosted["participation/active"]
    assert active.all() and boosted["participation/selected"].all()  # no objective shift
    assert (steps[2:5][:, [1, 3]] == 0).all() and (steps[2:5][:, [0, 2]] == 4).all() and (steps[5:] == 4).all()
    assert (steps[:2] == 4).all()
    absent = plain["participation/coeff"] == 0  # nothing applied: logged as 0
    assert (absent == (steps == 0)).all() and (boosted["participation/coeff"][absent] == 0).all()
    ratio = boosted["participation/coeff"] / np.where(absent, 1, plain["participation/coeff"])
    expected = np.where(absent, 0.0, 1.0)
    for r in range(6, 9):
        expected[r - 1, [1, 3]] = 1 + 2 / (r - 6 + 1) ** 2
    np.testing.assert_allclose(ratio, expected, rtol=1e-12)
    said = [line for line in summary_lines(Run.read(tmp_path / "boosted.h5")) if line.startswith("devices away")]
    assert said == ["devices away with their board: 2 (1, 3) rounds 3..5, back in round 6"]
    # a replay of the log silences and boosts as it ran (the log keeps its boards away), to the byte
    replay = run_experiment({**base, "mpi.away": [], "dynamics.fast_reboot": True, "participation.mode": "trace",
                             "participation.trace": str(tmp_path / "boosted.h5")})
    for name in ("participation/coeff", "participation/steps", "trajectory/x"):
        assert replay[name].tobytes() == boosted[name].tobytes(), name
    # still away (no back yet): silent to the end; and the key is checked
    open_ended = run_experiment({**base, "mpi.away": [{"devices": [2], "round": 7}]})
    assert (open_ended["participation/steps"][6:, 2] == 0).all() and (open_ended["participation/steps"][:6] == 4).all()
    for away, message in (([{"devices": [4], "round": 2}], r"mpi.away\[0\].devices holds 4, not a device id"),
                          ([{"devices": [1], "round": 3, "back": 3}], r"mpi.away\[0\].back = 3 must come after"),
                          ([{"devices": [1], "round": 2}, {"devices": [1], "round": 5, "back": 6}],
                           r"mpi.away\[1\]: device 1 is already away then \(mpi.away\[0\]\)")):
        with pytest.raises(ConfigError, match=message):
            config_with({**base, "mpi.away": away})


@pytest.mark.parametrize("selection", ["all", 3])
def test_scaffold_invariant_holds_across_shifts(tmp_path, run_experiment, selection):
    overrides = {
        "rounds": 10, "data.clients": 6, "train.clients_per_round": selection, "train.algorithm": "scaffold",
        "model.dtype": "float64", "scaffold.init": "gradient", "log.client_controls": True, "log.eval_every": 100,
        "dynamics.arrive": [{"device": 1, "round": 3}], "dynamics.depart": [{"device": 3, "round": 6}]}
    log = run_experiment(overrides)
    active = np.vstack([log["participation/active"][:1], log["participation/active"]])  # row 0: the start
    active[0, 1] = False
    if selection == "all":
        assert log["participation/selected"][2, 1] and log["participation/steps"][2, 1] > 0  # reports on arrival
    for r in range(11):
        members = log["scaffold/c_clients"][r][active[r]]
        np.testing.assert_allclose(log["scaffold/c"][r], members.mean(axis=0), rtol=1e-12, atol=1e-14)
    assert not np.array_equal(log["scaffold/c_clients"][2, 1], log["scaffold/c_clients"][3, 1])  # fresh control
    # and a run stopped in the arrival round resumes to the same log
    whole, resumed = interrupted_then_resumed(config_with(overrides), tmp_path, 3)
    assert_same_logs(whole, resumed)


def test_dynamics_validation():
    with pytest.raises(ConfigError, match="departs in round 3, not after it arrives"):
        config_mod.config_from_dict({"dynamics": {"arrive": [{"device": 1, "round": 5}],
                                                  "depart": [{"device": 1, "round": 3}]}})
    with pytest.raises(ConfigError, match="policy = 'keep' is not known"):
        config_mod.config_from_dict({"dynamics": {"depart": [{"device": 1, "round": 3, "policy": "keep"}]}})
    none = Dynamics(config_mod.DynamicsConfig(), 3).at(50)
    assert none.active.all() and none.shift_round == 0 and none.boost(np.arange(3)).tolist() == [1, 1, 1]
    # a round's membership by hand: device 1 arrives in round 3 (fast-reboot, b = 3), device 2 departs in round
    # 4 but stays in the objective, silent
    dyn = Dynamics(config_mod.config_from_dict({"dynamics": {
        "fast_reboot": True, "arrive": [{"device": 1, "round": 3}],
        "depart": [{"device": 2, "round": 4, "policy": "include"}]}}).dynamics, 3)
    at3, at4 = dyn.at(3), dyn.at(4)
    assert at3.shifts and at3.arriving.tolist() == [1] and at3.shift_round == 2 and not dyn.at(2).active[1]
    assert at3.boost(np.array([2, 1])).tolist() == [1.0, 3.0]  # 1 + (b - 1) / (3 - 3 + 1)^2
    assert at4.boost(np.array([1])).tolist() == [1.5] and not at4.shifts and at4.arriving.size == 0
    assert at4.active.tolist() == [True, True, True] and at4.silent.tolist() == [False, False, True]
    # computed once between changes (what a large federation's round must not redo over N), anew at each
    assert dyn.at(5).active is dyn.at(9).active and dyn.at(5).silent is dyn.at(9).silent
    assert dyn.at(2).active is not dyn.at(3).active and dyn.at(3).silent is not dyn.at(4).silent
    assert dyn.at(2).active.tolist() == [True, False, True] and dyn.at(9).silent.tolist() == [False, False, True]
    federation = schemes.Federation(dyn.at(2).active, np.array([5, 7, 11]))
    assert federation.ids.tolist() == [0, 2] and federation.samples == 16 and federation.absent.tolist() == [1]
    assert schemes.objective_weights("count_global", federation, np.array([5, 7, 11]), np.array([2])).tolist() == [11 / 16]


def test_trace_record_and_show(tmp_path):
    out = tmp_path / "t.csv"
    done = subprocess.run([sys.executable, "-m", "edgefed", "trace", "record", "--out", str(out), "--names",
                           "free,busy,lossy", "--contention", "0,0.9,0", "--drop", "0,0,1", "--rounds", "12",
                           "--local-steps", "8000", "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    file = read_trace_file(out)
    assert file.names == ("free", "busy", "lossy") and file.fractions[0].size == 12
    # the deadline binds for both (8,000 steps take ~20 ms on a free core: two of the competitor's 10 ms duty
    # cycles, where 2,000 could fall in its idle part); a 90 % competitor costs most of them
    assert file.fractions[1].mean() < 0.85 * file.fractions[0].mean()
    assert not file.fractions[2].any()  # every upload lost: inactive in every round
    assert "free" in done.stdout and "inactive" in done.stdout
    shown = subprocess.run([sys.executable, "-m", "edgefed", "trace", "show", "builtin"], capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0 and "cpu90" in shown.stdout and "bw-low" in shown.stdout
    bad = subprocess.run([sys.executable, "-m", "edgefed", "trace", "show", str(tmp_path / "none.csv")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not found" in bad.stderr


def test_replay_keeps_devices_outside_the_federation_out(tmp_path, run_experiment):
    common = {"rounds": 6, "data.clients": 6, "train.clients_per_round": "all", "train.local_steps": 5,
              "log.eval_every": 100}
    run_experiment(common, name="recorded.h5")
    log = run_experiment({**common, "participation.mode": "trace", "participation.trace": str(tmp_path / "recorded.h5"),
                          "dynamics.arrive": [{"device": 2, "round": 4}]})
    assert not log["participation/selected"][:3, 2].any() and log["participation/selected"][3:, 2].all()
    np.testing.assert_allclose(log["participation/coeff"].sum(axis=1), 1.0)


def test_dynamics_device_ids_are_checked_against_the_problem_files_n(quad_file):
    path = quad_file(np.ones((3, 2)), np.zeros((3, 2)))
    cfg = config_mod.load_config(None, ['data.kind="quadratic"', f'data.path="{path}"',
                                        'train.clients_per_round="all"', "dynamics.arrive=[{device = 5, round = 2}]"])
    with pytest.raises(ConfigError, match=r"dynamics.arrive\[0\].device = 5 is not a device id"):
        runs.run(cfg, path.parent / "r.h5")
