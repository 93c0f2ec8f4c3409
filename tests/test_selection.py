"""Client selection (docs/design.md 2.18): each policy's arithmetic by hand and against a NumPy reference,
then through the engine: determinism, resume, replay, loopback ranks, mpiexec, and the refusals."""

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest

from edgefed.config.schema import SelectionConfig
from edgefed.errors import ConfigError
from edgefed.orchestration import run as runs
from edgefed.participation.selection import FedCS, Feedback, Oort, PowerOfChoice, View, draw_candidates
from edgefed.runlog import read_run
from conftest import config_with
from helpers import assert_same_logs, interrupted_then_resumed
from test_clock import board, simulated  # noqa: F401 - the board fixture
from test_mpi import MPIEXEC, simulator_then_ranks
from test_protocol import loopback_run

OORT = SelectionConfig(policy="oort")  # the paper's defaults


def view(members, count, seconds, work=None, window=None, **extra):
    n = len(seconds)
    seconds = np.asarray(seconds, float)
    return View(1, np.asarray(members), count, np.full(len(members), 1.0 / len(members)), seconds,
                seconds if work is None else np.asarray(work, float), np.full(n, 20), np.full(n, 5),
                window=(lambda ids: np.full(ids.size, np.nan)) if window is None else window, **extra)


# -- FedCS ----------------------------------------------------------------------------------------------------
def test_fedcs_takes_the_fastest_whose_work_fits_up_to_s():
    # predicted rounds (work + links) and windows by hand: devices 1 and 4 do not fit; 5 is unknown (tried first)
    seconds = [0.3, 0.9, 0.2, 0.5, 0.4, np.nan, 0.1]
    work = [0.25, 0.85, 0.15, 0.45, 0.38, np.nan, 0.05]
    windows = np.array([0.3, 0.3, 0.3, 0.5, 0.3, 0.3, 0.3])
    policy = FedCS(0, SimpleNamespace(candidates=None), np.full(7, 100), 5)
    choice = policy.select(view(np.arange(7), 4, seconds, work, lambda ids: windows[ids]))
    # order of increase: 5 (unknown: 0), 6 (0.1), 2 (0.2), 0 (0.3), 4 (0.4, does not fit), 3 (0.5)
    assert choice.selected.tolist() == [0, 2, 5, 6]
    np.testing.assert_array_equal(choice.candidates, np.arange(7))
    np.testing.assert_array_equal(choice.utility, seconds)
    assert sorted(choice.deadline_among.tolist()) == list(range(7))  # an adaptive deadline is set among those asked
    # nothing fits: the fastest still works, so the round is not empty
    none = policy.select(view(np.arange(7), 4, seconds, work, lambda ids: np.zeros(ids.size)))
    assert none.selected.tolist() == [5]
    secure = policy.select(dataclasses.replace(view(np.arange(7), 4, seconds, work, lambda ids: np.zeros(ids.size)),
                                               least=2))
    assert secure.selected.tolist() == [5, 6]  # secure aggregation needs two to hide one


def test_fedcs_candidates_are_a_uniform_draw_of_the_asked_count():
    policy = FedCS(3, SimpleNamespace(candidates=4), np.full(10, 100), 5)
    a = policy.select(view(np.arange(10), 2, np.arange(10) / 10.0))
    b = policy.select(view(np.arange(10), 2, np.arange(10) / 10.0))
    assert a.candidates.size == 4 and np.array_equal(a.candidates, b.candidates)
    assert a.selected.tolist() == a.candidates[:2].tolist()  # the two fastest of those asked


# -- power of choice ------------------------------------------------------------------------------------------
def test_power_of_choice_takes_the_highest_losses_of_candidates_drawn_by_weight():
    losses = np.array([0.1, 2.0, 0.5, 3.0, 1.0, 0.7, 2.5, 0.2])
    asked = []

    def probe(ids):
        asked.append(ids.copy())
        return losses[ids]

    members = np.arange(8)
    weights = np.array([1, 1, 1, 1, 1, 1, 1, 9], float) / 16
    v = View(4, members, 2, weights, np.zeros(8), np.zeros(8), np.full(8, 20), losses=probe)
    choice = PowerOfChoice(7, SimpleNamespace(candidates=5), np.full(8, 100), 5).select(v)
    drawn = draw_candidates(7, 4, members, 5, weights / weights.sum())
    assert sorted(asked[0].tolist()) == sorted(drawn.tolist()) == choice.candidates.tolist()
    top = sorted(drawn.tolist(), key=lambda k: -losses[k])[:2]
    assert choice.selected.tolist() == sorted(top)
    np.testing.assert_array_equal(choice.utility, losses[choice.candidates])
    # the draw follows the weights: device 7 (weight 9/16) is among 5 of 8 in nearly every round
    hits = sum(7 in draw_candidates(7, r, members, 5, weights / weights.sum()) for r in range(1, 201))
    assert hits > 190


