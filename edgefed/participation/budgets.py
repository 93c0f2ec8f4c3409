"""Local budgets: K_k, the steps each device is asked for in a round."""

from __future__ import annotations

import math

import numpy as np


def local_budgets(train, n_train: np.ndarray) -> np.ndarray:
    """K_k for every device from the [train] table: K, or ceil(E * n_k / B) local steps for E epochs of batch B."""
    if train.local_epochs is None:
        return np.full(n_train.size, train.local_steps, dtype=np.int32)
    batch = n_train if train.batch_size == "full" else np.minimum(train.batch_size, n_train)
    return np.array([math.ceil(train.local_epochs * n / b - 1e-9) for n, b in zip(n_train, batch)], np.int32)
