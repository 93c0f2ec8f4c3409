"""Secure aggregation's masking in one pass: a device's update scaled, clipped, rounded to fixed point and
added to its mask in place (edgefed/secagg/fixedpoint.py is the same arithmetic in NumPy, the reference).

The mask arrives as the signed view of its unsigned words (int16, int32 or int64): the sum is formed in
64 bits and stored back truncated, which is addition modulo 2^bits, two's complement being the same bits
as the unsigned words. No temporaries: on a Pi the CNN's 1.7 M coordinates would otherwise take three
fresh 13 MB arrays per round.
"""

import numpy as np
from numba import njit

from edgefed.kernels import JIT


@njit(**JIT)
def add_encoded(update, factor, clip, scale, words):
    """words[i] += round(clip(float64(update[i]) * factor) * scale) mod 2^bits; returns how many
    coordinates the clip cut. Multiplications only (nothing an FMA could fuse), rint rounds half to even
    as NumPy does."""
    clipped = 0
    for i in range(update.shape[0]):
        v = np.float64(update[i]) * factor
        if v > clip:
            v, clipped = clip, clipped + 1
        elif v < -clip:
            v, clipped = -clip, clipped + 1
        words[i] = np.int64(words[i]) + np.int64(np.rint(v * scale))
    return clipped
