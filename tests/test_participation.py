"""Device sampling and aggregation coefficients, on values computed by hand."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefed.algorithms.fedavg import server_update
from edgefed.config import load_config
from edgefed.participation import schemes
from edgefed.participation.sampling import select_devices


def test_selection_has_exactly_s_distinct_sorted_devices():
    active = np.arange(30)
    for r in range(1, 200):
        sel = select_devices(5, r, active, 10)
        assert sel.size == 10 and np.unique(sel).size == 10
        assert np.all(np.diff(sel) > 0) and sel.min() >= 0 and sel.max() < 30


def test_selection_frequencies_are_uniform():
    counts = np.zeros(20)
    rounds = 4000
    for r in range(1, rounds + 1):
        counts[select_devices(9, r, np.arange(20), 5)] += 1
    expected = rounds * 5 / 20
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 43.8  # chi-square, 19 dof, p = 0.001
    assert counts.sum() == rounds * 5


def test_selection_depends_on_seed_and_round_only():
    a = select_devices(1, 7, np.arange(50), 5)
    assert np.array_equal(a, select_devices(1, 7, np.arange(50), 5))
    others = [select_devices(1, 8, np.arange(50), 5), select_devices(2, 7, np.arange(50), 5)]
    assert all(not np.array_equal(a, o) for o in others)
    assert np.array_equal(select_devices(1, 7, np.arange(5), 5), np.arange(5))


@pytest.mark.parametrize("setting,n,expected", [(10, 30, 10), (0.1, 30, 3), (0.1, 25, 3), (0.01, 30, 1),
                                                (1.0, 30, 30), (0.07, 100, 7), (0.14, 100, 14), ("all", 17, 17)])
def test_clients_per_round_count_fraction_and_all(setting, n, expected):
    value = f'"{setting}"' if isinstance(setting, str) else repr(setting)
    cfg = load_config(None, [f"train.clients_per_round={value}", f"data.clients={n}"])
    assert cfg.clients_per_round_count(n) == expected


def members(n: np.ndarray, ids=None) -> schemes.Federation:
    """The federation of these ids (default: every device)."""
    return schemes.Federation(np.ones(n.size, bool) if ids is None else np.isin(np.arange(n.size), ids), n)


def test_base_weights_by_hand():
    n = np.array([10, 20, 30, 40])
    sel, active = np.array([1, 3]), members(n)
    assert schemes.base_weights("uniform", sel, active, n).tolist() == [0.5, 0.5]
    assert schemes.base_weights("count_global", sel, active, n).tolist() == [0.2, 0.4]
    assert schemes.base_weights("count_selected", sel, active, n).tolist() == [1 / 3, 2 / 3]
    assert schemes.base_weights("count_global", sel, members(n, [1, 2, 3]), n).tolist() == [20 / 90, 40 / 90]


def test_scheme_multipliers_by_hand():
    steps, budgets = np.array([5, 2, 0, 5]), np.array([5, 5, 5, 5])
    assert schemes.scheme_multipliers("A", steps, budgets).tolist() == [2.0, 0.0, 0.0, 2.0]  # |S|/K_r = 4/2
    assert schemes.scheme_multipliers("B", steps, budgets).tolist() == [1.0] * 4
    assert schemes.scheme_multipliers("C", steps, budgets).tolist() == [1.0, 2.5, 0.0, 1.0]
    assert schemes.scheme_multipliers("A", np.array([1, 0]), np.array([5, 5])).tolist() == [0.0, 0.0]  # K_r = 0


def test_coefficients_are_products():
    n = np.array([1, 3])
    p = schemes.coefficients("count_global", "C", np.array([0, 1]), members(n), n, np.array([2, 4]),
                             np.array([4, 4]))
    assert p.tolist() == [0.25 * 2.0, 0.75 * 1.0]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.floats(0.1, 2.0), st.integers(0, 2**31))
def test_averaging_identical_updates_returns_that_update(n_dev, d, lr_g, seed):
    g = np.random.default_rng(seed)
    x, delta = g.normal(size=d), g.normal(size=d)
    w = g.uniform(0.1, 1.0, n_dev)
    w /= w.sum()
    out = server_update(x, np.arange(n_dev), np.tile(delta, (n_dev, 1)), w, lr_g)
    np.testing.assert_allclose(out, x + lr_g * delta, rtol=1e-12, atol=1e-12)


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 6), st.integers(0, 2**31))
def test_device_order_does_not_change_weights_or_server_update(n_dev, seed):
    g = np.random.default_rng(seed)
    n = g.integers(1, 100, 10)
    sel = np.sort(g.choice(10, n_dev, replace=False))
    perm = g.permutation(n_dev)
    for weighting in ("uniform", "count_global", "count_selected"):
        w = schemes.base_weights(weighting, sel, members(n), n)
        np.testing.assert_array_equal(schemes.base_weights(weighting, sel[perm], members(n), n), w[perm])
    x, deltas = g.normal(size=5), g.normal(size=(n_dev, 5))
    w = schemes.base_weights("count_selected", sel, members(n), n)
    ref = server_update(x, sel, deltas, w, 0.9)
    assert server_update(x, sel[perm], deltas[perm], w[perm], 0.9).tobytes() == ref.tobytes()
