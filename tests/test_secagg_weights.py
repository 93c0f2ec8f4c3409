"""Every aggregation rule splits as p_k = G a_k: a_k from what device k knows of itself, G from metadata."""

import numpy as np
from hypothesis import given, settings, strategies as st

from edgefed.participation import schemes


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(schemes.WEIGHTINGS), st.sampled_from(sorted(schemes.SCHEMES)),
       st.lists(st.tuples(st.integers(1, 500), st.integers(1, 30), st.integers(0, 30), st.sampled_from([1.0, 1.7, 3.0])),
                min_size=1, max_size=12), st.integers(0, 5))
def test_every_rule_is_a_common_factor_times_what_the_device_knows(weighting, scheme, rows, extra):
    n_train = np.array([r[0] for r in rows] + [37] * extra, np.int64)
    selected = np.arange(len(rows))
    active = np.arange(n_train.size)
    budgets = np.array([r[1] for r in rows], np.int64)
    steps = np.minimum([r[2] for r in rows], budgets)
    boost = np.array([r[3] for r in rows])
    p = schemes.coefficients(weighting, scheme, selected, active, n_train, steps, budgets) * boost
    p[steps == 0] = 0.0
    a = schemes.device_factors(scheme, schemes.prescales(weighting, selected, n_train) * boost, steps, budgets)
    applied = steps > 0  # the survivors: a device with no work sends nothing
    g = schemes.server_factor(p[applied], a[applied])
    np.testing.assert_allclose(p[applied], g * a[applied], rtol=1e-12, atol=1e-15)


def test_the_device_factor_of_each_rule():
    steps, budgets, c = np.array([0, 2, 4]), np.array([4, 4, 4]), np.array([1.0, 2.0, 0.5])
    assert schemes.device_factors("A", c, steps, budgets).tolist() == [0.0, 0.0, 0.5]
    assert schemes.device_factors("C", c, steps, budgets).tolist() == [0.0, 4.0, 0.5]
    assert schemes.device_factors("fednova", c, steps, budgets).tolist() == [0.0, 1.0, 0.125]
    assert schemes.prescales("count_selected", np.array([0, 2]), np.array([10, 30, 50])).tolist() == [1 / 3, 5 / 3]
    assert schemes.server_factor(np.zeros(2), np.zeros(2)) == 0.0
