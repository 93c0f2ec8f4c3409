"""Shamir sharing over GF(2^521 - 1) (edgefed/secagg/shamir.py): any threshold of the shares give the
secret back, fewer do not, and bad input is refused."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgefed.secagg.shamir import PRIME, combine, split


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**256 - 1), st.integers(1, 7), st.data())
def test_any_threshold_of_the_shares_give_the_secret(secret, n, data):
    t = data.draw(st.integers(1, n))
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    shares = split(secret, n, t, rng.getrandbits)
    assert [x for x, _ in shares] == list(range(1, n + 1)) and all(0 <= y < PRIME for _, y in shares)
    for subset in itertools.combinations(shares, t):
        assert combine(subset, t) == secret
        assert combine(list(reversed(subset)), t) == secret


def test_fewer_shares_say_nothing_and_bad_input_is_refused():
    rng = random.Random(1)
    secret = 123456789
    shares = split(secret, 5, 3, rng.getrandbits)
    assert combine(shares[:2], 2) != secret  # two points of a degree-2 polynomial: another line's value
    with pytest.raises(ValueError, match="2 shares cannot recover a secret that needs 3"):
        combine(shares[:2], 3)
    with pytest.raises(ValueError, match="distinct x"):
        combine([shares[0], shares[0], shares[1]], 3)
    with pytest.raises(ValueError, match=r"threshold 6 must lie in 1..5"):
        split(secret, 5, 6, rng.getrandbits)
    with pytest.raises(ValueError, match="must lie in"):
        split(PRIME, 5, 3, rng.getrandbits)
    # the same secret under two draws: the shares differ, the secret does not
    other = split(secret, 5, 3, random.Random(2).getrandbits)
    assert other != shares and combine(other[2:], 3) == secret
