"""Secure aggregation with pairwise masks (Bonawitz et al., CCS 2017) over the sparse neighbourhoods of
SecAgg+ (Bell et al., CCS 2020), one round at a time: the device's side (`Client`) and the server's
(`unmask`), pure (no transport, no files). docs/design.md 2.15 has the protocol as edgefed runs it.

A round's selected devices S, in ascending id, sit on a ring in a seeded random order; each is linked to the
k nearest on either side (k/2 each way, the Harary graph SecAgg+ uses; all of S when k >= |S| - 1). Device
i's *holders* are its neighbours and itself: they get the t-of-(k+1) Shamir shares of its mask key s_i^SK and
of its self-mask seed b_i. Its masked input is

    y_i = q_i + PRG(b_i) + sum_{j in N(i), j > i} PRG(s_ij) - sum_{j in N(i), j < i} PRG(s_ij)  (mod 2^bits)

with q_i its fixed-point update and s_ij = HKDF(X25519(s_i^SK, s_j^PK)). Over the survivors U the pairwise
masks between survivors cancel; for each survivor the server rebuilds b_i from t shares (checked against
the commitment the device published) and for each dropped neighbour j its s_j^SK (checked against s_j^PK),
and removes what remains. An honest device reveals, for each device whose shares it holds, b for a
survivor and s^SK for a dropout, never both.

Messages are NumPy records (KEYS, SHARE, REVEAL), the same bytes in the simulator and over MPI; a
client keeps the seconds it spent on the protocol (spent_s), and a reveal carries its holder's, for the
run log.
"""

from __future__ import annotations

import functools
import math
import secrets
import time
from dataclasses import dataclass, field

import numpy as np

from edgefed.errors import SecAggError, Unrecoverable
from edgefed.kernels.fixed_point import add_encoded
from edgefed.rng import Purpose, generator
from edgefed.secagg import crypto, fixedpoint, shamir

KEY_SOURCES = ("os", "seeded")  # the OS's CSPRNG, or the test mode's stream on (seed, SECAGG_KEYS, round, device)
FIELD_BYTES = (shamir.PRIME.bit_length() + 7) // 8  # 66: one share's y
SELF, KEY = 0, 1  # what a revealed share rebuilds: a survivor's self-mask seed b, a dropout's mask key s^SK

KEYS = np.dtype([("device", "<i8"), ("c_pk", "u1", (32,)), ("s_pk", "u1", (32,)), ("b_commit", "u1", (32,))],
                align=True)
SHARE = np.dtype([("sender", "<i8"), ("receiver", "<i8"), ("sealed", "u1", (2 * FIELD_BYTES + crypto.TAG_BYTES,))],
                 align=True)
REVEAL = np.dtype([("holder", "<i8"), ("owner", "<i8"), ("kind", "u1"), ("y", "u1", (FIELD_BYTES,)),
                   ("spent_s", "<f4")], align=True)


def degree(neighbours: int) -> int:
    """The neighbours the ring gives a device asked for `neighbours`: ceil(k/2) either way, so an odd k
    counts as the even number above it."""
    return 2 * math.ceil(int(neighbours) / 2)


def linked(neighbours: int | None, n: int) -> int:
    """k, the neighbours each of n devices has: `degree`, or all the others when that covers them (or
    neighbours is None)."""
    return max(n - 1, 0) if neighbours is None else min(degree(neighbours), max(n - 1, 0))


def default_threshold(k: int) -> int:
    """ceil(2k/3) + 1 of the k + 1 shares (SecAgg+'s choice), never more than there are."""
    return min(k + 1, math.ceil(2 * k / 3) + 1)


