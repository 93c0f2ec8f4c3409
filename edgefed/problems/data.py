"""One device's data, as the models read it, and the sample-count law the problems share."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PARETO_INDEX = 0.5  # Type-I Pareto sample counts (the flexible-participation paper's)
PARETO_DEFAULT_MAX = 5000  # cap: the index-0.5 law has an infinite mean


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
