"""SCAFFOLD against its paper's algorithm on quadratics, its invariant, option I vs II, controls in the log and on resume."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefed import config as config_mod
from edgefed.orchestration import run as runs
from edgefed.orchestration import budget
from edgefed.orchestration.header import log_layout
from edgefed.algorithms import scaffold
from edgefed.algorithms.base import LocalTask
from edgefed.algorithms.scaffold import Scaffold
from edgefed.errors import ResourceError
from edgefed.models import Quadratic
from edgefed.problems import QuadraticData
from edgefed.rng import kernel_state
from edgefed.runlog import read_run
from edgefed.runtime.deadline import run_all
from helpers import assert_same_logs, interrupted_then_resumed, problem_of
from naive import scaffold_quadratic


def het_quadratic(quad_file, N=10, d=5, seed=0):
    g = np.random.default_rng(seed)
    A, b = g.uniform(0.5, 2.0, (N, d)), g.normal(0.0, 3.0, (N, d))
    return A, b, quad_file(A, b, x0=g.normal(size=d))


def scaffold_run(run_experiment, path, **extra):
    base = {"data.kind": "quadratic", "data.path": str(path), "model.dtype": "float64", "rounds": 8,
            "train.algorithm": "scaffold", "train.clients_per_round": 4, "train.local_steps": 5,
            "train.lr_local": 0.1, "log.client_controls": True, "log.eval_every": 100}
    base.update(extra)
    return run_experiment(base)


def invariant_gap(log):
    """max over stored rounds of |c - mean_k c_k|."""
    return np.abs(log["scaffold/c_clients"].mean(axis=1) - log["scaffold/c"]).max()


@pytest.mark.parametrize("option", ["I", "II"])
@pytest.mark.parametrize("init", ["zero", "gradient"])
def test_server_control_is_the_mean_of_device_controls_every_round(quad_file, run_experiment, option, init):
    _, _, path = het_quadratic(quad_file)
    log = scaffold_run(run_experiment, path, **{"scaffold.option": option, "scaffold.init": init,
                                                "data.noise_std": 0.5, "rounds": 12})
    assert log["scaffold/c"].shape == (13, 5) and log["scaffold/c_clients"].shape == (13, 10, 5)
    assert np.abs(log["scaffold/c"]).max() > 0.01
    assert invariant_gap(log) < 1e-12
    moved = np.any(log["scaffold/c_clients"][1:] != log["scaffold/c_clients"][:-1], axis=2)
    assert np.array_equal(moved, log["participation/selected"])  # only selected devices change control


def test_invariant_holds_for_logistic_regression(run_experiment):
    log = run_experiment({"train.algorithm": "scaffold", "model.dtype": "float64", "rounds": 5,
                          "data.clients": 12, "train.clients_per_round": 4, "log.client_controls": True,
                          "scaffold.option": "I", "scaffold.init": "gradient"})
    assert invariant_gap(log) < 1e-12
    assert log["metrics/test_accuracy"][-1] > log["metrics/test_accuracy"][0]


@pytest.mark.parametrize("option", ["I", "II"])
@pytest.mark.parametrize("init", ["zero", "gradient"])
def test_trajectory_and_controls_follow_seed_002(quad_file, run_experiment, option, init):
    A, b, path = het_quadratic(quad_file, N=6, d=3, seed=2)
    x0 = np.load(path)["x0"]
    log = scaffold_run(run_experiment, path, **{"scaffold.option": option, "scaffold.init": init,
                                                "train.clients_per_round": 3, "train.lr_global": 0.8})
    selections = [np.flatnonzero(row) for row in log["participation/selected"]]
    c0 = np.zeros_like(A) if init == "zero" else A * (x0 - b)
    xs, cs, cks = scaffold_quadratic(A, b, x0, 8, 5, 0.1, 0.8, option, selections, c0)
    np.testing.assert_allclose(log["trajectory/x"], xs, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(log["scaffold/c"], cs, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(log["scaffold/c_clients"], cks, rtol=1e-12, atol=1e-13)


def test_scaffold_reaches_the_exact_optimum_where_fedavg_stalls(quad_file, run_experiment):
    A, b, path = het_quadratic(quad_file)
    optimum = (A * b).sum(axis=0) / A.sum(axis=0)  # argmin of (1/N) sum_k f_k
    common = {"train.clients_per_round": "all", "train.local_steps": 10, "train.weighting": "uniform",
              "rounds": 80, "log.client_controls": False}
    fedavg = scaffold_run(run_experiment, path, **common, **{"train.algorithm": "fedavg"})
    distance = {"fedavg": np.linalg.norm(fedavg["trajectory/x"][-1] - optimum)}
    for option in ("I", "II"):
        log = scaffold_run(run_experiment, path, **common, **{"scaffold.option": option})
        distance[option] = np.linalg.norm(log["trajectory/x"][-1] - optimum)
    assert distance["I"] < 1e-8 and distance["II"] < 1e-8
    assert distance["fedavg"] > 0.1  # client drift: K = 10 local steps pull towards each device's optimum
    stalled = np.linalg.norm(fedavg["trajectory/x"][-10:] - fedavg["trajectory/x"][-1], axis=1).max()
    assert stalled < 1e-9  # and FedAvg has converged there: a biased fixed point, not slow progress


def test_partial_participation_still_reaches_the_optimum(quad_file, run_experiment):
    A, b, path = het_quadratic(quad_file)
    optimum = (A * b).sum(axis=0) / A.sum(axis=0)
    log = scaffold_run(run_experiment, path, **{"train.clients_per_round": 5, "train.local_steps": 10,
                                                "rounds": 250, "log.client_controls": False, "log.every": 50})
    assert np.linalg.norm(log["trajectory/x"][-1] - optimum) < 1e-8


def test_zero_controls_and_one_step_is_fedavg(quad_file, run_experiment):
    _, _, path = het_quadratic(quad_file)
    common = {"train.local_steps": 1, "train.weighting": "uniform", "rounds": 1, "log.client_controls": False}
    a = scaffold_run(run_experiment, path, **common)
    f = scaffold_run(run_experiment, path, **common, **{"train.algorithm": "fedavg"})
    assert a["trajectory/x"].tobytes() == f["trajectory/x"].tobytes()


def test_option_i_and_ii_agree_for_one_local_step_only(quad_file, run_experiment):
    # Option II's c_k+ = c_k - c + (x - y_K)/(K lr) is the mean of g_k over the K local iterates y_0..y_{K-1};
    # option I's is g_k(y_0). With exact gradients they coincide for K = 1 and differ for K > 1.
    A, b, path = het_quadratic(quad_file, N=6, d=3, seed=3)
    common = {"train.clients_per_round": "all", "rounds": 6}
    one = [scaffold_run(run_experiment, path, **common, **{"train.local_steps": 1, "scaffold.option": o})
           for o in ("I", "II")]
    np.testing.assert_allclose(one[0]["trajectory/x"], one[1]["trajectory/x"], rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(one[0]["scaffold/c_clients"], one[1]["scaffold/c_clients"], rtol=1e-12, atol=1e-13)
    many = [scaffold_run(run_experiment, path, **common, **{"scaffold.option": o}) for o in ("I", "II")]
    assert many[0]["trajectory/x"][1].tobytes() == many[1]["trajectory/x"][1].tobytes()  # same c^0 in round 1
    assert np.abs(many[0]["trajectory/x"][2] - many[1]["trajectory/x"][2]).max() > 1e-3
    # Round 1 from zero controls: option II's control is the mean gradient along device k's path.
    x0 = np.load(path)["x0"]
    for k in range(6):
        y, grads = x0.copy(), []
        for _ in range(5):
            grads.append(A[k] * (y - b[k]))
            y = y - 0.1 * grads[-1]
        np.testing.assert_allclose(many[1]["scaffold/c_clients"][1, k], np.mean(grads, axis=0), rtol=1e-12)
        np.testing.assert_allclose(many[0]["scaffold/c_clients"][1, k], A[k] * (x0 - b[k]), rtol=1e-15)


def test_gradient_init_is_the_local_gradient_at_x0(quad_file, run_experiment):
    A, b, path = het_quadratic(quad_file, N=4, d=3)
    x0 = np.load(path)["x0"]
    log = scaffold_run(run_experiment, path, **{"scaffold.init": "gradient", "train.clients_per_round": 2})
    np.testing.assert_array_equal(log["scaffold/c_clients"][0], A * (x0 - b))
    np.testing.assert_allclose(log["scaffold/c"][0], (A * (x0 - b)).mean(axis=0), rtol=1e-15)


def _task(model, data, x, c, c_k, n_steps, lr=0.1):
    """One device's round as the client update sees it: every step, the full gradient, streams of round 1."""
    return LocalTask(x, {"c": c}, {"c_clients": c_k}, n_steps, lr, None, run_all,
                     lambda purpose: model.begin(data, kernel_state(0, purpose, 1, 0)))


