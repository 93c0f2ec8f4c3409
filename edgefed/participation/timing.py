"""Time in a round, as arithmetic: simulated device times, the deadline policies, over-selection, and what
each device's measured history predicts (docs/design.md 2.10-2.12).

Nothing here reads a clock: the engine hands in what the transports measured (or, with a simulated clock,
nothing: a device's time is then its steps times its board's step time, plus its communication time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from edgefed.compression import transfer_s
from edgefed.participation.energy import BoardPower


@dataclass(frozen=True)
class Boards:
    """What the hardware profiles say of each device (index: device id)."""

    step_s: np.ndarray  # (N,) seconds per local step: its board's time at its batch, divided by its speed
    comm_s: np.ndarray  # (N,) seconds to move the model down and the report up; NaN where the profile lacks them

    def comm_or_zero(self, ids: np.ndarray) -> np.ndarray:
        comm = self.comm_s[ids]
        return np.where(np.isfinite(comm), comm, 0.0)


def steps_within(budgets: np.ndarray, step_s: np.ndarray, compute_s: np.ndarray) -> np.ndarray:
    """The steps that fit in each compute window at each step time, at most the budget (NaN window: all)."""
    fit = np.where(np.isfinite(compute_s), np.floor(np.maximum(compute_s, 0.0) / step_s + 1e-9), budgets)
    return np.minimum(fit, budgets).astype(np.int32)


def forward_pass_s(step_s: np.ndarray, n_train: np.ndarray, batch: np.ndarray) -> np.ndarray:
    """A simulated forward pass over each device's n_k samples: a third of a step per batch (a step is a
    forward and a backward pass, and a backward pass costs about two forward ones)."""
    return np.ceil(n_train / batch) * step_s / 3.0


def quantile_deadline(predicted_s: np.ndarray, q: float) -> float:
    """The smallest predicted time t such that at least a fraction q of the devices finish within t (the
    inverted-CDF quantile: ceil(q n)-th smallest); NaN when nothing is predicted."""
    known = np.sort(predicted_s[np.isfinite(predicted_s)])
    if known.size == 0:
        return math.nan
    return float(known[max(math.ceil(q * known.size - 1e-9), 1) - 1])


def overselected(count: int, overselect: float, n_members: int) -> int:
    """ceil((1 + o) S) devices, at most the federation."""
    return min(math.ceil((1.0 + overselect) * count - 1e-9), n_members)


def first_to_finish(finish_s: np.ndarray, complete: np.ndarray, quorum: int) -> tuple[np.ndarray, float]:
    """(winners, end): the first `quorum` devices that completed their budget, by finish time and then by
    position (ascending device id), and the time the last of them finished; with fewer complete devices
    all of them win and end is NaN (the round ends by its deadline or when everyone is done)."""
    order = np.lexsort((np.arange(finish_s.size), np.where(complete, finish_s, np.inf)))
    winners = np.zeros(finish_s.size, bool)
    ranked = [i for i in order if complete[i]][:quorum]
    winners[ranked] = True
    end = float(finish_s[ranked[-1]]) if len(ranked) == quorum and quorum > 0 else math.nan
    return winners, end


def steps_by(end_s: float, steps: np.ndarray, work_s: np.ndarray, comm_s: np.ndarray) -> np.ndarray:
    """The steps each device had done when the round ended at end_s, at its own pace (work_s for steps)."""
    rate = np.where(work_s > 0, steps / np.where(work_s > 0, work_s, 1.0), 0.0)
    done = np.floor(np.maximum(end_s - comm_s, 0.0) * rate + 1e-9)
    return np.minimum(done, steps).astype(np.int32)


@dataclass
class History:
    """Each device's measured seconds per local step (all its time over all its steps, over the rounds it
    worked) and its latest communication time (a link changes faster than a CPU)."""

    n_devices: int
    work_s: np.ndarray = field(init=False)
    steps: np.ndarray = field(init=False)
    comm_s: np.ndarray = field(init=False)

    def __post_init__(self):
        self.work_s, self.steps = np.zeros(self.n_devices), np.zeros(self.n_devices)
        self.comm_s = np.full(self.n_devices, np.nan)

    def add_round(self, ids: np.ndarray, steps: np.ndarray, work_s: np.ndarray, comm_s: np.ndarray) -> None:
        worked = (steps > 0) & np.isfinite(work_s)
        np.add.at(self.work_s, ids[worked], work_s[worked])
        np.add.at(self.steps, ids[worked], steps[worked])
        heard = np.isfinite(comm_s)
        self.comm_s[ids[heard]] = comm_s[heard]

    def step_s(self, ids: np.ndarray, prior: np.ndarray | None = None) -> np.ndarray:
        """Seconds per step of each device: its own measurements, else the prior (a profile), else NaN."""
        own = np.where(self.steps[ids] > 0, self.work_s[ids] / np.maximum(self.steps[ids], 1), np.nan)
        return own if prior is None else np.where(np.isfinite(own), own, prior)

    def comm(self, ids: np.ndarray, prior: np.ndarray | None = None) -> np.ndarray:
        """Communication seconds of each device: its latest, else the prior, else 0."""
        fallback = np.zeros(ids.size) if prior is None else np.where(np.isfinite(prior), prior, 0.0)
        return np.where(np.isfinite(self.comm_s[ids]), self.comm_s[ids], fallback)


@dataclass(frozen=True)
class Forecast:
    """What devices' measured histories (else their profiles) predict for their next round."""

    work_s: np.ndarray  # seconds for their K_k steps (NaN: no speed known)
    links_s: np.ndarray  # their communication seconds (the latest measured, else the prior, else 0)

    @property
    def round_s(self) -> np.ndarray:
        return self.work_s + self.links_s


