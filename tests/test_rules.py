"""Aggregation rules for partial and late work (FedNova, drop-stragglers) and FedProx's local step: by hand,
as properties, against NumPy on the quadratic, through every model's kernel, and on every path."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefed.kernels.sgd import step_terms
from edgefed.models import Quadratic
from edgefed.orchestration import run as runs
from edgefed.participation import schemes
from edgefed.problems import ClassificationData, QuadraticData
from edgefed.rng import Purpose, kernel_state
from edgefed.runlog import read_run
from edgefed.tracefiles import write_trace_file
from conftest import config_with
from helpers import cnn_model, compared, logreg_model, mlp_model
from naive import Xoshiro, logreg_sgd
from test_images import naive_cnn_loss, naive_mlp_steps
from test_protocol import loopback_run


def rule(name, weights, steps, budgets):
    return schemes.SCHEMES[name](np.asarray(weights, float), np.asarray(steps), np.asarray(budgets))


# -- by hand ------------------------------------------------------------------------------------------------
W = [0.2, 0.3, 0.5]


@pytest.mark.parametrize("steps,nova,drop", [
    ([10, 10, 10], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5]),  # full work: both are the base weights
    ([10, 5, 2], [4.5 * 0.2 / 10, 4.5 * 0.3 / 5, 4.5 * 0.5 / 2], [1.0, 0.0, 0.0]),  # tau_eff = 2 + 1.5 + 1
    ([10, 0, 5], [(4.5 / 0.7) * (0.2 / 0.7) / 10, 0.0, (4.5 / 0.7) * (0.5 / 0.7) / 5], [1.0, 0.0, 0.0]),  # s = 0
    ([3, 4, 5], [4.3 * 0.2 / 3, 4.3 * 0.3 / 4, 4.3 * 0.5 / 5], [0.0, 0.0, 0.0]),  # nobody complete: tau 4.3
    ([0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]),  # nobody reporting
])
def test_rules_on_rounds_computed_by_hand(steps, nova, drop):
    np.testing.assert_allclose(rule("fednova", W, steps, [10, 10, 10]), nova, rtol=1e-14, atol=0)
    np.testing.assert_allclose(rule("drop", W, steps, [10, 10, 10]), drop, rtol=1e-14, atol=0)


def test_fednova_applies_the_weighted_mean_of_normalized_updates():
    """x + tau_eff sum p_k Delta_k / s_k: a device that took 5 steps and moved 5 counts as one that took 1
    step and moved 1."""
    coeff = rule("fednova", [0.5, 0.5], [5, 1], [5, 5])
    np.testing.assert_allclose(coeff @ np.array([5.0, 1.0]), 3.0 * (0.5 * 1 + 0.5 * 1), rtol=1e-15)


# -- properties ---------------------------------------------------------------------------------------------
rounds = st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.lists(st.integers(1, 10_000), min_size=n, max_size=n),  # n_k
    st.lists(st.integers(1, 30), min_size=n, max_size=n),  # K_k
    st.lists(st.floats(0, 1), min_size=n, max_size=n),  # the share of K_k completed
    st.permutations(range(n))))


def _round(draw):
    n_train, budgets, shares, perm = draw
    budgets = np.array(budgets)
    steps = np.floor(np.array(shares) * budgets).astype(int)
    return np.array(n_train), budgets, steps, np.array(perm)


@settings(max_examples=60, deadline=None)
@given(rounds)
def test_with_full_work_fednova_is_scheme_b_and_drop_with_uniform_weights_is_scheme_a(draw):
    """Full work with one K for every device (with budgets K_k of their own, FedNova still divides by them)."""
    n_train, budgets, steps, _ = _round(draw)
    budgets = np.full(budgets.size, budgets[0])
    steps = np.minimum(steps, budgets)
    ids, everyone = np.arange(n_train.size), schemes.Federation(np.ones(n_train.size, bool), n_train)
    for weighting in ("uniform", "count_selected"):
        full = schemes.coefficients(weighting, "fednova", ids, everyone, n_train, budgets, budgets)
        np.testing.assert_allclose(full, schemes.coefficients(weighting, "B", ids, everyone, n_train, budgets, budgets),
                                   rtol=1e-12)
    np.testing.assert_allclose(schemes.coefficients("uniform", "drop", ids, everyone, n_train, steps, budgets),
                               schemes.coefficients("uniform", "A", ids, everyone, n_train, steps, budgets), rtol=1e-12)


@settings(max_examples=60, deadline=None)
@given(rounds)
def test_no_rule_depends_on_the_order_of_the_devices(draw):
    n_train, budgets, steps, perm = _round(draw)
    ids, everyone = np.arange(n_train.size), schemes.Federation(np.ones(n_train.size, bool), n_train)
    for name in schemes.SCHEMES:
        for weighting in ("uniform", "count_global", "count_selected"):
            ref = schemes.coefficients(weighting, name, ids, everyone, n_train, steps, budgets)
            got = schemes.coefficients(weighting, name, ids[perm], everyone, n_train, steps[perm], budgets[perm])
            assert got.tobytes() == ref[perm].tobytes(), (name, weighting)


# -- the round, against NumPy on a quadratic ----------------------------------------------------------------
def constant_traces(tmp_path, fractions):
    """A trace file whose trace tK completes the same share of K every round."""
    path = tmp_path / "constant.csv"
    names = [f"t{int(f * 100)}" for f in fractions]
    write_trace_file(path, names, np.array([fractions]), {"made": "by the test"})
    return [f"{path}#{name}" for name in names]


def quadratic_deltas(A, b, x, lr, steps):
    """Delta_k after s_k exact gradient steps from x: ((1 - lr a)^s - 1) (x - b), coordinate-wise."""
    return ((1 - lr * A) ** steps[:, None] - 1) * (x - b)


def numpy_coefficients(name, w, s, K):
    """The rules as written in the issue, independent of edgefed's code."""
    if name == "fednova":
        R = s > 0
        p = np.where(R, w, 0) / w[R].sum() if R.any() else np.zeros_like(w)
        tau = (p * s).sum()
        return np.where(R, tau * p / np.maximum(s, 1), 0)
    Q = s == K
    return np.where(Q, w, 0) / w[Q].sum() if Q.any() else np.zeros_like(w)


