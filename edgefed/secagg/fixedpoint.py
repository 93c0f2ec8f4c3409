"""Fixed-point encoding for secure aggregation: masks add in Z_{2^bits}, so each coordinate travels as an
integer there, and the sum of n devices' encodings must decode to the sum of their values.

A coordinate v is clipped to [-clip, clip] and sent as round(v s) mod 2^bits with the scale
s = (M - n/2) / (n clip), M = 2^(bits-1) - 1 (2^63 - 2^11 for 64 bits, the largest such float64): n rounded
clipped values sum to at most M in magnitude, so their encodings' sum mod 2^bits, read as a signed
integer, is the sum of the rounded values exactly. The decoded
sum differs from the sum of the clipped values by at most n / (2 s) per coordinate (each rounding to the
nearest integer is off by at most 1/2).
"""

from __future__ import annotations

import numpy as np

BITS = (16, 32, 64)


def scale(n: int, clip: float, bits: int) -> float:
    """s: the largest scale at which n rounded values in [-clip, clip] cannot overflow a signed bits-bit sum."""
    if bits not in BITS:
        raise ValueError(f"bits = {bits}: choose one of {', '.join(map(str, BITS))}")
    if n < 1 or not clip > 0:
        raise ValueError("fixed point needs n >= 1 devices and a positive clip")
    top = min(2.0 ** (bits - 1) - 1, 2.0 ** (bits - 1) - 2.0 ** (bits - 53))  # exact in float64
    return (top - n / 2) / (n * clip)  # each rounding may add 1/2


def rounding_bound(n: int, clip: float, bits: int) -> float:
    """The most the decoded sum of n values can differ, per coordinate, from the sum of the clipped values."""
    return n / (2.0 * scale(n, clip, bits))


def encode(values: np.ndarray, n: int, clip: float, bits: int) -> np.ndarray:
    """values (float) as unsigned integers of `bits` bits: round(clip(v) s) mod 2^bits."""
    s = scale(n, clip, bits)
    v = np.array(values, np.float64)  # one working copy, rounded in place
    np.clip(v, -clip, clip, out=v)
    v *= s
    np.rint(v, out=v)
    return v.astype(np.int64).astype(np.dtype(f"uint{bits}"))  # two's complement: a negative q wraps mod 2^bits


def decode_sum(total: np.ndarray, n: int, clip: float, bits: int) -> np.ndarray:
    """The float64 sum of the n values whose encodings (and masks that cancel) add up to total, mod 2^bits:
    unsigned arrays of that width wrap as they add."""
    signed = total.view(np.dtype(f"int{bits}")).astype(np.float64)
    return signed / scale(n, clip, bits)
