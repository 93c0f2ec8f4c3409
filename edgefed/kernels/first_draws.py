"""The first draw of many devices' NumPy streams in one pass, bit for bit as NumPy draws it.

A device's sample count is one lognormal or Pareto draw from its own stream, generator(seed, DATA_COUNT, 0, k).
Built one Generator at a time that costs ~6 us a device, a minute at ten million. Here each stream's state is
seeded as NumPy seeds PCG64 (SeedSequence words, pcg64_srandom), stepped once, and its first output put through
NumPy's ziggurat (the tables Numba ported from NumPy's ziggurat_constants.h) and the same libm exp/expm1.
The ziggurat's first try accepts ~99 % of draws; the rest need more outputs and are left to NumPy itself
(`done` False), so every count is NumPy's.
"""

import math

import numpy as np
from numba import njit
from numba.np.random._constants import ke_double, ki_double, we_double, wi_double

from edgefed.kernels import JIT
from edgefed.kernels.random import seed_sequence_state

LOGNORMAL, PARETO = 0, 1

_M32 = np.uint64(0xFFFFFFFF)
_MULT_HI = np.uint64(0x2360ED051FC65DA4)  # PCG64's 128-bit LCG multiplier, high and low words
_MULT_LO = np.uint64(0x4385DF649FCCF645)
_KI, _WI = np.asarray(ki_double, np.uint64), np.asarray(wi_double, np.float64)
_KE, _WE = np.asarray(ke_double, np.uint64), np.asarray(we_double, np.float64)


@njit(inline="always", **JIT)
def _mul_full(a, b):
    """(high, low) words of the 128-bit product of two uint64."""
    a0, a1 = a & _M32, a >> np.uint64(32)
    b0, b1 = b & _M32, b >> np.uint64(32)
    low = a0 * b0
    mid1 = a1 * b0 + (low >> np.uint64(32))
    mid2 = a0 * b1 + (mid1 & _M32)
    return a1 * b1 + (mid1 >> np.uint64(32)) + (mid2 >> np.uint64(32)), (mid2 << np.uint64(32)) | (low & _M32)


@njit(inline="always", **JIT)
def _add(a_hi, a_lo, b_hi, b_lo):
    lo = a_lo + b_lo
    return a_hi + b_hi + np.uint64(1 if lo < a_lo else 0), lo


@njit(inline="always", **JIT)
def _step(s_hi, s_lo, inc_hi, inc_lo):
    """state * multiplier + inc, mod 2^128."""
    hi, lo = _mul_full(s_lo, _MULT_LO)
    hi += s_hi * _MULT_LO + s_lo * _MULT_HI
    return _add(hi, lo, inc_hi, inc_lo)


@njit(inline="always", **JIT)
def _first_output(words):
    """PCG64's first 64-bit output after NumPy's seeding from SeedSequence words (4 x uint64)."""
    init_hi, init_lo = words[0], words[1]
    inc_hi = (words[2] << np.uint64(1)) | (words[3] >> np.uint64(63))
    inc_lo = (words[3] << np.uint64(1)) | np.uint64(1)
    s_hi, s_lo = _add(inc_hi, inc_lo, init_hi, init_lo)  # pcg64_srandom: a step from 0 is inc; += initstate
    s_hi, s_lo = _step(s_hi, s_lo, inc_hi, inc_lo)  # its second step
    s_hi, s_lo = _step(s_hi, s_lo, inc_hi, inc_lo)  # the draw's step, then XSL-RR
    x = s_hi ^ s_lo
    rot = s_hi >> np.uint64(58)
    return (x >> rot) | (x << ((np.uint64(64) - rot) & np.uint64(63)))


@njit(**JIT)
def first_draws(entropy, ids, kind, loc, scale, out, done, pool, words):
    """out[i] <- the first draw of device ids[i]'s stream: exp(loc + scale * z) with z NumPy's standard normal
    (kind LOGNORMAL), or expm1(e / scale) with e its standard exponential (kind PARETO, NumPy's pareto(scale));
    done[i] False where the ziggurat's first try rejects, or where the device's key takes two words (ids[i] + 1
    >= 2^32, which SeedSequence splits): NumPy draws those. entropy: the stream key's words with a last slot
    for the device word; pool, words: uint64[4] scratch."""
    last = entropy.shape[0] - 1
    for i in range(ids.shape[0]):
        if ids[i] + 1 >= 4294967296:
            done[i] = False
            continue
        entropy[last] = np.uint64(ids[i] + 1)
        seed_sequence_state(entropy, pool, words)
        r = _first_output(words)
        if kind == LOGNORMAL:
            idx = np.int64(r & np.uint64(0xFF))
            r >>= np.uint64(8)
            rabs = (r >> np.uint64(1)) & np.uint64(0x000FFFFFFFFFFFFF)
            z = np.float64(rabs) * _WI[idx]
            if r & np.uint64(1):
                z = -z
            done[i] = rabs < _KI[idx]
            out[i] = math.exp(loc + scale * z)
        else:
            r >>= np.uint64(3)
            idx = np.int64(r & np.uint64(0xFF))
            r >>= np.uint64(8)
            done[i] = r < _KE[idx]
            out[i] = math.expm1(np.float64(r) * _WE[idx] / scale)
