"""Random streams keyed by (seed, purpose, round, device).

Every random draw in edgefed comes from one of these streams, so a draw never depends on which rank made it,
in which order devices were processed, or whether the run was resumed. No code touches a global RNG.
"""

from enum import IntEnum

import numpy as np

from edgefed.kernels.random import seed_sequence_state


class Purpose(IntEnum):
    """What a stream is for; the value is part of the key, so never renumber."""

    DATA_COUNT = 1    # samples per device
    DATA_GLOBAL = 2   # parameters shared by all devices (IID SYNTHETIC's W, b)
    DATA_DEVICE = 3   # one device's samples
    SELECT = 4        # which devices take part in a round
    LOCAL = 5         # minibatches and oracle noise of one device's local work in one round
    INIT = 6          # initial model parameters
    CONTROL = 7       # SCAFFOLD option I / gradient init oracle calls
    TRACE = 8         # the completed fraction a trace gives a device in a round
    TRACE_ASSIGN = 9  # which trace a device follows
    TRACE_DROP = 10   # uploads lost while recording a trace
    COMPRESS = 11     # int8's stochastic rounding: a device's report, or (no device) the server's broadcast
    ASYNC_SELECT = 12  # buffered async: the n-th device drawn to start a task (round = n)
    SECAGG_GRAPH = 13  # secure aggregation: the ring order of a round's selected devices (SecAgg+'s graph)
    SECAGG_KEYS = 14  # secure aggregation's test mode ([secagg] key_source = "seeded"): a device's key material
    CANDIDATES = 15  # a selection policy's candidate draw (FedCS, power of choice) of a round
    EXPLOIT = 16  # Oort's draw among the explored devices above the cut-off
    EXPLORE = 17  # Oort's draw among the unexplored devices (device 0: the uniform top-up)
    PRIVACY = 18  # differential privacy's Gaussian noise: the server's (no device) or a device's share
    PRIVACY_QUANTILE = 19  # adaptive clipping: the noise on the count of unclipped updates of a round
    EVALUATION_SAMPLE = 20  # [log] eval_devices: the fixed sample of devices the metrics are taken on
    DIRICHLET_REDRAW = 21  # data.partition = "dirichlet"'s redraw a (round = a >= 1) of label c's shares
    # (device = c), when a device got fewer than data.min_partition_size (the first draw is DATA_DEVICE's)
    WIDTH = 22  # FjORD: the width each local step of a device's round trains ([submodel] method = "fjord")


def seed_sequence(seed: int, purpose: Purpose, round_idx: int = 0, device_id: int | None = None):
    """Rounds are 1-based (0 = before training); device ids are 0-based, shifted so `None` stays distinct."""
    device_key = 0 if device_id is None else int(device_id) + 1
    return np.random.SeedSequence(entropy=int(seed), spawn_key=(int(purpose), int(round_idx), device_key))


def generator(seed: int, purpose: Purpose, round_idx: int = 0, device_id: int | None = None) -> np.random.Generator:
    """A numpy Generator (PCG64) for one (seed, purpose, round, device) stream."""
    return np.random.Generator(np.random.PCG64(seed_sequence(seed, purpose, round_idx, device_id)))


_PCG_MULT = 0x2360ED051FC65DA44385DF649FCCF645  # PCG64's 128-bit LCG multiplier
_M128 = (1 << 128) - 1


def device_generators(seed: int, purpose: Purpose, device_ids):
    """(device, its Generator) for each id, drawing as generator(seed, purpose, 0, device) does, at a fraction
    of the cost for many devices: one PCG64 set to each stream in turn, its state seeded as NumPy seeds it
    (PCG64's srandom from SeedSequence's four words, the words computed in a kernel). The Generator is the
    same object every time: draw from it before taking the next."""
    bits = np.random.PCG64(0)
    g = np.random.Generator(bits)
    run = _words(int(seed))
    head = run + [0] * (4 - len(run)) + _words(int(purpose)) + _words(0)
    pool, words = np.zeros(4, np.uint64), np.zeros(4, np.uint64)
    for k in device_ids:
        seed_sequence_state(np.array(head + _words(int(k) + 1), np.uint64), pool, words)
        initstate = (int(words[0]) << 64) | int(words[1])
        inc = (((int(words[2]) << 64) | int(words[3])) << 1 | 1) & _M128
        # pcg64_srandom: state 0, a step (0 * mult + inc), += initstate, a step
        state = ((inc + initstate) * _PCG_MULT + inc) & _M128
        bits.state = {"bit_generator": "PCG64", "state": {"state": state, "inc": inc}, "has_uint32": 0,
                      "uinteger": 0}
        yield int(k), g


def stream_words(seed: int, purpose: Purpose, round_idx: int = 0) -> np.ndarray:
    """The SeedSequence entropy words of generator(seed, purpose, round, device), the device's word last and
    left 0 for a kernel to fill with device + 1 (one word: devices below 2^32 - 1)."""
    run = _words(int(seed))
    return np.array(run + [0] * (4 - len(run)) + _words(int(purpose)) + _words(int(round_idx)) + [0], np.uint64)


def kernel_state(seed: int, purpose: Purpose, round_idx: int, device_id: int) -> np.ndarray:
    """A fresh xoshiro256** state (4 x uint64) for the in-kernel generator of one stream: the words
    seed_sequence(seed, purpose, round, device).generate_state(4, uint64) gives, computed in a kernel."""
    run = _words(int(seed))
    spawn = _words(int(purpose)) + _words(int(round_idx)) + _words(int(device_id) + 1)
    state = np.zeros(4, np.uint64)
    seed_sequence_state(np.array(run + [0] * (4 - len(run)) + spawn, np.uint64), np.zeros(4, np.uint64), state)
    if not state.any():  # xoshiro's one forbidden state; SeedSequence makes it astronomically unlikely
        state[0] = 1
    return state


def _words(n: int) -> list[int]:
    """n as little-endian 32-bit words, as SeedSequence reads an integer (0 is one zero word)."""
    if n < 0:
        raise ValueError("stream keys are non-negative")
    out = [n & 0xFFFFFFFF]
    n >>= 32
    while n:
        out.append(n & 0xFFFFFFFF)
        n >>= 32
    return out
