"""Participation traces: which devices work in a round and how many of their K steps they complete.

`ReplayTrace` replays a recorded run round by round (its selections and completed steps), so schemes or
algorithms can be compared on exactly the same realized participation, and a deadline run reproduces its
own trajectory bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgefed.errors import ConfigError


@dataclass(frozen=True)
class ReplayTrace:
    selected: np.ndarray  # (R, N) bool
    steps: np.ndarray  # (R, N) int32
    source: str

    @classmethod
    def checked(cls, selected, steps, budget, source: str, n_devices: int, rounds: int,
                budgets: np.ndarray) -> "ReplayTrace":
        """A trace that fits this run: the same N, at least R rounds, the same K_k wherever it selected."""
        where = f"participation.trace = {source!r}"
        if selected.shape[1] != n_devices:
            raise ConfigError(f"config: {where} has {selected.shape[1]} devices but this run has {n_devices}")
        if selected.shape[0] < rounds:
            raise ConfigError(f"config: {where} holds {selected.shape[0]} rounds but this run needs {rounds}; "
                              f"lower rounds to at most {selected.shape[0]}")
        selected, steps, budget = selected[:rounds], steps[:rounds], budget[:rounds]
        wrong = selected & (budget != budgets[None, :])
        if wrong.any():
            r, k = np.argwhere(wrong)[0]
            raise ConfigError(f"config: {where} asked device {k} for {budget[r, k]} steps in round {r + 1} but this "
                              f"run's budget is {budgets[k]}; use the same train.local_steps / local_epochs")
        return cls(selected.copy(), steps.astype(np.int32), source)

    def round(self, round_idx: int) -> tuple[np.ndarray, np.ndarray]:
        """(selected device ids ascending, steps each completes) of round round_idx (1-based)."""
        ids = np.flatnonzero(self.selected[round_idx - 1])
        return ids, self.steps[round_idx - 1, ids]