@pytest.mark.parametrize("name", ["fednova", "drop"])
@pytest.mark.parametrize("weighting", ["uniform", "count_selected"])
def test_a_run_follows_its_rule_round_by_round(tmp_path, quad_file, name, weighting):
    g = np.random.default_rng(8)
    A, b, n = g.uniform(0.5, 2.0, (4, 3)), g.normal(0, 2, (4, 3)), np.array([10, 40, 20, 30])
    cfg = config_with({"data.kind": "quadratic", "data.path": str(quad_file(A, b, n=n, x0=np.zeros(3))),
                       "model.dtype": "float64", "train.clients_per_round": "all", "train.local_steps": 10,
                       "train.lr_local": 0.05, "train.lr_global": 0.8, "train.weighting": weighting, "rounds": 12,
                       "participation.mode": "trace", "participation.scheme": name,
                       "participation.trace": ["cpu50", "cpu90", "bw-low", "cpu0"]})
    runs.run(cfg, tmp_path / "r.h5")
    log = read_run(tmp_path / "r.h5")
    x, xs = np.zeros(3), [np.zeros(3)]
    w = np.full(4, 0.25) if weighting == "uniform" else n / n.sum()
    for r, s in enumerate(log["participation/steps"]):
        coeff = numpy_coefficients(name, w, s, 10)
        np.testing.assert_allclose(log["participation/coeff"][r], coeff, rtol=1e-13, atol=1e-16)
        x = x + 0.8 * coeff @ quadratic_deltas(A, b, x, 0.05, s)
        xs.append(x)
    np.testing.assert_allclose(log["trajectory/x"], xs, rtol=1e-12, atol=1e-14)
    steps = log["participation/steps"]
    assert (steps == 0).any() and ((steps > 0) & (steps < 10)).any() and (steps == 10).any()  # every case met
    nobody = np.flatnonzero(log["metrics/n_applied"] == 0)
    for r in nobody:  # a round the rule keeps nobody in changes nothing
        assert np.array_equal(log["trajectory/x"][r + 1], log["trajectory/x"][r])


