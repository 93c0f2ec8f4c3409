"""Aggregation coefficients (docs/design.md 2.3): the one place they are computed.

w_k, the base weight (`train.weighting`): `uniform` 1/|S_r|; `count_global` n_k / sum over the active
federation; `count_selected` n_k / sum over the selected devices.
Schemes A/B/C (Ruan et al.) multiply it by m_k, from the steps s_k done of the budget K_k:
A: [s_k = K_k] * |S_r| / K_r with K_r the number of complete devices (all zero when K_r = 0);
B: 1; C: K_k / s_k, and 0 when s_k = 0.
`fednova` (Wang et al., NeurIPS 2020) renormalizes over the devices that reported, R_r = {s_k > 0}:
p_k = w_k / sum_R w_j, tau_eff = sum_R p_k s_k, coefficient tau_eff p_k / s_k.
`drop` (a timeout that discards incomplete work, as Flower and NVIDIA FLARE do) keeps the complete devices,
Q_r = {s_k = K_k}: coefficient w_k / sum_Q w_j. Either is all zero when its set is empty. Their sums are
math.fsum: exactly rounded, so the device order cannot change a bit.

`SCHEMES` is the registry the config is checked against: a rule maps the base weights, steps and budgets
of the selected devices to their coefficients, so a rule that is not a multiplier (one that renormalizes
over the devices that reported, say) is one more entry here and nothing else.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np

WEIGHTINGS = ("uniform", "count_global", "count_selected")


class Federation:
    """The devices in one round's objective (ascending ids) and the sum of their sample counts: what the
    weights need of the federation, computed once while it is unchanged rather than over N every round."""

    def __init__(self, active: np.ndarray, n_train: np.ndarray):
        self.active = active
        self.ids = np.flatnonzero(active)
        self.ids.setflags(write=False)  # shared by the rounds while the federation holds
        # (an exact integer: a float64 sum of the counts is the same number while it stays below 2^53)
        self.samples = int(n_train[self.ids].sum())

    @functools.cached_property
    def absent(self) -> np.ndarray:
        """The devices outside it, ascending."""
        return np.flatnonzero(~self.active)


def base_weights(weighting: str, selected: np.ndarray, federation: Federation, n_train: np.ndarray) -> np.ndarray:
    """w_k for the selected device ids (float64, in their order)."""
    if weighting == "uniform":
        return np.full(selected.size, 1.0 / selected.size)
    counts = n_train[selected].astype(np.float64)
    if weighting == "count_global":
        return counts / float(federation.samples)
    if weighting == "count_selected":
        return counts / counts.sum()
    raise ValueError(f"unknown weighting {weighting!r}")


def _complete_only(steps: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    complete = (steps == budgets) & (budgets > 0)
    n_complete = int(complete.sum())
    if n_complete == 0:
        return np.zeros(steps.size)
    return complete * (steps.size / n_complete)


def _unit(steps: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    return np.ones(steps.size)


def _scaled_by_work(steps: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    out = np.zeros(steps.size)
    done = steps > 0
    out[done] = budgets[done] / steps[done]
    return out


MULTIPLIERS = {"A": _complete_only, "B": _unit, "C": _scaled_by_work}


def _scheme(multiplier) -> Callable:
    def rule(weights: np.ndarray, steps: np.ndarray, budgets: np.ndarray) -> np.ndarray:
        return weights * multiplier(steps, budgets)

    return rule


def _renormalized(weights: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """w_k / sum of the kept w_j for the kept devices, 0 for the others (all 0 when none is kept)."""
    out = np.zeros(weights.size)
    if kept.any():
        out[kept] = weights[kept] / math.fsum(weights[kept])
    return out


def fednova(weights: np.ndarray, steps: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    """tau_eff p_k / s_k over the devices that reported work (FedNova for plain local SGD)."""
    reported = steps > 0
    p = _renormalized(weights, reported)
    out = np.zeros(weights.size)
    if reported.any():
        tau_eff = math.fsum(p[reported] * steps[reported])
        out[reported] = tau_eff * p[reported] / steps[reported]
    return out


def drop_stragglers(weights: np.ndarray, steps: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    """The complete devices' weights, renormalized over them; incomplete work is thrown away."""
    return _renormalized(weights, (steps == budgets) & (budgets > 0))


