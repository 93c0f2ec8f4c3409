"""FedAvg on quadratics whose answers are known: docs/design.md section 2 to float64 precision."""

import numpy as np
import pytest

from naive import fedavg_quadratic


def quad_overrides(path, **extra):
    base = {"data.kind": "quadratic", "data.path": str(path), "model.dtype": "float64", "rounds": 6,
            "train.clients_per_round": "all", "train.local_steps": 1, "train.lr_local": 0.1}
    base.update(extra)
    return base


def test_fedsgd_equals_centralized_gradient_descent(quad_file, run_experiment):
    g = np.random.default_rng(0)
    A, b = g.uniform(0.5, 3.0, (7, 5)), g.normal(size=(7, 5))
    n = g.integers(1, 50, 7)
    x0 = g.normal(size=5)
    log = run_experiment(quad_overrides(quad_file(A, b, n, x0), **{
        "train.weighting": "count_global", "train.lr_global": 1.0, "train.lr_local": 0.2, "rounds": 25}))
    p = n / n.sum()
    x = x0.copy()
    expect = [x.copy()]
    for _ in range(25):
        x = x - 0.2 * (p @ (A * (x - b)))
        expect.append(x.copy())
    np.testing.assert_allclose(log["trajectory/x"], np.array(expect), rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(log["trajectory/round"], np.arange(26))


@pytest.mark.parametrize("weighting", ["uniform", "count_global", "count_selected"])
def test_trajectory_follows_design_section_2(quad_file, run_experiment, weighting):
    g = np.random.default_rng(1)
    A, b = g.uniform(0.2, 2.0, (8, 4)), g.normal(size=(8, 4))
    n = g.integers(1, 100, 8)
    x0 = g.normal(size=4)
    log = run_experiment(quad_overrides(quad_file(A, b, n, x0), **{
        "train.weighting": weighting, "train.clients_per_round": 3, "train.local_steps": 5,
        "train.lr_local": 0.3, "train.lr_global": 0.7, "rounds": 10}))
    selections = [np.flatnonzero(row) for row in log["participation/selected"]]
    assert all(s.size == 3 for s in selections)
    expect = fedavg_quadratic(A, b, x0, 10, 5, 3, 0.3, 0.7, weighting, n, selections)
    np.testing.assert_allclose(log["trajectory/x"], expect, rtol=1e-13, atol=1e-15)
    np.testing.assert_array_equal(log["participation/steps"], np.where(log["participation/selected"], 5, 0))


@pytest.mark.parametrize("weighting,x1,x2", [("uniform", 0.5, 0.75), ("count_global", 0.75, 1.125),
                                             ("count_selected", 0.75, 1.125)])
def test_weightings_by_hand(quad_file, run_experiment, weighting, x1, x2):
    # f_0 = x^2/2, f_1 = (x-2)^2/2, n = (1, 3), x0 = 0, one step of lr 0.5.
    # Round 1: Delta_0 = 0, Delta_1 = 1. uniform: 0.5; count: 3/4.
    # Round 2 (count): Delta_0 = -0.375, Delta_1 = 0.625 -> 0.75 + (-0.375 + 3 * 0.625) / 4 = 1.125.
    log = run_experiment(quad_overrides(quad_file([[1.0], [1.0]], [[0.0], [2.0]], [1, 3], [0.0]), **{
        "train.weighting": weighting, "train.lr_local": 0.5, "rounds": 2}))
    assert log["trajectory/x"][:, 0].tolist() == [0.0, x1, x2]
    coeff = log["participation/coeff"][0]
    assert coeff.tolist() == ([0.5, 0.5] if weighting == "uniform" else [0.25, 0.75])


@pytest.mark.parametrize("weighting", ["uniform", "count_global", "count_selected"])
def test_one_of_two_selected_by_hand(quad_file, run_experiment, weighting):
    log = run_experiment(quad_overrides(quad_file([[1.0], [1.0]], [[0.0], [2.0]], [1, 3], [0.0]), **{
        "train.weighting": weighting, "train.lr_local": 0.5, "train.clients_per_round": 1, "rounds": 1}))
    chosen = int(np.flatnonzero(log["participation/selected"][0])[0])
    delta = [0.0, 1.0][chosen]
    weight = {"uniform": 1.0, "count_global": [0.25, 0.75][chosen], "count_selected": 1.0}[weighting]
    assert log["trajectory/x"][1, 0] == weight * delta


def test_nonfinite_update_is_dropped_counted_and_logged(quad_file, run_experiment):
    # Device 1's step factor is 1 - 1e10: it overflows to inf within 40 steps; device 0 is tame.
    log = run_experiment(quad_overrides(quad_file([[1.0], [1e10]], [[1.0], [1.0]], None, [0.0]), **{
        "train.local_steps": 40, "train.lr_local": 1.0, "train.weighting": "uniform", "rounds": 2}))
    assert log["participation/nonfinite"].tolist() == [[False, True], [False, True]]
    assert log["participation/coeff"].tolist() == [[0.5, 0.0], [0.5, 0.0]]
    assert np.all(np.isfinite(log["trajectory/x"]))
    assert log["trajectory/x"][1, 0] == 0.5  # device 0 reaches its optimum 1 in one step; weight 1/2


def test_local_epochs_become_per_device_budgets(quad_file, run_experiment):
    log = run_experiment(quad_overrides(quad_file(np.ones((3, 2)), np.zeros((3, 2)), [10, 25, 3]), **{
        "train.local_steps": None, "train.local_epochs": 2, "train.batch_size": 10, "rounds": 1}))
    # K_k = ceil(E * n_k / min(B, n_k)): 2, 5, 2
    assert log["participation/budget"][0].tolist() == [2, 5, 2]
    assert log["participation/steps"][0].tolist() == [2, 5, 2]


def test_staircase_learning_rate_is_logged(quad_file, run_experiment):
    log = run_experiment(quad_overrides(quad_file(np.ones((2, 2)), np.zeros((2, 2))), **{
        "train.lr_schedule": "staircase", "train.lr_local": 0.9, "rounds": 4}))
    np.testing.assert_array_equal(log["metrics/lr"], 0.9 / np.arange(1, 5))


def test_train_loss_is_the_weighted_objective(quad_file, run_experiment):
    A, b, n = np.array([[1.0], [3.0]]), np.array([[1.0], [-1.0]]), np.array([1, 3])
    for weighting, w in (("uniform", [0.5, 0.5]), ("count_global", [0.25, 0.75])):
        log = run_experiment(quad_overrides(quad_file(A, b, n, [0.0]), **{"train.weighting": weighting,
                                                                          "rounds": 1}))
        assert log["metrics/train_loss"][0] == pytest.approx(w[0] * 0.5 + w[1] * 1.5)
        assert np.isnan(log["metrics/test_accuracy"]).all()