def fixed_point(A, b, weights):
    """argmin of sum_k weights_k . a_k (x - b_k)^2 / 2, coordinate-wise: the point a rule's rounds stop at."""
    return (weights * b).sum(axis=0) / weights.sum(axis=0)


def test_fednova_removes_the_objective_inconsistency_of_unequal_steps(tmp_path, quad_file):
    """Devices complete 100, 50, 25 and 10 % of K = 20 every round. Each rule's rounds stop where its
    coefficients, times the shrinking 1 - (1 - lr a)^s of s exact steps, balance the devices' pulls; for
    FedNova (and Scheme C, whose coefficients are K times FedNova's here) that is the optimum of the uniform
    objective up to the curvature factors rho_k = (1 - (1 - lr a_k)^s_k) / (s_k lr a_k) in [rho_min, 1],
    i.e. within (1 / rho_min - 1) max_k |b_k - x*| of it; Scheme B weighs a device by its steps and lands
    measurably away."""
    g = np.random.default_rng(3)
    A, b = g.uniform(0.5, 2.0, (4, 2)), g.normal(0, 3, (4, 2))
    lr, K = 0.005, 20
    s = np.array([20, 10, 5, 2])
    common = {"data.kind": "quadratic", "data.path": str(quad_file(A, b, x0=np.zeros(2))), "model.dtype": "float64",
              "train.clients_per_round": "all", "train.local_steps": K, "train.lr_local": lr,
              "train.weighting": "uniform", "rounds": 1000, "log.every": 1000, "log.eval_every": 1000,
              "participation.mode": "trace", "participation.trace": constant_traces(tmp_path, list(s / K))}
    final = {}
    for name in ("fednova", "C", "B"):
        runs.run(config_with({**common, "participation.scheme": name}), tmp_path / f"{name}.h5")
        final[name] = read_run(tmp_path / f"{name}.h5")["trajectory/x"][-1]
    shrink = 1 - (1 - lr * A) ** s[:, None]  # Delta_k = -shrink_k (x - b_k)
    optimum = fixed_point(A, b, A)
    nova_point = fixed_point(A, b, shrink / s[:, None])
    np.testing.assert_allclose(final["fednova"], nova_point, rtol=1e-10)
    np.testing.assert_allclose(final["C"], nova_point, rtol=1e-10)
    np.testing.assert_allclose(final["B"], fixed_point(A, b, shrink), rtol=1e-10)
    rho_min = (shrink / (s[:, None] * lr * A)).min()
    tolerance = (1 / rho_min - 1) * np.abs(b - optimum).max()
    assert np.abs(final["fednova"] - optimum).max() <= tolerance
    assert np.abs(final["B"] - optimum).max() > 5 * np.abs(final["fednova"] - optimum).max()
    assert np.abs(final["B"] - optimum).max() > tolerance


# -- FedProx ------------------------------------------------------------------------------------------------
def test_fedprox_follows_its_rule_on_a_quadratic(tmp_path, quad_file):
    g = np.random.default_rng(1)
    A, b, x0 = g.uniform(0.5, 2.0, (4, 3)), g.normal(size=(4, 3)), g.normal(size=3)
    cfg = config_with({"data.kind": "quadratic", "data.path": str(quad_file(A, b, x0=x0)), "model.dtype": "float64",
                       "train.algorithm": "fedprox", "fedprox.mu": 0.5, "train.clients_per_round": "all",
                       "train.local_steps": 3, "train.lr_local": 0.1, "train.weighting": "uniform", "rounds": 4})
    runs.run(cfg, tmp_path / "p.h5")
    x, xs = x0.copy(), [x0]
    for _ in range(4):
        ys = []
        for k in range(4):
            y = x.copy()
            for _ in range(3):
                y = y - 0.1 * (A[k] * (y - b[k]) + 0.5 * (y - x))
            ys.append(y)
        x = np.mean(ys, axis=0)
        xs.append(x)
    np.testing.assert_allclose(read_run(tmp_path / "p.h5")["trajectory/x"], xs, rtol=1e-12)