@dataclass(frozen=True)
class RoundDeadlines:
    """What the deadline policy decided for the selected devices of a round (None: no deadline)."""

    due_s: np.ndarray | None  # the policy's deadline, by which each report is due
    compute_s: np.ndarray | None  # what each device may compute for (less its links with covers = "round")
    steps: np.ndarray | None  # with a simulated clock: the steps that fit, instead of a wall-clock race


@dataclass(frozen=True)
class Timing:
    """How a run keeps time, settled before round 1 (orchestration builds it from the config and the
    hardware profiles)."""

    clock: str = "measured"  # "measured", "simulated" (from `boards`), or "replayed" (a recorded log's)
    boards: Boards | None = None  # the profiles' step and link times; None without a profile
    deadlines: np.ndarray | None = None  # (N,) fixed deadline policy: seconds, or a multiple of the profile
    quantile: float | None = None  # adaptive deadline policy: the share q of devices that can finish
    covers: str = "compute"  # "round": a device computes for its deadline less its communication
    overselect: float = 0.0
    link_delays: dict = field(default_factory=dict)  # {(device, round): seconds} of [[fault]] slow_link
    link_mbps: np.ndarray | None = None  # (N,) each device's shaped link ([device] link_mbps); None: not shaped
    round_bytes: int | np.ndarray = 0  # what a selected device's round moves (broadcast and report), for the
    # links' prior; (N,) where devices move different shares of the model ([submodel]'s slices)
    power: BoardPower | None = None  # each device's board and what it draws; None: no energy is computed
    reads_energy: bool = False  # the boards' own meters are read beside the modelled energy (measured, mpiexec)

    def delays(self, ids: np.ndarray, round_idx: int) -> np.ndarray:
        return np.array([self.link_delays.get((int(k), round_idx), 0.0) for k in ids])

    def transfer_s(self, ids: np.ndarray, nbytes) -> np.ndarray:
        """Seconds each device's shaped link takes for nbytes (0 where links are not shaped)."""
        if self.link_mbps is None:
            return np.zeros(ids.size)
        return transfer_s(np.asarray(nbytes, np.float64), self.link_mbps[ids])

    def link_prior(self, ids: np.ndarray) -> np.ndarray | None:
        """Each device's communication time before any is measured: its profile's, plus its shaped link's
        time for a round's bytes; None when neither is known."""
        profiled = None if self.boards is None else self.boards.comm_s[ids]
        if self.link_mbps is None:
            return profiled
        base = np.zeros(ids.size) if profiled is None else np.where(np.isfinite(profiled), profiled, 0.0)
        return base + self.transfer_s(ids, self.round_bytes if np.isscalar(self.round_bytes) else self.round_bytes[ids])

    def needs_links(self) -> bool:
        """Whether a deadline is counted against the devices' links too (covers = "round")."""
        return self.covers == "round"


def due_s(t: Timing, ids: np.ndarray, basis: Forecast | None) -> np.ndarray:
    """Each device's deadline: the fixed policy's, or the adaptive one's, by which about a share q of the
    basis (the selected devices, or those a selection policy fitted into the deadline) can finish their K_k
    steps (and, with covers = "round", get their reports in)."""
    if t.quantile is None:
        return t.deadlines[ids]
    predicted = basis.work_s + (basis.links_s if t.needs_links() else 0.0)
    return np.full(ids.size, quantile_deadline(predicted, t.quantile))


def compute_s(t: Timing, ids: np.ndarray, own: Forecast | None, basis: Forecast | None = None) -> tuple:
    """(each device's deadline, the seconds of local work it leaves the device: less its links with covers =
    "round"), from one forecast of the devices (own) and of the adaptive policy's basis (None: own)."""
    due = due_s(t, ids, own if basis is None else basis)
    return due, due - (own.links_s if t.needs_links() else 0.0)


def round_deadlines(t: Timing, ids: np.ndarray, budgets: np.ndarray, own: Forecast | None, basis: Forecast | None,
                    simulated: bool) -> RoundDeadlines:
    """The deadline policy's decision for a round's selected devices (compute_s): on a simulated clock the
    steps that fit their compute windows, on a measured one the windows the runners race (none while nothing
    predicts them)."""
    due, compute = compute_s(t, ids, own, basis)
    if simulated:
        return RoundDeadlines(due, None, steps_within(budgets, t.boards.step_s[ids], compute))
    if not np.isfinite(compute).any():
        return RoundDeadlines(due, None, None)  # nothing to predict from yet: the budgets, untimed
    return RoundDeadlines(due, np.where(np.isfinite(compute), compute, math.inf), None)