# -- Oort -----------------------------------------------------------------------------------------------------
def oort_reference(reward, last, sizes, seconds, r, preferred, alpha):
    """Lai et al.'s scores as the reference selector computes them, written out independently."""
    explored = ~np.isnan(reward)
    pool = [reward[k] if explored[k] else sizes[k] for k in range(reward.size)]
    positive = sorted(v for v in pool if v > 0)
    clip = positive[min(int(len(positive) * 0.98), len(positive) - 1)]
    low, high = positive[0] * 0.999, positive[-1]
    span = max(high - low, 1e-4)
    out = []
    for k in range(reward.size):
        if explored[k]:
            sc = (min(reward[k], clip) - low) / span + math.sqrt(0.1 * math.log(r) / last[k])
        else:
            sc = float(sizes[k])
        if np.isfinite(seconds[k]) and seconds[k] > preferred:
            sc *= (preferred / seconds[k]) ** alpha
        out.append(abs(sc))
    return np.array(out)


def test_oort_scores_penalty_and_staleness_match_a_reference():
    g = np.random.default_rng(1)
    n = 12
    policy = Oort(0, OORT, np.full(n, 100), 50)
    policy.reward = np.where(g.random(n) < 0.7, g.uniform(1, 80, n), np.nan)
    policy.last = g.integers(1, 9, n)
    sizes, seconds = g.integers(20, 100, n).astype(float), g.uniform(1, 4, n)
    seconds[3] = np.nan
    explored, scores = policy.scores(9, np.arange(n), seconds, sizes, 2.0)
    np.testing.assert_array_equal(explored, ~np.isnan(policy.reward))
    np.testing.assert_allclose(scores, oort_reference(policy.reward, policy.last, sizes, seconds, 9, 2.0, 2.0),
                               rtol=1e-12)


def test_oort_utility_is_samples_times_root_mean_square_loss_and_stragglers_get_the_mean():
    policy = Oort(0, OORT, np.array([100, 30, 50, 40]), 10)
    fb = Feedback(3, np.array([0, 1, 2, 3]), np.array([True, True, False, True]),
                  np.array([80.0, 45.0, 9.0, 0.0]), np.array([40, 60, 10, 0]))
    policy.observe(fb)
    u0, u1 = 40 * math.sqrt(80 / 40), 30 * math.sqrt(45 / 60)  # |B| = min(n_k, samples)
    np.testing.assert_allclose(policy.reward, [u0, u1, (u0 + u1) / 2, (u0 + u1) / 2])
    assert policy.last.tolist() == [3, 3, 3, 3] and policy.history[3] == pytest.approx(u0 + u1)


def test_oort_explores_a_decaying_share_and_its_pacer_relaxes_t():
    n, count = 40, 10
    policy = Oort(5, OORT, np.full(n, 50), 100)
    members, seconds = np.arange(n), np.linspace(1.0, 3.0, n)
    v = view(members, count, seconds)
    first = policy.select(v)  # nobody explored: all ten explore, T the median predicted round
    assert first.selected.size == count and policy.scalars[1] == pytest.approx(np.median(seconds))
    assert policy.scalars[0] == pytest.approx(0.9 * 0.98)
    policy.reward[:20] = np.arange(20.0)
    policy.last[:20] = 1
    second = policy.select(View(2, members, count, v.weights, seconds, seconds, v.sizes))
    eps = 0.9 * 0.98 * 0.98
    assert np.isin(second.selected, np.arange(20)).sum() >= int(count * (1 - eps))
    # the pacer: once 2W rounds ran, every W rounds, T grows by its step when the last W rounds' utility fell
    t = policy.scalars[1]
    policy.history[1:21], policy.history[21:41] = 5.0, 1.0
    policy.select(View(40, members, count, v.weights, seconds, seconds, v.sizes))
    assert policy.scalars[1] == t  # round 40: only 39 have run
    policy.select(View(41, members, count, v.weights, seconds, seconds, v.sizes))
    assert policy.scalars[1] == pytest.approx(t + t / 10)
    policy.history[41:61] = 9.0
    policy.select(View(61, members, count, v.weights, seconds, seconds, v.sizes))
    assert policy.scalars[1] == pytest.approx(t + t / 10)  # utility rose: T stays


