"""Energy per device-round (docs/design.md 2.21), as arithmetic on a round's times and its boards' power.

A board draws its idle power whatever it does, and each core it keeps busy adds its busy power. A device's
round costs its busy CPU seconds at the busy power of a core, plus its share of its board's idle power over
the round's wall time: the board's idle energy is split evenly among its devices that worked in the round (a
board none of whose devices worked pays its idle energy to no device-round, and the per-board sums leave it
out). A board whose profile has no `[power]` has no energy (NaN), never a guess.
"""

from __future__ import annotations

import numpy as np


def round_energy_j(boards: np.ndarray, busy_s: np.ndarray, wall_s: float, idle_w: np.ndarray,
                   busy_w_per_core: np.ndarray) -> np.ndarray:
    """(S,) joules of each of a round's worked devices: busy_s (S,) its busy CPU seconds, boards (S,) the
    index of its board, wall_s the round's wall time; idle_w and busy_w_per_core indexed by board (NaN: the
    board's power is not known)."""
    boards = np.asarray(boards, np.int64)
    sharing = np.bincount(boards, minlength=idle_w.size)[boards]  # the board's devices in the round
    return busy_s * busy_w_per_core[boards] + idle_w[boards] * wall_s / np.maximum(sharing, 1)