@dataclass(frozen=True)
class RoundSetup:
    """What every party knows of a round before it starts: who is in it, the graph, the threshold, the code."""

    round_idx: int
    selected: np.ndarray  # ascending device ids
    neighbours: dict  # device -> its neighbours (ascending, itself excluded)
    threshold: int
    bits: int
    clip: float
    dim: int
    # [submodel]: device -> the positions its slice holds (nested slices; None: every device the whole vector).
    # A device masks only its slice, and a pair's masks only the slice both hold (the narrower's), so each
    # coordinate's masks cancel among the devices that hold it: the sum of each slice among its holders
    slices: dict | None = None
    share_x: dict = field(init=False, repr=False)  # owner -> {holder: the x of the share it holds}
    _kept: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # kept(), once a slice

    def __post_init__(self):
        # who holds a device's shares, in share order (x = position + 1): its neighbours and itself
        object.__setattr__(self, "share_x", {
            owner: {int(h): x for x, h in enumerate(np.union1d(near, [owner]), start=1)}
            for owner, near in self.neighbours.items()})

    @property
    def n(self) -> int:
        return int(self.selected.size)

    def kept(self, *devices: int) -> np.ndarray | None:
        """(words,) bool: the words a mask of these devices covers, the slice all of them hold and the clip
        count; None: every word (no submodels)."""
        if self.slices is None:
            return None
        held = min((self.slices[int(k)] for k in devices), key=len)
        if id(held) not in self._kept:  # (one mask a width, not one a pair)
            keep = np.zeros(self.words, bool)
            keep[held] = keep[-1] = True
            self._kept[id(held)] = (held, keep)
        return self._kept[id(held)][1]

    def restricted(self, stream: np.ndarray, *devices: int) -> np.ndarray:
        """The stream with the words outside `kept(devices)` zeroed, in place."""
        keep = self.kept(*devices)
        if keep is not None:
            stream[~keep] = 0
        return stream

    def holders(self, device: int) -> list[int]:
        """Who holds device's shares, in share order: its neighbours and itself."""
        return list(self.share_x[device])

    @property
    def word(self) -> np.dtype:
        return np.dtype(f"<u{self.bits // 8}")

    @property
    def words(self) -> int:
        """A masked input's length: the update's dim coordinates, then how many of them the clip cut."""
        return self.dim + 1

    @property
    def count_cap(self) -> int:
        """The most clipped coordinates one device's count says (so n counts never wrap a signed word)."""
        return (2 ** (self.bits - 1) - 1) // max(self.n, 1)