def _client_round(option, n_steps, c_k, c):
    data = QuadraticData(np.array([1.0, 2.0]), np.array([3.0, -1.0]), 0.0)
    model = Quadratic(2, np.zeros(2), np.float64)
    x = np.array([0.5, 0.5])
    dx, dc = np.zeros(2), np.zeros(2)
    before = c_k.copy()
    steps = Scaffold(option, control_gradient="full").client_update(
        model, data, _task(model, data, x, c, c_k, n_steps), {"delta_x": dx, "delta_c": dc})
    return steps, x, dx, dc, before


def test_option_ii_uses_the_steps_actually_taken_and_zero_steps_keep_the_control():
    c_k, c = np.array([0.2, -0.1]), np.array([0.05, 0.3])
    steps, x, dx, dc, before = _client_round("II", 3, c_k, c)
    assert steps == 3
    np.testing.assert_allclose(before + dc, before - c + (-dx) / (3 * 0.1), rtol=1e-14)
    np.testing.assert_array_equal(c_k, before)  # applied only once the coordinator accepts the report
    steps, x, dx, dc, before = _client_round("II", 0, c_k, c)
    assert steps == 0 and not dx.any() and not dc.any() and np.array_equal(c_k, before)


def test_correction_has_the_papers_sign():
    # y <- y - lr (g(y) - c_k + c): with g = 0 at the optimum, c_k = 1, c = 0 the step moves up by lr.
    data = QuadraticData(np.array([1.0]), np.array([0.0]), 0.0)
    model = Quadratic(1, np.zeros(1), np.float64)
    dx, dc = np.zeros(1), np.zeros(1)
    Scaffold("II").client_update(model, data, _task(model, data, np.zeros(1), np.zeros(1), np.ones(1), 1),
                                 {"delta_x": dx, "delta_c": dc})
    assert dx[0] == pytest.approx(0.1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 20), st.integers(0, 2**31))
