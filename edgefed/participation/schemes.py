"""Aggregation coefficients p_k = w_k * m_k (DESIGN 2.3): the one place they are computed.

w_k, the base weight (`train.weighting`): `uniform` 1/|S_r|; `count_global` n_k / sum over the active
federation; `count_selected` n_k / sum over the selected devices.
m_k, the scheme multiplier (`participation.scheme`), from the steps s_k done of the budget K_k:
A: [s_k = K_k] * |S_r| / K_r with K_r the number of complete devices (all zero when K_r = 0);
B: 1; C: K_k / s_k, and 0 when s_k = 0.
"""

import numpy as np


def base_weights(weighting: str, selected: np.ndarray, active: np.ndarray, n_train: np.ndarray) -> np.ndarray:
    """w_k for the selected device ids (float64, in their order)."""
    if weighting == "uniform":
        return np.full(selected.size, 1.0 / selected.size)
    counts = n_train[selected].astype(np.float64)
    if weighting == "count_global":
        return counts / float(n_train[active].sum())
    if weighting == "count_selected":
        return counts / counts.sum()
    raise ValueError(f"unknown weighting {weighting!r}")


def scheme_multipliers(scheme: str, steps: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    """m_k for the selected devices from their completed steps and budgets."""
    steps = np.asarray(steps, dtype=np.int64)
    budgets = np.asarray(budgets, dtype=np.int64)
    if scheme == "A":
        complete = (steps == budgets) & (budgets > 0)
        n_complete = int(complete.sum())
        if n_complete == 0:
            return np.zeros(steps.size)
        return complete * (steps.size / n_complete)
    if scheme == "B":
        return np.ones(steps.size)
    if scheme == "C":
        out = np.zeros(steps.size)
        done = steps > 0
        out[done] = budgets[done] / steps[done]
        return out
    raise ValueError(f"unknown scheme {scheme!r}")


def coefficients(weighting: str, scheme: str, selected, active, n_train, steps, budgets) -> np.ndarray:
    """p_k = w_k * m_k for the selected devices."""
    return base_weights(weighting, selected, active, n_train) * scheme_multipliers(scheme, steps, budgets)


def objective_weights(weighting: str, active: np.ndarray, n_train: np.ndarray) -> np.ndarray:
    """Weights of the global objective the weighting minimizes, over the active devices: 1/N_r or n_k/n."""
    if weighting == "uniform":
        return np.full(active.size, 1.0 / active.size)
    counts = n_train[active].astype(np.float64)
    return counts / counts.sum()
