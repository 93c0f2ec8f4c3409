"""Participation traces: which devices work in a round and how many of their K steps they complete.

`ReplayTrace` replays a recorded run round by round (its selections and completed steps), so schemes or
algorithms can be compared on exactly the same realized participation, and a deadline run reproduces its
own trajectory bit for bit. `SampledTraces` gives each device a recorded trace of completed fractions and
draws from it every round, as the flexible-participation paper does. Reading trace files and resolving
`participation.trace` to the traces it names is tracefiles.py's job; this module does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgefed.errors import ConfigError
from edgefed.rng import Purpose, generator


@dataclass(frozen=True)
class ReplayTrace:
    """A recorded run's participation: selections, completed steps, which reports came too late (dropped,
    whatever their steps), and the time the rounds took (None where the log kept none)."""

    selected: np.ndarray  # (R, N) bool
    steps: np.ndarray  # (R, N) int32
    late: np.ndarray  # (R, N) bool
    clock_s: np.ndarray | None = None  # (R + 1,)
    comm_s: np.ndarray | None = None  # (R, N)
    overselected: bool = False  # the late devices were over-selected surplus, outside the rounds' weights
    candidate: np.ndarray | None = None  # (R, N) bool: the devices a selection policy considered (None: not kept)
    utility: np.ndarray | None = None  # (R, N) float64: their scores
    per_round: object = None  # an over-selected run's train.clients_per_round (its quorum S), as it was set
    energy_j: np.ndarray | None = None  # (R, N): the recorded energy (None: the log kept none)
    away: tuple = ()  # the boards away as it ran ([[mpi.away]] entries as dicts), whose returns it boosted
    width: np.ndarray | None = None  # (R, N): the submodel width each device trained (None: not logged)

    @classmethod
    def checked(cls, recorded, source: str, n_devices: int, rounds: int, budgets: np.ndarray) -> "ReplayTrace":
        """A trace that fits this run: the same N, at least R rounds, the same K_k wherever it selected."""
        selected, steps, budget = recorded.selected, recorded.steps, recorded.budget
        where = f"participation.trace = {source!r}"
        if recorded.staleness is not None:
            raise ConfigError(f'config: {where} is an async run\'s log (its rows are server updates); replay it with '
                              'participation.mode = "async"')
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
        clock = None if recorded.clock_s is None else recorded.clock_s[:rounds + 1].copy()
        comm = None if recorded.comm_s is None else recorded.comm_s[:rounds].copy()
        considered = [None if v is None else v[:rounds].copy() for v in (recorded.candidate, recorded.utility)]
        energy = None if recorded.energy_j is None else recorded.energy_j[:rounds].copy()
        width = None if recorded.width is None else recorded.width[:rounds].copy()
        return cls(selected.copy(), steps.astype(np.int32), recorded.late[:rounds].copy(), clock, comm,
                   recorded.overselected, *considered, energy_j=energy, away=recorded.away, width=width)

    def recorded(self, round_idx: int) -> tuple[np.ndarray, np.ndarray]:
        """(selected device ids ascending, steps each completes) of round round_idx (1-based)."""
        ids = np.flatnonzero(self.selected[round_idx - 1])
        return ids, self.steps[round_idx - 1, ids]


class SampledTraces:
    """Each device follows one trace; each round its completed fraction is drawn from that trace's rounds.

    As in the flexible-participation paper: "each simulated device is randomly assigned a trace. For each
    aggregation round, it randomly samples from its trace to obtain the number of local epochs". Both draws
    come from the device's own streams, so any rank count replays the same steps.
    """

    def __init__(self, names, fractions, assignment: np.ndarray):
        self.names, self.fractions, self.assignment = tuple(names), tuple(fractions), assignment

    def steps(self, seed: int, round_idx: int, device_ids: np.ndarray, budgets: np.ndarray) -> np.ndarray:
        out = np.zeros(len(device_ids), np.int32)
        for i, k in enumerate(device_ids):
            f = self.fractions[self.assignment[k]]
            frac = f[generator(seed, Purpose.TRACE, round_idx, int(k)).integers(f.size)]
            out[i] = min(int(np.floor(frac * budgets[i] + 0.5)), int(budgets[i]))
        return out
