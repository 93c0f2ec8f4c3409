"""SYNTHETIC(alpha, beta): per-device purity, the generator's laws, sample counts and the split."""

import numpy as np
import pytest

from edgefed.config import load_config
from edgefed.problems.synthetic import N_CLASSES, N_FEATURES, SyntheticProblem
from helpers import problem_of


def problem(*overrides, seed=0):
    return problem_of(load_config(None, [f"seed={seed}", ALL, *overrides]))


ALL = "train.clients_per_round=\"all\""


def test_device_data_is_a_pure_function_of_seed_and_device():
    small, large = problem("data.clients=5"), problem("data.clients=40")
    for k in range(5):
        a, b = small.device(k), large.device(k)
        assert a.X_train.tobytes() == b.X_train.tobytes() and a.y_test.tobytes() == b.y_test.tobytes()
    again = problem("data.clients=40").device(33)  # built alone, without devices 0..32
    assert again.X_train.tobytes() == large.device(33).X_train.tobytes()
    assert problem(seed=1).device(0).X_train.tobytes() != small.device(0).X_train.tobytes()


def test_shapes_dtypes_and_ninety_ten_split():
    p = problem("data.samples=200", "model.dtype=\"float64\"")
    d = p.device(3)
    assert d.X_train.shape == (180, N_FEATURES) and d.X_test.shape == (20, N_FEATURES)
    assert d.X_train.dtype == np.float64 and d.y_train.dtype == np.int64
    assert p.n_train.tolist() == [180] * 30
    assert problem().device(0).X_train.dtype == np.float32


def test_lognormal_counts_follow_fedprox():
    p = problem("data.clients=400")
    assert p.n_total.min() >= 50
    # int(exp N(4, 2)) + 50: the median of the lognormal part is e^4 = 54.6
    assert np.median(p.n_total - 50) == pytest.approx(np.exp(4), rel=0.2)


def test_pareto_counts_have_floor_cap_and_index_one_half():
    p = problem("data.clients=2000", "data.samples=\"pareto\"", "data.samples_max=100000")
    n = p.n_total
    assert n.min() >= 50 and n.max() <= 100000
    # Type I, index 1/2, scale 50: P(n >= 200) = (50/200)^0.5 = 0.5
    assert np.mean(n >= 200) == pytest.approx(0.5, abs=0.04)
    capped = problem("data.clients=500", "data.samples=\"pareto\"").n_total
    assert capped.max() == 5000  # default cap


def test_features_have_the_generator_covariance_and_labels_its_argmax():
    cfg = load_config(None, [ALL, "data.samples=20000", "data.clients=2", "data.alpha=0.0", "data.beta=0.0",
                             "model.dtype=\"float64\""])
    p = problem_of(cfg)
    X, y = p.generate(1)
    var = X.var(axis=0)
    np.testing.assert_allclose(var, np.arange(1, 61) ** -1.2, rtol=0.05)
    v, W, b = p.device_law(1)
    np.testing.assert_allclose(X.mean(axis=0), v, atol=0.03)  # x ~ N(v_k, Sigma)
    assert np.array_equal(y, np.argmax(X @ W + b, axis=1)) and y.max() < N_CLASSES


def test_mean_of_device_features_spreads_with_beta():
    def spread(beta):
        p = problem_of(load_config(None, [ALL, "data.samples=300", "data.clients=60", f"data.beta={beta}"]))
        means = [p.generate(k)[0].mean() for k in range(60)]  # ~ B_k, since v_k ~ N(B_k, 1)
        return np.std(means)

    assert spread(0.0) < 0.3 and spread(5.0) > 2.5


def test_iid_variant_shares_one_model_and_centres_features():
    p = problem_of(load_config(None, [ALL, "data.iid=true", "data.samples=3000", "data.clients=3",
                                         "model.dtype=\"float64\""]))
    W, b = p._global_model()
    for k in range(3):
        X, y = p.generate(k)
        assert np.array_equal(y, np.argmax(X @ W + b, axis=1))
        assert np.abs(X.mean(axis=0)).max() < 0.1


def test_non_iid_labels_come_from_the_devices_own_model():
    p = problem_of(load_config(None, [ALL, "data.samples=500", "data.clients=2"]))
    W, b = p._global_model()
    X, y = p.generate(0)
    assert not np.array_equal(y, np.argmax(X @ W + b, axis=1))
    _, W0, b0 = p.device_law(0)
    assert np.array_equal(y, np.argmax(X @ W0 + b0, axis=1))
    assert isinstance(p, SyntheticProblem) and p.describe().startswith("SYNTHETIC(1,1)")
