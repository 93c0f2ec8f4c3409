"""Federated problems: per-device data that is a pure function of (seed, device_id).

A problem knows every device's training-sample count n_k cheaply (the weights need them everywhere), but
builds a device's samples only when `device(k)` is called, so an MPI rank builds only its own devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgefed.config import Config


@dataclass(frozen=True)
class ClassificationData:
    """One device's samples: float features (n, f) in the model dtype, int64 labels."""

    X_train: np.ndarray
    y_train: np.ndarray
    X_test: np.ndarray
    y_test: np.ndarray

    @property
    def n_train(self) -> int:
        return self.X_train.shape[0]


@dataclass(frozen=True)
class QuadraticData:
    """One device's quadratic f_k(x) = 1/2 sum_j a_j (x_j - b_j)^2, arrays in the model dtype."""

    a: np.ndarray
    b: np.ndarray
    noise_std: float


def build_problem(cfg: Config):
    """The problem a validated config describes (a quadratic file is opened and checked here)."""
    if cfg.data.kind == "synthetic":
        from edgefed.problems.synthetic import SyntheticProblem

        return SyntheticProblem(cfg.data, cfg.seed, np.dtype(cfg.model.dtype))
    if cfg.data.kind in ("mnist", "emnist"):
        from edgefed.problems.images import ImageProblem

        return ImageProblem(cfg.data, cfg.seed, np.dtype(cfg.model.dtype))
    from edgefed.problems.quadratic import QuadraticProblem

    return QuadraticProblem.from_config(cfg.data, cfg.seed, np.dtype(cfg.model.dtype))
