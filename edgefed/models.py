"""Models over flat parameter vectors: one small class per kind around its Numba kernels.

The public methods check dtypes and shapes once and own the workspaces, so the kernels below them never
allocate. `local_steps` continues the caller's generator state, so one round's work may be split into
chunks (deadline mode) without changing a single draw.
"""

from __future__ import annotations

import numpy as np

from edgefed.kernels import logreg as _logreg
from edgefed.kernels import quadratic as _quad
from edgefed.problems import ClassificationData, QuadraticData

_EMPTY = {np.dtype(np.float32): np.zeros(0, np.float32), np.dtype(np.float64): np.zeros(0, np.float64)}


class LocalRun:
    """Workspace of one device's local work in one round: its generator state and minibatch permutation."""

    def __init__(self, rng_state: np.ndarray, n_samples: int):
        self.rng = rng_state
        self.perm = np.arange(n_samples, dtype=np.int64)


class LogReg:
    """Multinomial logistic regression, d = f*C + C, initialized at zero (as FedProx)."""

    kind = "logreg"

    def __init__(self, n_features: int, n_classes: int, dtype: np.dtype):
        self.n_features, self.n_classes, self.dtype = n_features, n_classes, np.dtype(dtype)
        self.dim = n_features * n_classes + n_classes
        self._grad = np.zeros(self.dim, self.dtype)
        self._prob = np.zeros(n_classes, self.dtype)

    def initial_params(self) -> np.ndarray:
        return np.zeros(self.dim, self.dtype)

    def clone(self) -> "LogReg":
        """The same model with its own workspaces (for a second thread)."""
        return LogReg(self.n_features, self.n_classes, self.dtype)

    def _check(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> None:
        if params.dtype != self.dtype or params.shape != (self.dim,) or not params.flags.c_contiguous:
            raise ValueError(f"params must be a contiguous {self.dtype} vector of {self.dim}, got {params.dtype} {params.shape}")
        if X.dtype != self.dtype or X.ndim != 2 or X.shape[1] != self.n_features or not X.flags.c_contiguous:
            raise ValueError(f"X must be contiguous {self.dtype} (n, {self.n_features}), got {X.dtype} {X.shape}")
        if y.dtype != np.int64 or y.shape != (X.shape[0],):
            raise ValueError(f"y must be int64 of shape ({X.shape[0]},), got {y.dtype} {y.shape}")

    def begin(self, data: ClassificationData, rng_state: np.ndarray) -> LocalRun:
        return LocalRun(rng_state, data.n_train)

    def local_steps(self, params, data: ClassificationData, run: LocalRun, n_steps: int, batch_size, lr: float,
                    correction: np.ndarray | None = None) -> int:
        """n_steps of minibatch SGD on params in place; batch_size None means the full local gradient."""
        X, y = data.X_train, data.y_train
        self._check(params, X, y)
        n = X.shape[0]
        b = n if batch_size is None else min(int(batch_size), n)
        t = self.dtype.type
        corr = _EMPTY[self.dtype] if correction is None else correction
        return _logreg._sgd_steps(params, X, y, self.n_classes, int(n_steps), b, t(lr), t(1.0) / t(b),
                                  run.rng, run.perm, corr, self._grad, self._prob)

    def oracle_grad(self, params, data: ClassificationData, run: LocalRun, batch_size, grad_out) -> None:
        """grad_out <- one stochastic gradient g_k(params): a minibatch drawn from run (None: the full batch)."""
        X, y = data.X_train, data.y_train
        self._check(params, X, y)
        n = X.shape[0]
        b = n if batch_size is None else min(int(batch_size), n)
        t = self.dtype.type
        _logreg._minibatch_grad(params, X, y, self.n_classes, b, t(1.0) / t(b), run.rng, run.perm, grad_out,
                                self._prob)

    def loss_grad(self, params, data: ClassificationData, grad_out: np.ndarray) -> float:
        """Mean training loss F_k(params); grad_out <- its full gradient."""
        self._check(params, data.X_train, data.y_train)
        return _logreg._loss_grad(params, data.X_train, data.y_train, self.n_classes, grad_out, self._prob)

    def loss_correct(self, params, X: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        """(sum of losses, correct predictions) over the given samples."""
        self._check(params, X, y)
        if X.shape[0] == 0:
            return 0.0, 0
        loss, correct = _logreg._loss_correct(params, X, y, self.n_classes, self._prob)
        return float(loss), int(correct)

    def train_loss(self, params, data: ClassificationData) -> float:
        return self.loss_correct(params, data.X_train, data.y_train)[0] / data.n_train


class Quadratic:
    """The quadratic oracle; the model is x itself (d = the problem's dimension)."""

    kind = "quadratic"

    def __init__(self, dim: int, x0: np.ndarray, dtype: np.dtype):
        self.dim, self.dtype = dim, np.dtype(dtype)
        self._x0 = x0

    def initial_params(self) -> np.ndarray:
        return self._x0.astype(self.dtype)

    def clone(self) -> "Quadratic":
        return Quadratic(self.dim, self._x0, self.dtype)

    def begin(self, data: QuadraticData, rng_state: np.ndarray) -> LocalRun:
        return LocalRun(rng_state, 0)

    def local_steps(self, params, data: QuadraticData, run: LocalRun, n_steps: int, batch_size, lr: float,
                    correction: np.ndarray | None = None) -> int:
        corr = _EMPTY[self.dtype] if correction is None else correction
        return _quad._sgd_steps(params, data.a, data.b, int(n_steps), self.dtype.type(lr), float(data.noise_std),
                                run.rng, corr)

    def oracle_grad(self, params, data: QuadraticData, run: LocalRun, batch_size, grad_out) -> None:
        """grad_out <- g_k(params), with the oracle's noise if the problem has any."""
        _quad._oracle_grad(params, data.a, data.b, float(data.noise_std), run.rng, grad_out)

    def loss_grad(self, params, data: QuadraticData, grad_out: np.ndarray) -> float:
        """f_k(params) and its exact gradient (no noise)."""
        return float(_quad._loss_grad(params, data.a, data.b, grad_out))

    def train_loss(self, params, data: QuadraticData) -> float:
        return self.loss_grad(params, data, np.empty_like(params))


def build_model(kind: str, problem, dtype: str):
    if kind == "logreg":
        return LogReg(problem.n_features, problem.n_classes, np.dtype(dtype))
    if kind == "quadratic":
        return Quadratic(problem.dim, problem.x0, np.dtype(dtype))
    raise ValueError(f"unknown model kind {kind!r}")