def test_server_control_update_ignores_device_order(n_rep, n_fed, seed):
    g = np.random.default_rng(seed)
    n_fed = max(n_fed, n_rep)
    ids = np.sort(g.choice(n_fed, n_rep, replace=False))
    dcs, c = g.normal(size=(n_rep, 4)), g.normal(size=4)
    perm = g.permutation(n_rep)
    ref = scaffold.server_control_update(c, ids, dcs, n_fed)
    assert scaffold.server_control_update(c, ids[perm], dcs[perm], n_fed).tobytes() == ref.tobytes()
    np.testing.assert_allclose(ref, c + dcs.sum(axis=0) / n_fed, rtol=1e-13, atol=1e-15)


def test_known_slips_are_caught(quad_file, run_experiment, monkeypatch):
    """Sending c_k instead of Delta c_k, or dividing by |S| instead of N, must fail the comparison with the reference."""
    A, b, path = het_quadratic(quad_file, N=6, d=3, seed=2)
    x0 = np.load(path)["x0"]

    def deviation():
        log = scaffold_run(run_experiment, path)
        selections = [np.flatnonzero(row) for row in log["participation/selected"]]
        xs, cs, _ = scaffold_quadratic(A, b, x0, 8, 5, 0.1, 1.0, "II", selections, np.zeros_like(A))
        return max(np.abs(log["trajectory/x"] - xs).max(), np.abs(log["scaffold/c"] - cs).max()), log

    assert deviation()[0] < 1e-12
    honest_update = Scaffold.client_update

    def sends_c_k(self, model, data, task, out):
        steps = honest_update(self, model, data, task, out)
        out["delta_c"][:] = task.own["c_clients"]
        return steps

    monkeypatch.setattr(Scaffold, "client_update", sends_c_k)
    assert deviation()[0] > 1e-3
    monkeypatch.setattr(Scaffold, "client_update", honest_update)
    honest_server = scaffold.server_control_update
    monkeypatch.setattr(scaffold, "server_control_update", lambda c, ids, dcs, n: honest_server(c, ids, dcs, len(ids)))
    gap, log = deviation()
    assert gap > 1e-3 and invariant_gap(log) > 1e-3


def test_interrupted_scaffold_run_resumes_every_control(tmp_path, quad_file):
    _, _, path = het_quadratic(quad_file)
    cfg = config_mod.load_config(None, [
        'data.kind="quadratic"', f'data.path="{path}"', 'train.algorithm="scaffold"', "train.clients_per_round=3",
        'scaffold.option="I"', "data.noise_std=0.3", "rounds=9", "log.every=4", "log.client_controls=true"])
    assert_same_logs(*interrupted_then_resumed(cfg, tmp_path, 6))