# -- the report field: what the steps saw of their losses -------------------------------------------------------
def test_the_steps_report_their_squared_sample_losses():
    from edgefed.models import Quadratic
    from edgefed.problems.data import ClassificationData, QuadraticData
    from edgefed.rng import Purpose, kernel_state
    from helpers import logreg_model

    g = np.random.default_rng(2)
    X, y = g.normal(size=(6, 4)), g.integers(0, 3, 6)
    model = logreg_model(4, 3, np.float64)
    x = g.normal(size=model.n_trainable)
    data = ClassificationData(X, y, X[:0], y[:0])
    run = model.begin(data, kernel_state(0, Purpose.LOCAL, 1, 0))
    W, b = x[:12].reshape(4, 3), x[12:]  # the layer's (in, out) weights, then its bias
    logits = X @ W + b
    losses = np.log(np.exp(logits).sum(axis=1)) - logits[np.arange(6), y]
    model.local_steps(x.copy(), data, run, 1, None, 0.1)  # one full-batch step: the losses at x
    assert run.samples == 6 and run.loss_sq == pytest.approx(float(np.sum(losses ** 2)), rel=1e-12)

    a, c, x0 = np.array([1.0, 2.0]), np.array([0.5, -1.0]), np.array([2.0, 1.0])
    quad = Quadratic(2, x0, np.float64)
    qrun = quad.begin(QuadraticData(a, c, 0.0), kernel_state(0, Purpose.LOCAL, 1, 0))
    quad.local_steps(x0.copy(), QuadraticData(a, c, 0.0), qrun, 2, None, 0.25)
    x1 = x0 - 0.25 * a * (x0 - c)
    f = [0.5 * np.sum(a * (v - c) ** 2) for v in (x0, x1)]  # each step's "sample": f at its start
    assert qrun.samples == 2 and qrun.loss_sq == pytest.approx(f[0] ** 2 + f[1] ** 2, rel=1e-12)


# -- through the engine ---------------------------------------------------------------------------------------
SMALL = {"rounds": 4, "data.clients": 8, "data.samples": 60, "train.clients_per_round": 3, "train.local_steps": 5}


def fedcs_config(board, **extra):
    return config_with({**SMALL, "device.profile": board, "device.speed": [1.0, 0.5, 0.25, 1.0, 0.2, 2.0, 1.0, 0.5],
                        "participation.mode": "deadline", "participation.deadline_s": 0.012,
                        "participation.clock": "simulated", "selection.policy": "fedcs", **extra})


