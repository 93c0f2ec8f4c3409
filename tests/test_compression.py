"""Update compression's math (edgefed/compression.py): round trips, error bounds, top-k's exactness and tie
rule, and error feedback's bookkeeping."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefed import compression as comp
from edgefed.rng import Purpose, generator


def test_none_and_fp16_round_trips_and_their_bytes():
    x = np.array([0.1, -2.5, 3e-8, 1e6, -1e6], np.float32)
    none = comp.encode("none", x)
    assert comp.decode(none, np.float32).tobytes() == x.tobytes() and none.nbytes == 20
    half = comp.encode("fp16", x)
    assert half.nbytes == 10
    got = comp.decode(half, np.float32)
    np.testing.assert_array_equal(got[:3], x[:3].astype(np.float16).astype(np.float32))  # nearest float16
    assert got[3] == 65504 and got[4] == -65504  # saturated, never infinite


def test_int8_errors_stay_under_the_scale_and_are_unbiased():
    g = np.random.default_rng(0)
    x = np.concatenate([g.standard_normal(comp.CHUNK), 100 * g.standard_normal(77)]).astype(np.float32)
    enc = comp.encode("int8", x, generator(1, Purpose.COMPRESS, 1, 0))
    scale, q = enc.arrays
    assert q.dtype == np.int8 and scale.dtype == np.float32 and enc.nbytes == x.size + 4 * 2
    per = np.repeat(scale, comp.CHUNK)[:x.size]
    assert np.all(np.abs(comp.decode(enc, np.float32) - x) < per * (1 + 1e-6))
    assert np.abs(q).max() == 127
    # unbiased: the mean of many independent roundings converges on x
    mean = np.mean([comp.decode(comp.encode("int8", x[:200], generator(1, Purpose.COMPRESS, r, 0)), np.float64)
                    for r in range(2000)], axis=0)
    assert np.abs(mean - x[:200]).max() < 4 * scale[0] / np.sqrt(2000)
    # replayable: the same stream, the same bytes; another stream, other bytes
    again = comp.encode("int8", x, generator(1, Purpose.COMPRESS, 1, 0))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(enc.arrays, again.arrays))
    other = comp.encode("int8", x, generator(1, Purpose.COMPRESS, 2, 0))
    assert other.arrays[1].tobytes() != q.tobytes()
    with pytest.raises(ValueError, match="needs the device's generator"):
        comp.encode("int8", x)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=60), st.floats(0.001, 1.0))
def test_topk_keeps_the_largest_magnitudes_ties_to_the_lower_index(values, fraction):
    x = np.array(values, np.float32)  # small integers: many ties
    enc = comp.encode("topk", x, fraction=fraction)
    idx, kept = enc.arrays
    k = comp.topk_count(x.size, fraction)
    order = np.lexsort((np.arange(x.size), -np.abs(x)))  # by magnitude down, then index up
    assert idx.tolist() == sorted(order[:k].tolist())
    np.testing.assert_array_equal(kept, x[idx])
    assert enc.nbytes == 8 * k
    dense = comp.decode(enc, np.float32)
    assert np.count_nonzero(dense[np.setdiff1d(np.arange(x.size), idx)]) == 0


@pytest.mark.parametrize("kind", comp.LOSSY)
def test_error_feedback_sends_everything_in_the_end(kind):
    """The sum of what was decoded plus the last residual is the sum of the true updates."""
    g = np.random.default_rng(3)
    residual = np.zeros(500)
    sent = np.zeros(500)
    total = np.zeros(500)
    for r in range(30):
        update = g.standard_normal(500)
        enc, residual = comp.feedback(kind, update, residual, generator(0, Purpose.COMPRESS, r, 0), fraction=0.05)
        sent += comp.decode(enc, np.float64)
        total += update
    np.testing.assert_allclose(sent + residual, total, rtol=0, atol=1e-9)
    assert np.abs(residual).max() > 0  # lossy: something is still owed


def test_an_unknown_kind_is_named():
    with pytest.raises(ValueError, match="unknown compression 'zip'; choose from none, fp16, int8, topk"):
        comp.encode("zip", np.zeros(3))


def test_a_diverged_update_stays_non_finite_and_top_k_always_sends_k():
    x = np.array([1.0, np.inf, -np.inf, np.nan, 70000.0], np.float32)
    half = comp.decode(comp.encode("fp16", x), np.float32)
    assert half[1] == np.inf and half[2] == -np.inf and np.isnan(half[3]) and half[4] == 65504
    for k_share, kept in ((0.4, [1, 2]), (0.6, [1, 2, 3])):  # inf, inf, then NaN ranked the largest
        enc = comp.encode("topk", x, fraction=k_share)
        assert enc.arrays[0].tolist() == kept and enc.nbytes == comp.Codec("topk", k_share).nbytes(5, np.float32)
    many = np.full(10, np.nan, np.float32)
    assert comp.encode("topk", many, fraction=0.3).arrays[0].tolist() == [0, 1, 2]
    assert comp.topk_count(100, 0.07) == 7  # not 8: 0.07 * 100 is 7.000000000000001 in floats


def test_payload_bytes_round_trip_in_the_layout_of_each_kind():
    g = np.random.default_rng(5)
    x = g.normal(size=5000).astype(np.float64)
    for kind in comp.KINDS:
        codec = comp.Codec(kind, 0.01)
        enc = codec.encode(x, generator(0, Purpose.COMPRESS, 1, 0))
        raw = np.zeros(codec.nbytes(x.size, x.dtype), np.uint8)
        codec.to_bytes(enc, raw)
        back = codec.from_bytes(raw, x.size, x.dtype)
        assert comp.decode(back, x.dtype).tobytes() == comp.decode(enc, x.dtype).tobytes()
        with pytest.raises(ValueError, match="bytes for a slot of"):
            codec.to_bytes(enc, raw[:-1])
