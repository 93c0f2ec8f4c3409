"""Width-scaled submodels (HeteroFL, Diao et al., ICLR 2021; FjORD, Horvath et al., NeurIPS 2021; docs/design.md
2.23): which width each device trains, and each coordinate's update as the run's rule over the devices whose
slice holds it.

Slices are nested (a width keeps the leading part of every tensor, and a wider one keeps more), so the holders
of a coordinate are the devices whose width is at least the narrowest width holding it: one set of holders per
width, a "level". For the coordinates first held at level w, the rule (schemes.SCHEMES: Schemes A/B/C, FedNova,
drop) runs on the devices of width >= w, their base weights renormalized over them (scaled to the selected
devices' total: the level every device holds gets the plain rule's coefficients exactly). With uniform weights
and two devices, a coordinate both hold gets the mean of their updates, and one only the wider holds gets its
update.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from edgefed.algorithms.base import RoundReports, ServerState
from edgefed.participation.schemes import SCHEMES

ASSIGN_SPEED = "speed"


@dataclass(frozen=True)
class Submodels:
    """A run's widths as the coordinator sees them."""

    method: str  # "heterofl" or "fjord"
    widths: tuple[float, ...]  # ascending
    positions: dict  # {width: (n_w,) int64, its parameters' positions in the whole vector}
    device_width: np.ndarray  # (N,) float64: each device's width (FjORD: the widest its steps draw)

    @functools.cached_property
    def levels(self) -> list[np.ndarray]:
        """The coordinates first held at each width (ascending widths): the width's positions less the
        narrower one's."""
        out, before = [], np.zeros(0, np.int64)
        for w in self.widths:
            out.append(np.setdiff1d(self.positions[w], before, assume_unique=True))
            before = self.positions[w]
        return out

    def n_params(self, widths) -> np.ndarray:
        """(len(widths),) the parameters each of these widths' slices holds."""
        sizes = {w: self.positions[w].size for w in self.widths}
        return np.array([sizes[float(w)] for w in np.atleast_1d(widths)], np.int64)

    def slice_bytes(self, nbytes: int, widths) -> np.ndarray:
        """(len(widths),) what the whole model's plain nbytes are of each of these widths' slices."""
        return slice_bytes(nbytes, self.positions[self.widths[-1]].size, self.n_params(widths))


def slice_bytes(nbytes, whole: int, part):
    """A whole model's plain bytes (whole parameters, a word each, some vectors of it), of `part` parameters."""
    return nbytes // whole * part


def level_coefficients(scheme: str, weights: np.ndarray, steps: np.ndarray, budgets: np.ndarray,
                       widths: np.ndarray, levels: tuple[float, ...]) -> np.ndarray:
    """(len(levels), S): row j the rule's coefficients for the coordinates first held at levels[j]; a device
    outside the holders (width < levels[j]) gets 0. weights: the selected devices' base weights w_k."""
    weights, widths = np.asarray(weights, np.float64), np.asarray(widths, np.float64)
    total = math.fsum(weights)
    out = np.zeros((len(levels), weights.size))
    for j, level in enumerate(levels):
        holders = widths >= level
        if not holders.any():
            continue
        held = weights[holders]
        out[j, holders] = SCHEMES[scheme](held * (total / math.fsum(held)), np.asarray(steps, np.int64)[holders],
                                          np.asarray(budgets, np.int64)[holders])
    return out


def server_update(algorithm, state: ServerState, reports: RoundReports, coeffs: np.ndarray,
                  levels: list[np.ndarray]) -> ServerState:
    """The algorithm's server update, level by level: the coordinates first held at level j take their values
    from its update with that level's coefficients (coeffs[j]); coordinates no width holds keep theirs. Exact
    for an update linear in each coordinate (FedAvg's and FedProx's x + eta_g sum_k p_k Delta_k). (A whole
    update a width: updating each width's coordinates alone gathers the reports' columns, and takes longer:
    benchmarks/submodel_update.py.)"""
    x = state.x.copy()
    for row, coords in zip(coeffs, levels):
        if coords.size:
            updated = algorithm.server_update(state, dataclasses.replace(reports, coeffs=row))
            x[coords] = updated.x[coords]
    return ServerState(x, state.vectors)


def assign_by_speed(widths: tuple[float, ...], step_s: np.ndarray, budgets: np.ndarray,
                    deadline_s: np.ndarray) -> np.ndarray:
    """(N,) each device's widest width whose budget of steps fits its deadline (the narrowest where none fits).
    step_s: (len(widths), N) each width's seconds a step on each device's board."""
    fits = np.asarray(budgets, np.float64)[None, :] * step_s <= np.asarray(deadline_s, np.float64)[None, :]
    widest = np.where(fits.any(axis=0), len(widths) - 1 - np.argmax(fits[::-1], axis=0), 0)
    return np.asarray(widths, np.float64)[widest]


def mean_step_s(method: str, widths: tuple[float, ...], step_s: np.ndarray, device_width: np.ndarray) -> np.ndarray:
    """(N,) each device's seconds a step at its width: HeteroFL's width's; FjORD's mean over the widths its steps
    draw uniformly (those up to its own), the time its steps take on average."""
    index = np.searchsorted(np.asarray(widths), device_width)
    cols = np.arange(step_s.shape[1])
    if method != "fjord":
        return step_s[index, cols]
    running = np.cumsum(step_s, axis=0)
    return running[index, cols] / (index + 1)
