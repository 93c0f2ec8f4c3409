"""Update compression, the math alone: encode a vector into what travels, decode it, and error feedback.

Pure (no I/O, no transport), so the simulator and the MPI wire run the same encode and decode and their
bytes agree. Kinds:

- `fp16`: each coordinate rounded to the nearest float16 (ties to even); values beyond float16's range
  saturate at +-65504 rather than become infinite.
- `int8`: chunks of CHUNK coordinates, each with its own float32 scale max|x| / 127; a coordinate is
  x / scale rounded stochastically (down or up, up with probability its fractional part), so the decoded
  vector is unbiased; the uniforms come from the caller's generator (a device's own stream: replayable).
  Decoded |error| < scale per coordinate.
- `topk`: the k = max(1, ceil(fraction * n)) coordinates of largest magnitude, exactly; ties broken by the
  lower index; sent as (int32 index, value) pairs in index order.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019): a device adds the residual of what it did not
send to its next update before encoding, and keeps the new residual, `feedback`.
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
    return min(n, max(1, math.ceil(fraction * n)))


def encode(kind: str, x: np.ndarray, rng: np.random.Generator | None = None, fraction: float = 0.01) -> Encoded:
    """x (1-D float) as `kind` sends it; int8 needs rng, topk reads fraction."""
    n = x.size
    if kind == "none":
        return Encoded(kind, n, (np.ascontiguousarray(x),))
    if kind == "fp16":
        return Encoded(kind, n, (np.clip(x, -_FP16_MAX, _FP16_MAX).astype(np.float16),))
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