def test_a_kill_between_stage_and_commit_rolls_the_controls_back(tmp_path, quad_file, monkeypatch):
    """Round 4 writes its rows and slots, then dies before its marker: resume sees round 3, rows rolled back."""
    from edgefed.runlog import RunLogWriter, read_resume_point

    _, _, path = het_quadratic(quad_file)
    cfg = config_mod.load_config(None, [
        'data.kind="quadratic"', f'data.path="{path}"', 'train.algorithm="scaffold"', "train.clients_per_round=3",
        "rounds=5", "log.client_controls=true", 'scaffold.init="gradient"'])
    runs.run(cfg, tmp_path / "whole.h5")
    full = read_run(tmp_path / "whole.h5")
    honest_commit = RunLogWriter.commit

    def dies_in_round_4(self, round_idx):
        if round_idx == 4:
            raise KeyboardInterrupt
        honest_commit(self, round_idx)

    monkeypatch.setattr(RunLogWriter, "commit", dies_in_round_4)
    with pytest.raises(KeyboardInterrupt):
        runs.run(cfg, tmp_path / "killed.h5")
    point = read_resume_point(tmp_path / "killed.h5")
    raw = read_run(tmp_path / "killed.h5")
    changed = np.flatnonzero(full["participation/selected"][3])
    assert raw["state/undo/round"][0] == 4  # round 4 had staged its rows ...
    assert not np.array_equal(raw["state/c_clients"][changed], full["scaffold/c_clients"][3][changed])
    assert point.rounds_done == 3  # ... but the resume point is round 3, rows rolled back
    np.testing.assert_array_equal(point.state["c_clients"].dense(), full["scaffold/c_clients"][3])
    np.testing.assert_array_equal(point.state["c"], full["scaffold/c"][3])
    np.testing.assert_array_equal(point.state["x"], full["trajectory/x"][3])


def test_controls_that_cannot_fit_are_refused(tmp_path, monkeypatch):
    cfg = config_mod.load_config(None, ['train.algorithm="scaffold"', "rounds=2"])

    class Tiny:
        available = 50_000

    monkeypatch.setattr(budget.psutil, "virtual_memory", lambda: Tiny)
    monkeypatch.setattr(budget, "KERNEL_BYTES", 0)  # (the whole run's estimate, tests/test_scale.py, then passes)
    with pytest.raises(ResourceError, match="SCAFFOLD's controls need 47.7 KB but only 48.8 KB"):
        runs.run(cfg, tmp_path / "r.h5")
    assert not (tmp_path / "r.h5").exists()
    monkeypatch.undo()
    monkeypatch.setattr(budget.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    cfg = config_mod.load_config(None, ['train.algorithm="scaffold"', "rounds=2", "log.client_controls=true"])
    with pytest.raises(ResourceError, match="log fewer rounds"):
        runs.run(cfg, tmp_path / "r.h5")
    lines = []
    monkeypatch.undo()
    runs.run(cfg, tmp_path / "ok.h5", on_info=lines.append)
    assert "SCAFFOLD controls: 20 x 610 float32 = 47.7 KB in memory" in lines[1]  # rounds x S rows at most
    assert "(held for the 20 of 30 devices 2 rounds can touch)" in lines[1]


def test_devices_hold_exactly_the_controls_the_log_tracks(tmp_path, quad_file):
    """Device-side c_k (in the transport) and the log's copy agree bit for bit, also when a report is dropped."""
    from edgefed.algorithms import build_algorithm
    from edgefed.engine.rounds import RoundEngine
    from edgefed.models import build_model
    from edgefed.rng import Purpose, generator
    from edgefed.runlog import Header, RunLogWriter
    from edgefed.runtime.local import LocalTransport

    A = np.array([[1.0, 2.0], [0.5, 1.0], [1e10, 1.0], [1.5, 0.7]])  # device 2 overflows: dropped every round
    path = quad_file(A, np.ones((4, 2)), x0=np.zeros(2))
    cfg = config_mod.load_config(None, ['data.kind="quadratic"', f'data.path="{path}"', "train.local_steps=40",
                                        'train.algorithm="scaffold"', 'train.clients_per_round="all"',
                                        "train.lr_local=0.5", "rounds=4", 'scaffold.init="gradient"'])
    cfg = config_mod.with_clients(cfg, 4)
    problem = problem_of(cfg)
    model = build_model(cfg.model, problem, generator(cfg.seed, Purpose.INIT))
    algorithm = build_algorithm(cfg)
    transport = LocalTransport(problem, model, algorithm, cfg.seed, None)
    header = Header(config_mod.to_toml(cfg), 0, 4, 4, 2, model.dtype, problem.n_train,
                    **log_layout(algorithm, cfg, 4, 2, model.dtype))
    log = RunLogWriter.create(tmp_path / "run.h5", header)
    engine = RoundEngine(cfg, algorithm, problem.n_train, transport, log)
    engine.start(model.initial_params())
    for r in range(1, 5):
        engine.round(r)
    tracked = log.rows("c_clients")
    log.close()
    assert transport.vectors["c_clients"].stored(4).dense().tobytes() == tracked.tobytes()
    assert read_run(tmp_path / "run.h5")["participation/nonfinite"][:, 2].all()
    np.testing.assert_array_equal(tracked[2], A[2].astype(np.float32) * -1)  # kept its initial control
