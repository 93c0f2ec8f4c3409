"""Fixed-point encoding for secure aggregation (edgefed/secagg/fixedpoint.py): the sum of n encodings,
masks or not, decodes to the sum of the clipped values within the stated bound, and never overflows."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefed.secagg import fixedpoint as fp


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 50), st.sampled_from([16, 32, 64]), st.floats(0.01, 100.0), st.integers(0, 2**32))
def test_the_sum_of_encodings_decodes_within_the_bound(n, bits, clip, seed):
    g = np.random.default_rng(seed)
    values = g.uniform(-2 * clip, 2 * clip, (n, 7))  # some beyond the clip
    total = np.zeros(7, np.dtype(f"uint{bits}"))
    masks = g.integers(0, 2**bits, (n, 7), dtype=np.uint64).astype(np.dtype(f"uint{bits}"))
    with np.errstate(over="ignore"):
        for k in range(n):  # each device adds a mask; the masks' sum is taken off again, as recovery does
            total = total + (fp.encode(values[k], n, clip, bits) + masks[k])
        for k in range(n):
            total = total - masks[k]
    want = np.clip(values, -clip, clip).sum(axis=0)
    got = fp.decode_sum(total, n, clip, bits)
    assert np.abs(got - want).max() <= fp.rounding_bound(n, clip, bits) * (1 + 1e-9) + 1e-12 * abs(want).max()


def test_the_extremes_do_not_overflow_and_bad_settings_are_refused():
    n, clip, bits = 10, 1.0, 16
    top = np.full(3, clip)
    total = np.zeros(3, np.uint16)
    for _ in range(n):
        total = total + fp.encode(top, n, clip, bits)
    np.testing.assert_allclose(fp.decode_sum(total, n, clip, bits), n * clip, atol=fp.rounding_bound(n, clip, bits))
    assert fp.rounding_bound(100, 1.0, 32) < 3e-6
    with pytest.raises(ValueError, match="bits = 24: choose one of 16, 32, 64"):
        fp.scale(3, 1.0, 24)
    with pytest.raises(ValueError, match="positive clip"):
        fp.encode(top, 3, 0.0, 32)
