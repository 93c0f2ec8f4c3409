"""Aggregating width-scaled submodels (HeteroFL, Diao et al. 2021): each coordinate's update is the run's rule over
the devices whose slice holds that coordinate, their base weights renormalized over them.

Slices are nested (a width keeps the leading part of every tensor, and a wider one keeps more), so a coordinate's
holders are the devices whose width is at least the narrowest width holding it: one set of holders per width.
For the coordinates first held at width w, the rule (schemes.SCHEMES: Schemes A/B/C, FedNova, drop) runs on
the devices of width >= w with their base weights divided by those devices' sum. With uniform weights and two
devices, a coordinate both hold gets the mean of their updates and one only the wider holds gets its update.
"""

from __future__ import annotations

import numpy as np

from edgefed.participation.schemes import SCHEMES


def levels(n_params: int, positions: dict[float, np.ndarray]) -> np.ndarray:
    """(n_params,) the narrowest width holding each coordinate (NaN: none), from each width's positions in the
    whole vector."""
    level = np.full(n_params, np.nan)
    for width in sorted(positions, reverse=True):
        level[positions[width]] = width
    return level


def aggregate(n_params: int, positions: dict[float, np.ndarray], widths: np.ndarray, deltas: list[np.ndarray],
              weights: np.ndarray, steps: np.ndarray, budgets: np.ndarray, scheme: str) -> np.ndarray:
    """(n_params,) sum over each coordinate's holders of their coefficients times their updates. widths: each
    device's; deltas: each device's update of its own slice (positions[its width] long); weights: the base weights
    w_k (schemes.base_weights); steps, budgets: what each device did of its budget."""
    widths = np.asarray(widths, np.float64)
    level = levels(n_params, positions)
    whole = np.zeros((len(deltas), n_params))
    for k, delta in enumerate(deltas):
        whole[k, positions[float(widths[k])]] = delta
    update = np.zeros(n_params)
    for width in sorted(positions):
        held = level == width
        holders = np.flatnonzero(widths >= width)
        if not held.any() or not holders.size:
            continue
        w = np.asarray(weights, np.float64)[holders]
        coeffs = SCHEMES[scheme](w / w.sum(), np.asarray(steps, np.int64)[holders], np.asarray(budgets, np.int64)[holders])
        for c, k in zip(coeffs, holders):  # in device order, one term at a time: no BLAS order in the bits
            update[held] += c * whole[k, held]
    return update
