"""Every aggregation rule splits as p_k = G a_k: a_k from what device k knows of itself, G from metadata."""

import numpy as np
from hypothesis import given, settings, strategies as st

from edgefed.participation import schemes


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(schemes.WEIGHTINGS), st.sampled_from(sorted(schemes.SCHEMES)),
       st.lists(st.tuples(st.integers(1, 500), st.integers(1, 30), st.integers(0, 30), st.sampled_from([1.0, 1.7, 3.0]),
                          st.booleans(), st.booleans(), st.booleans()), min_size=2, max_size=14),
       st.booleans())
def test_every_rule_is_a_common_factor_times_what_the_device_knows(weighting, scheme, rows, surplus):
    """As the engine forms them: selected devices among an active federation, some late; with over-selection
    (surplus) the weights are over the devices that were not late."""
    n_train = np.array([r[0] for r in rows], np.int64)
    chosen = np.array([r[4] or i == 0 for i, r in enumerate(rows)])
    active = np.flatnonzero(chosen | np.array([r[5] for r in rows]))
    selected = np.flatnonzero(chosen)
    late = np.array([r[6] for r in rows])[selected]
    budgets = np.array([r[1] for r in rows], np.int64)[selected]
    steps = np.where(late, 0, np.minimum([r[2] for r in rows], np.array([r[1] for r in rows]))[selected])
    boost = np.array([r[3] for r in rows])[selected]
    pool = ~late if surplus else np.ones(selected.size, bool)
    p = np.zeros(selected.size)
    if pool.any():
        federation = schemes.Federation(np.isin(np.arange(n_train.size), active), n_train)
        p[pool] = schemes.coefficients(weighting, scheme, selected[pool], federation, n_train, steps[pool], budgets[pool])
    p *= boost
    p[steps == 0] = 0.0
    a = schemes.device_factors(scheme, schemes.prescales(weighting, selected, n_train) * boost, steps, budgets)
    applied = steps > 0  # the survivors: a late device or one without work sends nothing
    g = schemes.server_factor(p[applied], a[applied])
    np.testing.assert_allclose(p[applied], g * a[applied], rtol=1e-12, atol=1e-15)


def test_the_device_factor_of_each_rule():
    steps, budgets, c = np.array([0, 2, 4]), np.array([4, 4, 4]), np.array([1.0, 2.0, 0.5])
    assert schemes.device_factors("A", c, steps, budgets).tolist() == [0.0, 0.0, 0.5]
    assert schemes.device_factors("C", c, steps, budgets).tolist() == [0.0, 4.0, 0.5]
    assert schemes.device_factors("fednova", c, steps, budgets).tolist() == [0.0, 1.0, 0.125]
    assert schemes.prescales("count_selected", np.array([0, 2]), np.array([10, 30, 50])).tolist() == [1 / 3, 5 / 3]
    assert schemes.server_factor(np.zeros(2), np.zeros(2)) == 0.0