def test_fedcs_on_a_simulated_clock_selects_what_fits_and_logs_its_forecast(tmp_path, board):
    # a step takes 1 ms / speed, links 2 ms: K = 5 steps fit 12 ms of compute at speed >= 0.5
    runs.run(fedcs_config(board), tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    speed = np.array([1.0, 0.5, 0.25, 1.0, 0.2, 2.0, 1.0, 0.5])
    predicted = 5 * 0.001 / speed + 0.002
    asked = log["participation/candidate"]
    assert (asked.sum(axis=1) == 6).all()  # 2S drawn
    np.testing.assert_allclose(log["participation/utility"][asked], np.tile(predicted, (4, 1))[asked], rtol=1e-6)
    fits = speed >= 0.5  # 5 steps of 1 ms / speed within the 12 ms deadline
    for row, cand in zip(log["participation/selected"], asked):
        fitting = np.flatnonzero(cand & fits)
        assert row.sum() == min(3, fitting.size) and not (row & ~(cand & fits)).any()
        # the fastest first: no fitting candidate left out is faster than one taken
        assert predicted[fitting[~row[fitting]]].min(initial=np.inf) >= predicted[row].max()
    assert (log["participation/steps"][log["participation/selected"]] == 5).all()


def test_power_of_choice_counts_its_question_in_bytes_and_clock(tmp_path, board):
    cfg = config_with({**SMALL, "device.profile": board, "selection.policy": "power_of_choice",
                       "selection.candidates": 5})
    runs.run(cfg, tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    asked, sel = log["participation/candidate"], log["participation/selected"]
    assert (asked.sum(axis=1) == 5).all() and (sel <= asked).all()
    assert (log["participation/bytes_up"][asked & ~sel] == 8).all()
    down = log["participation/bytes_down"]  # x to each candidate; the round's broadcast besides to the selected
    assert (down[asked & ~sel] == 2440).all() and (down[sel] == 2 * 2440).all()
    for r in range(4):  # the selected hold the three highest losses of the candidates
        u = log["participation/utility"][r]
        assert np.sort(u[sel[r]]).tolist() == np.sort(u[asked[r]])[-3:].tolist()
    # the question's time: the slowest candidate's links plus a third of a step per batch of its data
    n = log["devices/n_train"]
    round1 = log["metrics/clock_s"][1]
    probe = max(0.002 + math.ceil(n[k] / 20) * 0.001 / 3 for k in np.flatnonzero(asked[0]))
    assert round1 == pytest.approx(probe + 5 * 0.001 + 0.002)
    # the summary says who took part: Jain's index of the selection counts, by hand
    from edgefed.analysis.logs import Run
    from edgefed.analysis.summary import summary_lines

    c = sel.sum(axis=0).astype(float)
    line = next(x for x in summary_lines(Run.read(tmp_path / "r.h5")) if x.startswith("selection:"))
    assert line.startswith(f"selection: power_of_choice; Jain's index of the devices' participation "
                           f"{c.sum() ** 2 / (8 * (c ** 2).sum()):.3f}")
    assert f"{int((c == 0).sum())} of 8 devices never selected" in line


def test_over_selection_asks_a_policy_for_more_and_takes_the_first_to_finish(tmp_path, board):
    cfg = config_with({**SMALL, "device.profile": board, "device.speed": [1.0, 0.5, 0.25, 1.0, 0.2, 2.0, 1.0, 0.5],
                       "participation.overselect": 0.5, "selection.policy": "oort"})
    runs.run(cfg, tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    sel, late = log["participation/selected"], log["participation/late"]
    assert (sel.sum(axis=1) == 5).all()  # ceil(1.5 x 3)
    assert ((sel & ~late).sum(axis=1) == 3).all() and log["participation/candidate"].all()


def test_power_of_choice_does_not_hear_from_a_device_that_left(tmp_path):
    cfg = config_with({**SMALL, "rounds": 5, "selection.policy": "power_of_choice", "selection.candidates": 7,
                       "dynamics.depart": [{"device": 2, "round": 3, "policy": "include"}]})
    runs.run(cfg, tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    gone = slice(2, None)  # rounds 3..5: device 2 is silent, so it answers nothing and is never taken
    assert log["participation/candidate"][gone, 2].any()
    asked = log["participation/candidate"][gone, 2]
    assert np.isnan(log["participation/utility"][gone, 2][asked]).all()
    assert not log["participation/selected"][gone, 2].any() and (log["participation/bytes_up"][gone, 2] == 0).all()


@pytest.mark.parametrize("policy", ["oort", "power_of_choice"])
def test_a_policy_run_repeats_resumes_and_runs_on_ranks_to_the_byte(tmp_path, board, policy):
    cfg = config_with({**SMALL, "rounds": 6, "device.profile": board, "selection.policy": policy,
                       "device.speed": [1.0, 0.5, 0.25, 1.0, 0.2, 2.0, 1.0, 0.5], "participation.clock": "simulated"})
    whole, resumed = interrupted_then_resumed(cfg, tmp_path, 3)
    assert_same_logs(whole, resumed)
    assert_same_logs(whole, loopback_run(cfg, tmp_path / "mpi.h5", 3))
    if policy == "oort":
        assert np.isfinite(whole["state/oort_reward"]).any() and (whole["state/oort_last"] > 0).any()


def test_fedcs_through_loopback_ranks_and_a_replay_takes_the_logged_selection(tmp_path, board):
    cfg = fedcs_config(board, **{"participation.deadline_s": "adaptive"})
    runs.run(cfg, tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    assert_same_logs(log, loopback_run(cfg, tmp_path / "mpi.h5", 3))
    replay = fedcs_config(board, **{"participation.mode": "trace", "participation.trace": str(tmp_path / "r.h5"),
                                    "participation.deadline_s": None})
    runs.run(replay, tmp_path / "replay.h5")
    again = read_run(tmp_path / "replay.h5")
    for name in ("participation/selected", "participation/steps", "participation/candidate",
                 "participation/utility", "trajectory/x"):
        assert again[name].tobytes() == log[name].tobytes(), name


ASYNC = {"rounds": 8, "data.clients": 8, "data.samples": 60, "train.local_steps": 5, "participation.mode": "async",
         "train.clients_per_round": "all",
         "async.concurrency": 3, "async.buffer": 2, "participation.clock": "simulated",
         "device.speed": [1.0, 0.5, 0.25, 1.0, 0.2, 2.0, 1.0, 0.5]}


@pytest.mark.parametrize("policy", ["oort", "power_of_choice", "fedcs"])
def test_fedbuffs_idle_draw_uses_the_policy_repeats_and_resumes_to_the_byte(tmp_path, board, policy):
    extra = {"participation.deadline_s": 0.012} if policy == "fedcs" else {}
    cfg = config_with({**ASYNC, "device.profile": board, "selection.policy": policy, **extra})
    whole, resumed = interrupted_then_resumed(cfg, tmp_path, 4)
    assert_same_logs(whole, resumed)  # the tasks in flight and the policy's state came back from the log
    asked = whole["participation/candidate"]
    assert asked.any(axis=1).all() and whole["state/async_counters"][0][1] > 0
    uniform = config_with({**ASYNC, "device.profile": board, **extra})
    runs.run(uniform, tmp_path / "u.h5")
    assert read_run(tmp_path / "u.h5")["participation/selected"].tobytes() != whole["participation/selected"].tobytes()
    if policy == "power_of_choice":  # each draw asks 2 idle devices (2S, S = 1) for their loss: x down, 8 bytes up
        down, sel = whole["participation/bytes_down"], whole["participation/selected"]
        assert (down[asked & ~sel] % 2440 == 0).all() and (down[asked & ~sel] > 0).all()


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'edgefed[mpi]'")
def test_power_of_choice_under_mpiexec_writes_the_simulators_bytes(tmp_path):
    text = ('rounds = 4\n[data]\nclients = 7\nsamples = 60\n[train]\nclients_per_round = 3\nlocal_steps = 5\n'
            '[selection]\npolicy = "power_of_choice"\ncandidates = 5\n')
    sim, mpi = simulator_then_ranks(tmp_path, text)
    for name in ("participation/selected", "participation/candidate", "participation/utility", "trajectory/x",
                 "participation/bytes_up"):
        assert sim[name].tobytes() == mpi[name].tobytes(), name


# -- refusals -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,message", [
    ({"selection.policy": "oortt"}, "selection.policy = 'oortt' is not known; did you mean 'oort'?"),
    ({"selection.policy": "fedcs", "selection.alpha": 1.0}, "selection.alpha is a parameter of policy 'oort', not of "
                                                            "'fedcs'"),
    ({"selection.policy": "fedcs"}, 'set participation.mode = "deadline"'),
    ({"selection.policy": "power_of_choice", "selection.candidates": 2, "train.clients_per_round": 3},
     "selection.candidates = 2 is fewer than the 3 devices"),
    ({"selection.policy": "power_of_choice", "selection.candidates": 40, "data.clients": 30},
     "selection.candidates = 40 exceeds the 30 devices"),
    ({"selection.policy": "oort", "selection.exploration_decay": 1.5}, "selection.exploration_decay = 1.5 must lie in"),
    ({"selection.policy": "fedcs", "participation.mode": "async"}, 'set participation.mode = "deadline" (or '
                                                                   '"async") and participation.deadline_s'),
    ({"selection.policy": "oort", "secagg.enabled": True}, "reads each device's training loss in the clear"),
    ({"selection.policy": "power_of_choice", "selection.candidates": 4, "train.clients_per_round": 4,
      "participation.overselect": 0.5}, "selection.candidates = 4 is fewer than the 6 devices a round selects"),
])
def test_bad_selection_keys_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        config_with(overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_candidates_beyond_a_files_federation_are_refused(tmp_path, quad_file):
    g = np.random.default_rng(0)
    path = quad_file(g.uniform(0.5, 2, (4, 3)), g.normal(size=(4, 3)))
    cfg = config_with({"data.kind": "quadratic", "data.path": str(path), "train.clients_per_round": 2,
                       "selection.policy": "power_of_choice", "selection.candidates": 6})
    with pytest.raises(ConfigError, match=r"selection.candidates = 6 must lie between the 2 devices a round selects "
                                          r"\(with over-selection's\) and the 4 of the federation; ask at most 4"):
        runs.run(cfg, tmp_path / "r.h5")
    assert not (tmp_path / "r.h5").exists()