@pytest.mark.parametrize("model", ["logreg", "mlp", "quadratic"])
def test_fedprox_with_mu_zero_is_fedavg_byte_for_byte(tmp_path, model):
    base = {"rounds": 3, "data.clients": 6, "train.clients_per_round": 4, "train.local_steps": 5,
            "participation.mode": "trace", "participation.trace": "builtin"}
    if model == "mlp":
        base.update({"model.kind": "mlp", "model.hidden": [6]})
    if model == "quadratic":
        base.update({"data.kind": "quadratic", "data.noise_std": 0.1})
    runs.run(config_with({**base, "train.algorithm": "fedprox", "fedprox.mu": 0.0}), tmp_path / "p.h5")
    runs.run(config_with(base), tmp_path / "a.h5")
    prox, avg = read_run(tmp_path / "p.h5"), read_run(tmp_path / "a.h5")
    assert [k for k, v in compared(avg).items() if v.tobytes() != prox[k].tobytes()] == []


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
def test_fedprox_term_in_the_logreg_and_mlp_kernels(dtype, tol):
    g = np.random.default_rng(6)
    X, y = g.normal(size=(37, 6)).astype(dtype), g.integers(0, 4, 37)
    data = ClassificationData(X, y, X[:3].copy(), y[:3].copy())
    state = kernel_state(2, Purpose.LOCAL, 3, 1)
    logreg = logreg_model(6, 4, dtype)
    x0 = (0.3 * g.normal(size=logreg.n_trainable)).astype(dtype)
    expect = logreg_sgd(x0, X.astype(np.float64), y, 4, 9, 8, 0.2, state.copy(), mu=0.7,
                        anchor=x0.astype(np.float64))
    x = x0.copy()
    logreg.local_steps(x, data, logreg.begin(data, state.copy()), 9, 8, 0.2, step_terms(dtype, anchor=x0, mu=0.7))
    np.testing.assert_allclose(x, expect, rtol=tol, atol=tol)
    assert np.abs(expect - logreg_sgd(x0, X.astype(np.float64), y, 4, 9, 8, 0.2, state.copy())).max() > 10 * tol
    mlp = mlp_model((6, 5, 4), dtype, seed=1)
    x0 = mlp.initial_params()
    expect = naive_mlp_steps(x0, (6, 5, 4), X.astype(np.float64), y, 9, 8, 0.2, state.copy(), mu=0.7,
                             anchor=x0.astype(np.float64) + 0.1)
    x = x0.copy()
    mlp.local_steps(x, data, mlp.begin(data, state.copy()), 9, 8, 0.2, step_terms(dtype, anchor=x0 + dtype(0.1), mu=0.7))
    np.testing.assert_allclose(x, expect, rtol=tol, atol=tol)


