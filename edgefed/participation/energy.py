"""Energy per device-round (docs/design.md 2.21), as arithmetic on a round's times and its boards' power.

A board draws its idle power whatever it does, and each core it keeps busy adds its busy power. A device's
round costs its busy CPU seconds at the busy power of a core, plus its share of its board's idle power over
the time the round held it: the board's idle energy is split evenly among its devices that worked in the
round (a board none of whose devices worked pays its idle energy to no device-round, and the per-board sums
leave it out). A board whose profile has no `[power]` has no energy (NaN), never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def round_energy_j(boards: np.ndarray, busy_s: np.ndarray, held_s, idle_w: np.ndarray,
                   busy_w_per_core: np.ndarray, shared: bool = True) -> np.ndarray:
    """(S,) joules of each of a round's devices: busy_s (S,) its busy CPU seconds (0: it did no work, and
    costs nothing; NaN: not known, nor its energy), boards (S,) the index of its board, held_s the seconds
    the round held its board (the round's wall time, or (S,) each device's own); idle_w and busy_w_per_core
    indexed by board (NaN: the board's power is not known). shared False: each device holds its board's idle
    power alone over its held_s (FedBuff's tasks)."""
    boards = np.asarray(boards, np.int64)
    busy_s = np.asarray(busy_s, np.float64)
    worked = busy_s > 0
    sharing = np.bincount(boards[worked], minlength=idle_w.size)[boards] if shared else 1  # its board's workers
    idle = np.where(worked, idle_w[boards] * held_s / np.maximum(sharing, 1), 0.0)
    known = np.isfinite(idle_w[boards]) & np.isfinite(busy_w_per_core[boards])
    return np.where(known, busy_s * busy_w_per_core[boards] + idle, np.nan)


@dataclass(frozen=True)
class BoardPower:
    """Which board each device's work runs on, and what each board draws."""

    board: np.ndarray  # (N,) each device's board (an index of the two below)
    idle_w: np.ndarray  # (B,) watts; NaN: the board's profile has no [power]
    busy_w_per_core: np.ndarray  # (B,) watts a fully busy core adds

    def joules(self, ids: np.ndarray, busy_s: np.ndarray, held_s, shared: bool = True) -> np.ndarray:
        """(S,) the energy of these devices' round (round_energy_j)."""
        return round_energy_j(self.board[ids], busy_s, held_s, self.idle_w, self.busy_w_per_core, shared)


def busy_seconds(elapsed_s: np.ndarray, cpu_percent: np.ndarray) -> np.ndarray:
    """A device's measured busy CPU seconds: its work's wall time times the share of a core it got (where
    the share was not measured, the whole wall time: the work runs a core flat out; NaN where the work's
    time is not known, a report that never came)."""
    elapsed = np.asarray(elapsed_s, np.float64)
    share = np.asarray(cpu_percent, np.float64) / 100.0
    return elapsed * np.where(np.isfinite(share), share, 1.0)