def round_setup(seed: int, round_idx: int, selected, neighbours: int | None, threshold: int | None, bits: int,
                clip: float, dim: int, slices: dict | None = None) -> RoundSetup:
    """The round's graph, drawn from (seed, SECAGG_GRAPH, round); k and t shrink to what |S| allows (a round
    with fewer selected devices than k + 1, after departures, links them all). slices: [submodel]'s, each
    selected device's positions (RoundSetup.slices)."""
    selected = np.sort(np.asarray(selected, np.int64))
    n = selected.size
    k = linked(neighbours, n)
    t = default_threshold(k) if threshold is None else min(int(threshold), k + 1)
    ring = selected[generator(seed, Purpose.SECAGG_GRAPH, round_idx).permutation(n)]
    links = {}
    for p, device in enumerate(ring):
        if k >= n - 1:
            near = selected[selected != device]
        else:
            near = np.unique([ring[(p + step) % n] for h in range(1, k // 2 + 1) for step in (h, -h)])
        links[int(device)] = np.asarray(near, np.int64)
    return RoundSetup(round_idx, selected, links, t, bits, clip, dim, slices)


def slices_of(positions: dict | None, selected, widths) -> dict | None:
    """{device: the positions its width holds} ([submodel]), or None: every device the whole vector."""
    if positions is None or widths is None:
        return None
    return {int(k): positions[float(w)] for k, w in zip(selected, widths)}


class Randomness:
    """Where a device's key material comes from: the OS's CSPRNG, or (test mode) its stream on
    (seed, SECAGG_KEYS, round, device), which makes every key and share of a run reproducible."""

    def __init__(self, source: str, seed: int, round_idx: int, device: int):
        self._rng = generator(seed, Purpose.SECAGG_KEYS, round_idx, device) if source == "seeded" else None

    def bytes(self, n: int) -> bytes:
        return secrets.token_bytes(n) if self._rng is None else self._rng.bytes(n)

    def bits(self, n: int) -> int:
        return secrets.randbits(n) if self._rng is None else int.from_bytes(self._rng.bytes((n + 7) // 8), "little") >> (-n % 8)


def _info(purpose: str, round_idx: int, a: int, b: int) -> bytes:
    return f"edgefed secagg {purpose} round {round_idx} {a} {b}".encode()


def _field(value: int) -> np.ndarray:
    return np.frombuffer(value.to_bytes(FIELD_BYTES, "little"), np.uint8)


def _integer(raw) -> int:
    return int.from_bytes(bytes(raw), "little")


@functools.lru_cache(maxsize=4)
def _zeros(nbytes: int) -> bytes:
    return bytes(nbytes)  # what ChaCha20 encrypts to give its keystream; shared, never written


class Expander:
    """Masks from seeds into one reused buffer: `mask(seed)` is setup.words words of setup.bits, valid until
    the next call."""

    def __init__(self, setup: RoundSetup):
        self._zeros = _zeros(setup.words * setup.word.itemsize)
        self._out = np.empty(len(self._zeros) + crypto.STREAM_SLACK, np.uint8)
        self._view = self._out[:len(self._zeros)].view(setup.word)

    def mask(self, seed: bytes) -> np.ndarray:
        crypto.expand_into(seed, self._zeros, self._out)
        return self._view


def pair_seed(setup: RoundSetup, private: bytes, peer_public: bytes, i: int, j: int) -> bytes:
    return crypto.agree(private, peer_public, _info("mask", setup.round_idx, min(i, j), max(i, j)))


class Client:
    """One selected device's side of one round: keys, shares out, shares in, the mask, the reveal."""

    def __init__(self, setup: RoundSetup, device: int, randomness: Randomness):
        self.setup, self.device = setup, int(device)
        self.spent_s = 0.0
        t0 = time.perf_counter()
        self._c_sk, self._s_sk, self._b = (randomness.bytes(crypto.KEY_BYTES) for _ in range(3))
        self._randomness = randomness
        self._keys = None  # {device: KEYS record} of this device's neighbours and itself
        self._held = {}  # owner -> sealed share (bytes) it sent this device
        self._own = None  # (x, s_sk share y, b share y) of its own secrets
        self._mask = None
        self._revealed = self._masked = False
        self.spent_s += time.perf_counter() - t0

    # -- phase 1: advertise keys ---------------------------------------------------------------------
    def advertise(self) -> np.ndarray:
        t0 = time.perf_counter()
        rec = np.zeros(1, KEYS)
        rec["device"] = self.device
        rec["c_pk"][0] = np.frombuffer(crypto.public_key(self._c_sk), np.uint8)
        rec["s_pk"][0] = np.frombuffer(crypto.public_key(self._s_sk), np.uint8)
        rec["b_commit"][0] = np.frombuffer(crypto.commit(self._b), np.uint8)
        self._spend(t0)
        return rec

    # -- phase 2: shares to the holders, sealed for each --------------------------------------------
    def share(self, keys: np.ndarray) -> np.ndarray:
        """The sealed shares of s^SK and b for every other holder; keys: every selected device's KEYS."""
        t0 = time.perf_counter()
        holders = self.setup.holders(self.device)
        self._keys = _by_device(keys, self.setup, holders)
        t = self.setup.threshold
        s_shares = shamir.split(_integer(self._s_sk), len(holders), t, self._randomness.bits)
        b_shares = shamir.split(_integer(self._b), len(holders), t, self._randomness.bits)
        out = np.zeros(len(holders) - 1, SHARE)
        row = 0
        for holder, (x, s_y), (_, b_y) in zip(holders, s_shares, b_shares):
            holder = int(holder)
            if holder == self.device:
                self._own = (x, s_y, b_y)
                continue
            info = _info("share", self.setup.round_idx, self.device, holder)
            key = crypto.agree(self._c_sk, bytes(self._keys[holder]["c_pk"]), info)
            plain = s_y.to_bytes(FIELD_BYTES, "little") + b_y.to_bytes(FIELD_BYTES, "little")
            out[row]["sender"], out[row]["receiver"] = self.device, holder
            out[row]["sealed"] = np.frombuffer(crypto.seal(key, plain, info), np.uint8)
            row += 1
        self._spend(t0)
        return out

    # -- phase 3: the shares others sent this device -------------------------------------------------
    def receive(self, shares: np.ndarray) -> None:
        """Keep the sealed shares addressed to this device (opened only when the server asks for them)."""
        for rec in shares[shares["receiver"] == self.device]:
            self._held[int(rec["sender"])] = bytes(rec["sealed"])

    def prepare_mask(self) -> None:
        """Expand the mask before the work, so the work's report is one addition away (it does not depend on
        the update; on a deadline the time comes out of the work's budget)."""
        t0 = time.perf_counter()
        setup = self.setup
        expander = Expander(setup)
        mask = setup.restricted(expander.mask(self._b), self.device).copy()
        for j in setup.neighbours[self.device]:
            j = int(j)
            stream = setup.restricted(expander.mask(pair_seed(setup, self._s_sk, bytes(self._keys[j]["s_pk"]),
                                                              self.device, j)), self.device, j)
            if j > self.device:
                mask += stream
            else:
                mask -= stream
        self._mask = mask
        self._spend(t0)

    def masked_input(self, update: np.ndarray, factor: float = 1.0) -> np.ndarray:
        """y_i: the fixed-point encoding of factor * update, then the count of coordinates the clip cut
        (masked like them, so the server learns only the round's total), plus the mask; in the mask's
        own words, once (fixedpoint.encode is the same arithmetic)."""
        t0 = time.perf_counter()
        if self._masked:  # two inputs under one mask would show their difference
            raise SecAggError(f"secure aggregation, round {self.setup.round_idx}: device {self.device} was asked "
                              "for a second masked input")
        self._masked = True
        if self._mask is None:
            self.prepare_mask()
        setup, y = self.setup, self._mask
        signed = y.view(f"<i{setup.word.itemsize}")
        clipped = add_encoded(update, float(factor), float(setup.clip),
                              fixedpoint.scale(setup.n, setup.clip, setup.bits), signed[:-1])
        y[-1:] += setup.word.type(min(clipped, setup.count_cap))
        self._spend(t0)
        return y

    # -- phase 4: reveal ---------------------------------------------------------------------------
    def reveal(self, survivors) -> np.ndarray:
        """For every device whose shares this one holds: b's share for a survivor, s^SK's for a dropout."""
        t0 = time.perf_counter()
        if self._revealed:
            raise SecAggError(f"secure aggregation, round {self.setup.round_idx}: device {self.device} was asked to "
                              "reveal shares twice (a second survivor set could unmask an update)")
        self._revealed = True
        survivors = set(int(k) for k in survivors)
        out = np.zeros(len(self._held) + 1, REVEAL)
        for row, owner in enumerate(sorted([self.device, *self._held])):
            if owner == self.device:
                s_y, b_y = self._own[1], self._own[2]
            else:
                s_y, b_y = self._open(owner)
            kind = SELF if owner in survivors else KEY
            out[row]["holder"], out[row]["owner"], out[row]["kind"] = self.device, owner, kind
            out[row]["y"] = _field(b_y if kind == SELF else s_y)
        out["spent_s"] = self._spend(t0)
        return out

    def _open(self, owner: int) -> tuple[int, int]:
        info = _info("share", self.setup.round_idx, owner, self.device)
        key = crypto.agree(self._c_sk, bytes(self._keys[owner]["c_pk"]), info)
        plain = crypto.open_sealed(key, self._held[owner], info)
        if plain is None:
            raise SecAggError(f"secure aggregation, round {self.setup.round_idx}: the share device {owner} sent "
                              f"device {self.device} fails its authentication (changed on its way, or the keys "
                              "relayed were not the ones advertised)")
        return _integer(plain[:FIELD_BYTES]), _integer(plain[FIELD_BYTES:])

    def _spend(self, t0: float) -> float:
        spent = time.perf_counter() - t0
        self.spent_s += spent
        return spent


def _by_device(keys: np.ndarray, setup: RoundSetup, wanted) -> dict:
    found = {int(rec["device"]): rec for rec in keys}
    missing = [int(k) for k in wanted if int(k) not in found]
    if missing:
        raise SecAggError(f"secure aggregation, round {setup.round_idx}: no keys from device(s) "
                          f"{', '.join(map(str, missing))}")
    return {int(k): found[int(k)] for k in wanted}


def unmask(setup: RoundSetup, keys: np.ndarray, total: np.ndarray, survivors, reveals: np.ndarray) -> np.ndarray:
    """The sum of the survivors' fixed-point updates and clip counts (setup.words words), from the sum of
    their masked inputs (mod 2^bits); `decode` reads it.

    Raises Unrecoverable when some secret has fewer than t shares among the survivors, SecAggError when a
    rebuilt secret does not match what its device published (a share was changed)."""
    survivors = np.sort(np.asarray(survivors, np.int64))
    alive = set(survivors.tolist())
    keys = _by_device(keys, setup, setup.selected)
    shares = {}
    for rec in reveals:
        holder, owner = int(rec["holder"]), int(rec["owner"])
        if holder in alive and holder in setup.share_x.get(owner, ()):
            shares.setdefault((owner, int(rec["kind"])), {})[holder] = _integer(rec["y"])
    total = np.array(total, setup.word)
    t = setup.threshold
    if survivors.size < 2:  # a sum of one device is its update
        raise Unrecoverable(f"secure aggregation, round {setup.round_idx}: {survivors.size} of {setup.n} devices "
                            "survived, and the sum of fewer than 2 would show an update; the round is aborted")

    def secret(owner: int, kind: int) -> int:
        got = shares.get((owner, kind), {})
        if len(got) < t:
            what = "self-mask seed" if kind == SELF else "mask key"
            raise Unrecoverable(f"secure aggregation, round {setup.round_idx}: {len(survivors)} of {setup.n} devices "
                                f"survived and device {owner}'s {what} has {len(got)} of the {t} shares it needs "
                                "([secagg] threshold); the round is aborted")
        return shamir.combine([(setup.share_x[owner][h], y) for h, y in sorted(got.items())], t)

    expander = Expander(setup)
    for u in survivors.tolist():
        b = _as_key(setup, secret(u, SELF), u, "self-mask seed")
        if crypto.commit(b) != bytes(keys[u]["b_commit"]):
            raise SecAggError(f"secure aggregation, round {setup.round_idx}: device {u}'s self-mask seed rebuilt "
                              "from its shares does not match its commitment (a share was changed)")
        total -= setup.restricted(expander.mask(b), u)
    for j in setup.selected.tolist():
        near = [u for u in setup.neighbours[j].tolist() if u in alive]
        if j in alive or not near:
            continue
        sk = _as_key(setup, secret(j, KEY), j, "mask key")
        if crypto.public_key(sk) != bytes(keys[j]["s_pk"]):
            raise SecAggError(f"secure aggregation, round {setup.round_idx}: device {j}'s mask key rebuilt from "
                              "its shares does not match its public key (a share was changed)")
        for u in near:
            stream = setup.restricted(expander.mask(pair_seed(setup, sk, bytes(keys[u]["s_pk"]), u, j)), u, j)
            if u < j:  # u added +PRG(s_uj)
                total -= stream
            else:
                total += stream
    return total


def _as_key(setup: RoundSetup, value: int, device: int, what: str) -> bytes:
    if value >= 1 << (8 * crypto.KEY_BYTES):
        raise SecAggError(f"secure aggregation, round {setup.round_idx}: device {device}'s {what} rebuilt from "
                          "its shares is not 32 bytes (a share was changed)")
    return value.to_bytes(crypto.KEY_BYTES, "little")


def decode(setup: RoundSetup, summed: np.ndarray) -> tuple[np.ndarray, int]:
    """(the float64 sum of the survivors' clipped updates, the coordinates the clip cut in all of them)."""
    return (fixedpoint.decode_sum(summed[:-1], setup.n, setup.clip, setup.bits),
            int(summed[-1].astype(np.uint64)))
