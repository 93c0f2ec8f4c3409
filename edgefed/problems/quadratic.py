"""The quadratic problem of docs/design.md 3.3, from a `.npz` file or generated from the seed.

File: `A` (N, d) and `b` (N, d), optional `n` (N,) record counts and `x0` (d,). Device k's objective is
f_k(x) = 1/2 sum_j A[k, j] (x_j - b[k, j])^2. Without a file, A ~ U(0.5, 2) and b ~ N(0, 1) per device
(N = data.clients, d = data.dim, n_k = 1), from the device's own stream.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from edgefed.errors import ProblemFileError
from edgefed.problems.data import QuadraticData
from edgefed.rng import Purpose, generator


def load_quadratic_file(path: str | Path):
    """(A, b, n, x0) from a problem file, checked; n and x0 may be None."""
    path = Path(path)
    expected = "a .npz with A (N, d), b (N, d), optional n (N,) and x0 (d,)"
    if not path.is_file():
        raise ProblemFileError(f"problem file {path} not found; data.path must name {expected}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ProblemFileError(f"problem file {path} cannot be read as .npz ({exc}); data.path must name {expected}") from None
    missing = [key for key in ("A", "b") if key not in arrays]
    if missing:
        raise ProblemFileError(f"problem file {path} lacks {', '.join(missing)}; it must hold {expected}")
    unknown = sorted(set(arrays) - {"A", "b", "n", "x0"})
    if unknown:
        raise ProblemFileError(f"problem file {path} has unexpected arrays {', '.join(unknown)}; it must hold {expected}")
    A, b = arrays["A"], arrays["b"]
    if A.ndim != 2 or A.shape[0] < 1 or A.shape[1] < 1:
        raise ProblemFileError(f"problem file {path}: A has shape {A.shape}; expected (N, d) with N, d >= 1")
    if b.shape != A.shape:
        raise ProblemFileError(f"problem file {path}: b has shape {b.shape}; expected A's shape {A.shape}")
    N, d = A.shape
    n, x0 = arrays.get("n"), arrays.get("x0")
    if n is not None:
        if n.shape != (N,):
            raise ProblemFileError(f"problem file {path}: n has shape {n.shape}; expected ({N},), one count per device")
        if not np.issubdtype(n.dtype, np.number) or np.any(n != np.round(n)) or np.any(n < 1):
            raise ProblemFileError(f"problem file {path}: n must hold positive integer record counts")
        n = n.astype(np.int64)
    if x0 is not None and x0.shape != (d,):
        raise ProblemFileError(f"problem file {path}: x0 has shape {x0.shape}; expected ({d},)")
    for name, arr in (("A", A), ("b", b), ("x0", x0)):
        if arr is None:
            continue
        if not np.issubdtype(arr.dtype, np.number) or np.iscomplexobj(arr):
            raise ProblemFileError(f"problem file {path}: {name} has dtype {arr.dtype}; expected real numbers")
        if not np.all(np.isfinite(arr)):
            raise ProblemFileError(f"problem file {path}: {name} holds NaN or infinite values")
    return A.astype(np.float64), b.astype(np.float64), n, None if x0 is None else x0.astype(np.float64)


class QuadraticProblem:
    has_test = False

    def __init__(self, A, b, n, x0, noise_std: float, dtype: np.dtype, source: str):
        self.A, self.b = A, b
        self.n_devices, self.dim = A.shape
        self.n_train = np.ones(self.n_devices, dtype=np.int64) if n is None else n
        self.x0 = np.zeros(self.dim) if x0 is None else x0
        self.noise_std = noise_std
        self.dtype = dtype
        self.source = source

    @classmethod
    def from_config(cls, cfg, seed: int, dtype: np.dtype) -> "QuadraticProblem":
        if cfg.path is not None:
            A, b, n, x0 = load_quadratic_file(cfg.path)
            return cls(A, b, n, x0, cfg.noise_std, dtype, str(cfg.path))
        rows = [generator(seed, Purpose.DATA_DEVICE, device_id=k) for k in range(cfg.clients)]
        A = np.stack([g.uniform(0.5, 2.0, cfg.dim) for g in rows])
        b = np.stack([g.normal(0.0, 1.0, cfg.dim) for g in rows])
        return cls(A, b, None, None, cfg.noise_std, dtype, "generated")

    def device(self, device_id: int) -> QuadraticData:
        return QuadraticData(
            self.A[device_id].astype(self.dtype), self.b[device_id].astype(self.dtype), self.noise_std
        )

    def optimum(self, weights: np.ndarray) -> np.ndarray:
        """argmin of sum_k w_k f_k, coordinate-wise: sum w A b / sum w A (float64)."""
        return (weights @ (self.A * self.b)) / (weights @ self.A)

    def describe(self) -> str:
        return f"quadratic ({self.source}): {self.n_devices} devices, d = {self.dim}"
