"""Update compression, the math alone: encode a vector into what travels, decode it, and error feedback.

Pure (no I/O, no transport), so the simulator and the MPI wire run the same encode and decode and their
bytes agree. Kinds:

- `fp16`: each coordinate rounded to the nearest float16 (ties to even); finite values beyond float16's
  range saturate at +-65504 rather than become infinite (inf and NaN stay what they are, so a diverged
  update is still seen as one).
- `int8`: chunks of CHUNK coordinates, each with its own float32 scale max|x| / 127; a coordinate is
  x / scale rounded stochastically (down or up, up with probability its fractional part), so the decoded
  vector is unbiased; the uniforms come from the caller's generator (a device's own stream: replayable).
  Decoded |error| < scale per coordinate.
- `topk`: the k = max(1, ceil(fraction * n)) coordinates of largest magnitude, exactly (NaN ranks as the
  largest, so exactly k always go); ties broken by the lower index; sent as (int32 index, value) pairs in
  index order.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019): a device adds the residual of what it did not
send to its next update before encoding, and keeps the new residual, `feedback`.

A `Codec` is one direction's setting; `layout` gives the arrays an encoded vector travels as, fixed by the
kind, the length and the dtype, so an MPI message can be sized once and carry the payload as raw bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

KINDS = ("none", "fp16", "int8", "topk")
LOSSY = ("fp16", "int8", "topk")
CHUNK = 4096  # coordinates per int8 scale: 1/1024 of the payload for the scales
_FP16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class Encoded:
    """What travels for one vector of n coordinates: the kind and its arrays, in wire order."""

    kind: str
    n: int
    arrays: tuple = field(default_factory=tuple)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def topk_count(n: int, fraction: float) -> int:
    return min(n, max(1, math.ceil(fraction * n - 1e-9)))  # 0.07 * 100 is 7.000000000000001 in floats


def encode(kind: str, x: np.ndarray, rng: np.random.Generator | None = None, fraction: float = 0.01) -> Encoded:
    """x (1-D float) as `kind` sends it; int8 needs rng, topk reads fraction."""
    n = x.size
    if kind == "none":
        return Encoded(kind, n, (np.ascontiguousarray(x),))
    if kind == "fp16":
        saturated = np.where(np.isfinite(x), np.clip(x, -_FP16_MAX, _FP16_MAX), x)
        return Encoded(kind, n, (saturated.astype(np.float16),))
    if kind == "int8":
        if rng is None:
            raise ValueError("int8 compression rounds stochastically: it needs the device's generator")
        chunks = -(-n // CHUNK)
        padded = np.zeros(chunks * CHUNK, np.float64)
        padded[:n] = x
        blocks = padded.reshape(chunks, CHUNK)
        scale = (np.abs(blocks).max(axis=1) / 127.0).astype(np.float32)
        safe = np.where(scale > 0, scale, 1.0).astype(np.float64)[:, None]
        scaled = blocks / safe
        low = np.floor(scaled)
        q = low + (rng.random(blocks.shape) < scaled - low)
        return Encoded(kind, n, (scale, np.clip(q, -127, 127).astype(np.int8).reshape(-1)[:n]))
    if kind == "topk":
        k = topk_count(n, fraction)
        mag = np.abs(x)
        mag[np.isnan(mag)] = np.inf
        threshold = np.partition(mag, n - k)[n - k]  # the k-th largest magnitude
        above = np.flatnonzero(mag > threshold)
        ties = np.flatnonzero(mag == threshold)[:k - above.size]  # the lowest indices among the equal ones
        idx = np.sort(np.concatenate([above, ties])).astype(np.int32)
        return Encoded(kind, n, (idx, np.ascontiguousarray(x[idx])))
    raise ValueError(f"unknown compression {kind!r}; choose from {', '.join(KINDS)}")


def decode(enc: Encoded, dtype) -> np.ndarray:
    """The dense vector the coordinator applies, in dtype."""
    dtype = np.dtype(dtype)
    if enc.kind in ("none", "fp16"):
        return enc.arrays[0].astype(dtype)
    if enc.kind == "int8":
        scale, q = enc.arrays
        per = np.repeat(scale.astype(np.float64), CHUNK)[:enc.n]
        return (q.astype(np.float64) * per).astype(dtype)
    if enc.kind == "topk":
        idx, values = enc.arrays
        out = np.zeros(enc.n, dtype)
        out[idx] = values
        return out
    raise ValueError(f"unknown compression {enc.kind!r}")


def feedback(kind: str, update: np.ndarray, residual: np.ndarray, rng=None, fraction: float = 0.01):
    """(what to send, the new residual) for update plus the residual carried from the last round.

    The residual is what was meant but not sent: after any number of rounds, the sum of everything decoded
    plus the last residual equals the sum of the updates (up to the rounding of the subtraction)."""
    corrected = update + residual
    enc = encode(kind, corrected, rng, fraction)
    return enc, corrected - decode(enc, corrected.dtype)


def residual_name(report: str) -> str:
    """The run log's row state of a report vector's error-feedback residuals (row k: device k)."""
    return f"residual_{report}"


def replica_name(vector: str) -> str:
    """The run log's resume slot of the devices' copy of a downlinked vector ("x", or a server vector)."""
    return f"downlink_{vector}"


def transfer_s(nbytes: int, mbps: float) -> float:
    """Seconds nbytes take on a link of mbps megabits per second."""
    return 8.0 * nbytes / (mbps * 1e6)


def layout(kind: str, n: int, dtype, fraction: float = 0.01) -> tuple[tuple[np.dtype, int], ...]:
    """The arrays an encoded vector of n coordinates (of a model in dtype) travels as: (dtype, length) each,
    in the order of Encoded.arrays."""
    dtype = np.dtype(dtype)
    if kind == "none":
        return ((dtype, n),)
    if kind == "fp16":
        return ((np.dtype(np.float16), n),)
    if kind == "int8":
        return ((np.dtype(np.float32), -(-n // CHUNK)), (np.dtype(np.int8), n))
    if kind == "topk":
        k = topk_count(n, fraction)
        return ((np.dtype(np.int32), k), (dtype, k))
    raise ValueError(f"unknown compression {kind!r}; choose from {', '.join(KINDS)}")


@dataclass(frozen=True)
class Codec:
    """One direction of the wire: the kind, top-k's share, and whether the sender feeds back its residual."""

    kind: str = "none"
    fraction: float = 0.01
    error_feedback: bool = False

    @property
    def lossy(self) -> bool:
        return self.kind != "none"

    def nbytes(self, n: int, dtype) -> int:
        """What one encoded vector of n coordinates takes on the wire."""
        return sum(dt.itemsize * count for dt, count in layout(self.kind, n, dtype, self.fraction))

    def encode(self, x: np.ndarray, rng=None) -> Encoded:
        return encode(self.kind, x, rng, self.fraction)

    def send(self, update: np.ndarray, residual: np.ndarray | None, rng=None):
        """(what to send, the new residual): with error feedback, of update + residual; else of the update
        alone (residual None)."""
        if self.error_feedback:
            return feedback(self.kind, update, residual, rng, self.fraction)
        return encode(self.kind, update, rng, self.fraction), None

    def to_bytes(self, enc: Encoded, out: np.ndarray) -> None:
        """The encoded arrays, back to back, into the uint8 buffer out (of nbytes)."""
        if enc.nbytes != out.size:
            raise ValueError(f"a {enc.kind} payload of {enc.nbytes} bytes for a slot of {out.size}")
        at = 0
        for a in enc.arrays:
            out[at:at + a.nbytes] = a.view(np.uint8).reshape(-1)
            at += a.nbytes

    def from_bytes(self, raw: np.ndarray, n: int, dtype) -> Encoded:
        """The Encoded a sender's to_bytes wrote into raw (copies: the buffer is reused)."""
        arrays, at = [], 0
        for dt, count in layout(self.kind, n, dtype, self.fraction):
            size = dt.itemsize * count
            arrays.append(raw[at:at + size].copy().view(dt))
            at += size
        return Encoded(self.kind, n, tuple(arrays))


def codecs(compress) -> tuple[Codec, Codec]:
    """(uplink, downlink) of a config's [compress] table."""
    c = compress
    return Codec(c.uplink, c.topk_fraction, bool(c.error_feedback)), Codec(c.downlink, c.topk_fraction)