def test_fedprox_term_in_the_cnn_and_quadratic_kernels():
    g = np.random.default_rng(4)
    X, y = g.random((30, 64)), g.integers(0, 3, 30)
    data = ClassificationData(X, y, X[:3].copy(), y[:3].copy())
    model = cnn_model(64, 3, np.float64, seed=0)
    x = model.initial_params() + 0.01 * g.normal(size=model.n_trainable)
    anchor = x + 0.05 * g.normal(size=model.n_trainable)
    state = kernel_state(1, Purpose.LOCAL, 1, 0)
    rows = Xoshiro(state.copy()).batch(list(range(30)), 10)
    sub_grad = np.zeros(model.n_trainable)
    model.loss_grad(x, ClassificationData(X[rows], y[rows], X[:1], y[:1]), sub_grad)
    stepped = x.copy()
    model.local_steps(stepped, data, model.begin(data, state), 1, 10, 0.1, step_terms(np.float64, anchor=anchor, mu=0.3))
    np.testing.assert_allclose(stepped, x - 0.1 * (sub_grad + 0.3 * (x - anchor)), rtol=1e-10, atol=1e-13)
    assert naive_cnn_loss(stepped, 8, 3, X, y) > 0  # the stepped model is a model
    quad = Quadratic(3, np.zeros(3), np.float32)
    qd = QuadraticData(np.array([1.0, 2.0, 0.5], np.float32), np.array([1.0, -1.0, 3.0], np.float32), 0.0)
    q = np.zeros(3, np.float32)
    anchor = np.array([0.5, 0.5, 0.5], np.float32)
    quad.local_steps(q, qd, quad.begin(qd, state), 4, None, 0.1, step_terms(np.float32, anchor=anchor, mu=2.0))
    ref = np.zeros(3)
    for _ in range(4):
        ref = ref - 0.1 * (qd.a * (ref - qd.b) + 2.0 * (ref - anchor))
    np.testing.assert_allclose(q, ref, rtol=1e-6)


# -- every path ---------------------------------------------------------------------------------------------
SMALL = {"rounds": 4, "data.clients": 7, "data.samples": "pareto", "train.clients_per_round": 5,
         "train.local_steps": 8}
TRACE = {"participation.mode": "trace", "participation.trace": "builtin"}


@pytest.mark.parametrize("algorithm,scheme", [("fedavg", "fednova"), ("fedavg", "drop"), ("fedprox", "B"),
                                              ("fedprox", "fednova"), ("scaffold", "drop"), ("scaffold", "fednova")])
@pytest.mark.parametrize("mode", ["full", "trace"])
def test_every_rule_writes_the_same_bytes_over_mpi(tmp_path, algorithm, scheme, mode):
    cfg = config_with({**SMALL, **(TRACE if mode == "trace" else {}), "train.algorithm": algorithm,
                       "participation.scheme": scheme, "model.dtype": "float64" if scheme == "drop" else "float32"})
    runs.run(cfg, tmp_path / "sim.h5")
    sim, mpi = read_run(tmp_path / "sim.h5"), loopback_run(cfg, tmp_path / "mpi.h5", 3)
    assert [k for k, v in compared(sim).items() if v.tobytes() != mpi[k].tobytes()] == []
    if mode == "trace":
        assert (sim["participation/steps"] < 8).any()


def test_a_deadline_log_replayed_under_each_rule_keeps_its_participation(tmp_path):
    """One epoch of Pareto-sized devices is 3 to 250 steps: a 0.3 ms deadline completes some, cuts others."""
    common = {**SMALL, "train.local_steps": None, "train.local_epochs": 1, "rounds": 5}
    runs.run(config_with({**common, "participation.mode": "deadline", "participation.deadline_s": 0.0003,
                          "participation.grace_s": 1.0, "participation.scheme": "fednova"}), tmp_path / "d.h5")
    source = read_run(tmp_path / "d.h5")
    steps, budget = source["participation/steps"], source["participation/budget"]
    assert ((steps > 0) & (steps < budget)).any() and ((steps == budget) & (budget > 0)).any()
    replays = {}
    for scheme in schemes.SCHEMES:
        cfg = config_with({**common, "participation.mode": "trace", "participation.trace": str(tmp_path / "d.h5"),
                           "participation.scheme": scheme})
        runs.run(cfg, tmp_path / f"{scheme}.h5")
        replays[scheme] = log = read_run(tmp_path / f"{scheme}.h5")
        for part in ("selected", "active", "budget", "steps"):
            assert np.array_equal(log[f"participation/{part}"], source[f"participation/{part}"]), (scheme, part)
    assert replays["fednova"]["trajectory/x"].tobytes() == source["trajectory/x"].tobytes()  # the run's own rule
    coeffs = {s: log["participation/coeff"].tobytes() for s, log in replays.items()}
    trajectories = {s: log["trajectory/x"].tobytes() for s, log in replays.items()}
    assert len(set(coeffs.values())) == len(coeffs) and len(set(trajectories.values())) == len(trajectories)