# participation.scheme -> rule(base weights, steps, budgets) -> coefficients of the selected devices
SCHEMES: dict[str, Callable] = {**{name: _scheme(m) for name, m in MULTIPLIERS.items()},
                                "fednova": fednova, "drop": drop_stragglers}


def scheme_multipliers(scheme: str, steps: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    """m_k for the selected devices from their completed steps and budgets."""
    if scheme not in MULTIPLIERS:
        raise ValueError(f"unknown scheme {scheme!r}")
    return MULTIPLIERS[scheme](np.asarray(steps, dtype=np.int64), np.asarray(budgets, dtype=np.int64))


def coefficients(weighting: str, scheme: str, selected, federation: Federation, n_train, steps,
                 budgets) -> np.ndarray:
    """p_k for the selected devices: the scheme's rule over their base weights."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}")
    return SCHEMES[scheme](base_weights(weighting, selected, federation, n_train), np.asarray(steps, dtype=np.int64),
                           np.asarray(budgets, dtype=np.int64))


def weights_among(weighting: str, members: np.ndarray, n_train: np.ndarray) -> np.ndarray:
    """The objective's weights renormalized over these members (a selection policy's draw among them)."""
    if weighting == "uniform":
        return np.full(members.size, 1.0 / members.size)
    counts = n_train[members].astype(np.float64)
    return counts / counts.sum()


def objective_weights(weighting: str, federation: Federation, n_train: np.ndarray, ids=None) -> np.ndarray:
    """Weights of the global objective the weighting minimizes, 1/N_r or n_k/n, of the members `ids` (default:
    every member)."""
    ids = federation.ids if ids is None else ids
    if weighting == "uniform":
        return np.full(ids.size, 1.0 / federation.ids.size)
    return n_train[ids].astype(np.float64) / float(federation.samples)


# Secure aggregation (docs/design.md 2.15) sums a_k Delta_k without showing the server any one of them, so
# every rule is split as p_k = G a_k: a_k what device k knows of itself (its prescale c_k, set before the
# work from its base weight and fast-reboot boost, and the multiplier of its own steps), G one number the
# server forms from the metadata it sees. A rule missing here cannot be computed that way.
def _complete(steps: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    return ((steps == budgets) & (budgets > 0)).astype(np.float64)


def _per_step(steps: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    out = np.zeros(steps.size)
    out[steps > 0] = 1.0 / steps[steps > 0]
    return out


DEVICE_MULTIPLIERS = {"A": _complete, "B": _unit, "C": _scaled_by_work, "fednova": _per_step, "drop": _complete}


def prescales(weighting: str, selected: np.ndarray, n_train: np.ndarray, mean: float | None = None) -> np.ndarray:
    """c_k before the work: 1 for uniform weights, else n_k over the federation's mean count (a number of
    order 1, so one clip suits every device; mean: float(n_train.mean()), when known); the server's G holds
    the normalisation."""
    if weighting == "uniform":
        return np.ones(selected.size)
    return n_train[selected].astype(np.float64) / (float(n_train.mean()) if mean is None else mean)


def device_factors(scheme: str, prescale: np.ndarray, steps: np.ndarray, budgets: np.ndarray) -> np.ndarray:
    """a_k = c_k m'_k, the factor each device applies to its own update."""
    return np.asarray(prescale, np.float64) * DEVICE_MULTIPLIERS[scheme](np.asarray(steps, np.int64),
                                                                         np.asarray(budgets, np.int64))


def server_factor(coeffs: np.ndarray, factors: np.ndarray) -> float:
    """G with p_k = G a_k for every device (0 when nothing is applied)."""
    total = math.fsum(factors)
    return math.fsum(coeffs) / total if total != 0 else 0.0
