"""Fixed-point encoding for secure aggregation (edgefed/secagg/fixedpoint.py): the sum of n encodings,
masks or not, decodes to the sum of the clipped values within the stated bound, and never overflows."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefed.kernels.fixed_point import add_encoded
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


@pytest.mark.parametrize("bits", fp.BITS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_masking_kernel_is_the_reference_encoding_added_to_the_mask(bits, dtype):
    """kernels/fixed_point.py in one pass = NumPy's encode of factor * update, added modulo 2^bits."""
    g = np.random.default_rng(bits)
    update = g.uniform(-3, 3, 2001).astype(dtype)
    update[:3] = [0.5 / 1.7, -2.5, 3.0]  # a tie for rint, and values past the clip
    word = np.dtype(f"<u{bits // 8}")
    mask = g.integers(0, 2 ** min(bits, 63), update.size, dtype=np.uint64).astype(word)
    mask[:2] = np.iinfo(word).max  # wraps on any positive addend
    n, clip, factor = 5, 4.0, 1.7
    expect = fp.encode(update.astype(np.float64) * factor, n, clip, bits).astype(word) + mask
    words = mask.copy()
    clipped = add_encoded(update, factor, clip, fp.scale(n, clip, bits), words.view(f"<i{bits // 8}"))
    np.testing.assert_array_equal(words, expect)
    assert clipped == np.count_nonzero(np.abs(update.astype(np.float64) * factor) > clip) > 0
