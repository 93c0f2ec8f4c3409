"""xoshiro256** inside kernels: the generator state is a uint64[4] array owned by the caller.

Passing the state in (as pynndescent does) keeps kernels free of Numba's global RNG, and lets a device's
local work be split into chunks (deadline mode) without changing a single draw.
"""

import numpy as np
from numba import njit

from edgefed.kernels import JIT

_MASK32 = np.uint64(0xFFFFFFFF)
_TWO32 = np.uint64(1 << 32)


@njit(inline="always", **JIT)
def _rotl(x, k):
    return (x << np.uint64(k)) | (x >> np.uint64(64 - k))


@njit(inline="always", **JIT)
def next_u64(state):
    s0, s1, s2, s3 = state[0], state[1], state[2], state[3]
    result = _rotl(s1 * np.uint64(5), 7) * np.uint64(9)
    t = s1 << np.uint64(17)
    s2 ^= s0
    s3 ^= s1
    s1 ^= s2
    s0 ^= s3
    s2 ^= t
    s3 = _rotl(s3, 45)
    state[0], state[1], state[2], state[3] = s0, s1, s2, s3
    return result


@njit(inline="always", **JIT)
def bounded(state, m):
    """Uniform integer in [0, m) for 0 < m < 2**32, unbiased (Lemire's multiply-and-reject)."""
    mm = np.uint64(m)
    prod = (next_u64(state) >> np.uint64(32)) * mm
    low = prod & _MASK32
    if low < mm:
        threshold = (_TWO32 - mm) % mm
        while low < threshold:
            prod = (next_u64(state) >> np.uint64(32)) * mm
            low = prod & _MASK32
    return np.int64(prod >> np.uint64(32))


@njit(inline="always", **JIT)
def uniform(state):
    """Uniform float64 in [0, 1) with 53 random bits."""
    return np.float64(next_u64(state) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@njit(inline="always", **JIT)
def normal(state):
    """Standard normal by Box-Muller (one draw per call, so the stream has no hidden cached value)."""
    u1 = 1.0 - uniform(state)
    u2 = uniform(state)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


@njit(inline="always", **JIT)
def draw_batch(state, perm, n, b):
    """Make perm[:b] a uniform random b-subset of perm[:n] by a partial Fisher-Yates shuffle, in place."""
    for i in range(b):
        j = i + bounded(state, n - i)
        tmp = perm[i]
        perm[i] = perm[j]
        perm[j] = tmp


_M32 = np.uint64(0xFFFFFFFF)


@njit(inline="always", **JIT)
def _hashmix(value, h):
    value ^= h
    h = (h * np.uint64(0x931E8875)) & _M32
    value = (value * h) & _M32
    return value ^ (value >> np.uint64(16)), h


@njit(inline="always", **JIT)
def _mix(x, y):
    r = (np.uint64(0xCA01F9DD) * x - np.uint64(0x4973F715) * y) & _M32
    return r ^ (r >> np.uint64(16))


@njit(**JIT)
def seed_sequence_state(entropy, pool, out):
    """out (uint64[n]) <- numpy's SeedSequence(...).generate_state(n, uint64) for the assembled entropy words
    (uint64 holding uint32 values: the run entropy zero-padded to 4 words, then the spawn key's words);
    pool: uint64[4] scratch (passed in: an array made in here costs a second of compilation on a cold start).

    NumPy's own SeedSequence costs ~40 us per stream, a fifth of a simulated round of ten devices; this is
    its algorithm (pool of 4, hashmix / mix constants of numpy.random.bit_generator) at ~1 us, checked
    against NumPy in the tests.
    """
    h = np.uint64(0x43B0D7E5)
    for i in range(4):
        pool[i], h = _hashmix(entropy[i] if i < entropy.shape[0] else np.uint64(0), h)
    for i_src in range(4):
        for i_dst in range(4):
            if i_src != i_dst:
                v, h = _hashmix(pool[i_src], h)
                pool[i_dst] = _mix(pool[i_dst], v)
    for i_src in range(4, entropy.shape[0]):
        for i_dst in range(4):
            v, h = _hashmix(entropy[i_src], h)
            pool[i_dst] = _mix(pool[i_dst], v)
    h = np.uint64(0x8B51F9DD)
    for i in range(out.shape[0]):
        words = np.uint64(0)
        for half in range(2):
            v = pool[(2 * i + half) % 4] ^ h
            h = (h * np.uint64(0x58F38DED)) & _M32
            v = (v * h) & _M32
            v ^= v >> np.uint64(16)
            words |= v << np.uint64(32 * half)
        out[i] = words
