"""The federation's time, round by round (docs/design.md 2.10-2.12): each round's deadlines, the steps a
simulated deadline leaves, which reports the round takes, and the clock.

With a measured clock the transports race the real one (deadline runners, arrival order under MPI) and
this only reads what they measured; with a simulated clock a device's time is its steps times its board's
step time plus its communication time, so deadlines, over-selection and the clock are arithmetic on the
plan, the same bytes in the simulator and under MPI; a replayed log's clock is the recorded one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgefed.participation.energy import busy_seconds
from edgefed.participation.timing import (Forecast, History, RoundDeadlines, Timing, compute_s, first_to_finish,
                                          forward_pass_s, round_deadlines, steps_by)
from edgefed.runlog import round_ids, round_values
from edgefed.transport import LocalResults, RoundPlan


@dataclass(frozen=True)
class Settled:
    """The round as its time decided it."""

    late: np.ndarray  # (S,) bool: not taken (past deadline + grace, or over-selected and beaten)
    steps: np.ndarray  # (S,) int32 steps to log (an over-selected loser: what it had done by the end)
    comm_s: np.ndarray  # (S,) float32, NaN unknown
    duration_s: float  # the round's simulated length (NaN: measured by the caller)
    reported_s: float  # measured: when the round's last report taken arrived (NaN: not measured apart)
    busy_s: np.ndarray | None = None  # (S,) the busy CPU seconds of each device's work, taken or not


class RoundClock:
    def __init__(self, timing: Timing, n_devices: int, mode: str, replay=None, budgets: np.ndarray | None = None):
        self.timing, self.mode, self.replay = timing, mode, replay
        self.budgets = budgets  # (N,) K_k: an adaptive deadline set among other devices than the selected
        self.history = History(n_devices)
        self.clock_s = 0.0
        self.round_s = 0.0  # how far the last advance moved the clock: the round's length

    @property
    def simulated(self) -> bool:
        return self.timing.clock == "simulated"

    # -- before the round -------------------------------------------------------------------------------
    def forecast(self, ids: np.ndarray, budgets: np.ndarray) -> Forecast:
        """What these devices' measured histories, else their profiles, predict of their K_k steps and links."""
        t = self.timing
        work = budgets * self.history.step_s(ids, None if t.boards is None else t.boards.step_s[ids])
        return Forecast(work, self.history.comm(ids, t.link_prior(ids)))

    def _forecast_if(self, needed: bool, ids: np.ndarray, budgets: np.ndarray) -> Forecast | None:
        return self.forecast(ids, budgets) if needed else None

    def windows(self, ids: np.ndarray, budgets: np.ndarray) -> np.ndarray:
        """The seconds of local work each device's deadline leaves it, were these devices the round's (NaN:
        no deadline)."""
        t = self.timing
        if self.mode not in ("deadline", "async") or (t.deadlines is None and t.quantile is None):
            return np.full(ids.size, np.nan)  # no deadline (an async task's is fixed when it has one)
        return compute_s(t, ids, self._forecast_if(t.quantile is not None or t.needs_links(), ids, budgets))[1]

    def deadlines(self, ids: np.ndarray, budgets: np.ndarray, among: np.ndarray | None = None) -> RoundDeadlines:
        """The round's deadlines from one forecast of the selected devices (and of `among`, the devices a
        selection policy fitted into the deadline, which an adaptive deadline is set among)."""
        t = self.timing
        if self.mode != "deadline":
            return RoundDeadlines(None, None, None)
        adaptive = t.quantile is not None
        own = self._forecast_if((adaptive and among is None) or t.needs_links(), ids, budgets)
        basis = self._forecast_if(adaptive and among is not None, among, None if among is None else self.budgets[among])
        return round_deadlines(t, ids, budgets, own, basis, self.simulated)

    # -- after it ---------------------------------------------------------------------------------------
    def busy_s(self, ids: np.ndarray, steps: np.ndarray, res: LocalResults) -> np.ndarray | None:
        """The busy CPU seconds of these devices' work of `steps` steps, for their energy (None: the run has
        none): on a simulated or replayed clock the steps at their boards' step times (a replay's are as
        simulated), else as measured."""
        if self.timing.power is None:
            return None
        if self.timing.clock != "measured" and self.timing.boards is not None:
            return steps * self.timing.boards.step_s[ids]
        return busy_seconds(res.elapsed_s, res.cpu_percent)

    def settle(self, plan: RoundPlan, res: LocalResults) -> Settled:
        ids, t, r = plan.device_ids, self.timing, plan.round_idx
        late, steps = res.late.copy(), res.steps.copy()
        computed = res.steps.copy()  # what each device computed, taken or not (the energy it spent)
        if self.simulated:
            work = steps * t.boards.step_s[ids]
            delays = t.delays(ids, r) + t.transfer_s(ids, plan.down() + (0 if res.bytes_up is None else res.bytes_up))
            comm = t.boards.comm_or_zero(ids) + delays
            finish = work + comm
            known = np.isfinite(t.boards.comm_s[ids]) | (delays > 0) | (t.link_mbps is not None)
            comm_log = link = np.where(known, comm, np.nan)
            if plan.round_deadline_s is not None:
                overdue = finish > plan.round_deadline_s + plan.grace_s  # the coordinator stopped waiting
                late |= overdue
                steps[overdue] = 0
        else:
            work = res.elapsed_s.astype(np.float64)
            finish, comm_log, link = res.finish_s, res.comm_s, res.link_s
            comm = np.where(np.isfinite(comm_log), comm_log, 0.0)
        if self.replay is not None:
            late |= self.replay.late[r - 1, ids]
        end = math.nan
        if plan.quorum is not None:
            winners, end = first_to_finish(finish, (steps == plan.budgets) & ~late, plan.quorum)
            if math.isfinite(end):
                # a loser that completed anyway (it ran in full here, or arrived after the end) is logged
                # with what it had done when the round ended; one told to stop reports that itself
                beaten = ~winners & ~late & (steps == plan.budgets)
                steps = np.where(beaten, steps_by(end, steps, work, comm), steps).astype(np.int32)
                computed = np.where(beaten, steps, computed)
                late |= ~winners
        # speeds from the reports taken; links from every report heard, whatever it did (a device shut out
        # by a slow link must see the link recover); both as logged, so a resumed run reads them back
        comm_log = comm_log.astype(np.float32)
        taken = ~late & (steps > 0)
        self.history.add_round(ids, steps, np.where(taken, work, np.nan), np.asarray(link, np.float32).astype(np.float64))
        duration = math.nan
        if self.simulated:
            if math.isfinite(end):
                duration = end
            else:
                due = np.array([]) if plan.round_deadline_s is None else plan.round_deadline_s[late]
                due = due[np.isfinite(due)]
                if due.size:  # the coordinator waited for the late ones until their deadline + grace
                    duration = float(due.max()) + plan.grace_s
                else:
                    duration = float(finish[~late].max()) if (~late).any() else 0.0
        return Settled(late, steps, comm_log, duration, res.round_s, self.busy_s(ids, computed, res))

    def advance(self, round_idx: int, settled: Settled, wall_s: float, after_s: float, before_s: float = 0.0) -> float:
        """The clock at the end of round round_idx: recorded, simulated, or measured on: the round's wall
        time, or (when the transport timed its end apart from what it collected after, as over-selection's
        stopped devices) that end plus the after_s spent aggregating; before_s: what selecting took before
        the work was sent (power of choice's candidates' losses), simulated or measured."""
        start = self.clock_s
        if self.replay is not None and self.replay.clock_s is not None:
            self.clock_s = float(self.replay.clock_s[round_idx])
        elif self.simulated:
            self.clock_s += before_s + settled.duration_s
        elif math.isfinite(settled.reported_s):
            self.clock_s += before_s + settled.reported_s + after_s
        else:
            self.clock_s += before_s + wall_s
        self.round_s = self.clock_s - start
        return self.clock_s

    def probe_s(self, ids: np.ndarray, n_train: np.ndarray, batch: np.ndarray, nbytes: int, measured_s: float) -> float:
        """How long asking these devices for their losses took: measured, or on a simulated clock the slowest
        device's links (the model down, a loss up) plus a forward pass over its data (docs/design.md 2.18)."""
        if not self.simulated:
            return measured_s
        t = self.timing
        links = t.boards.comm_or_zero(ids) + t.transfer_s(ids, nbytes)
        return float(np.max(forward_pass_s(t.boards.step_s[ids], n_train, batch) + links, initial=0.0))

    def comm_log(self, round_idx: int, ids: np.ndarray, settled: Settled) -> np.ndarray:
        """A replay logs the recorded communication times, as it logs the recorded clock."""
        if self.replay is not None and self.replay.comm_s is not None:
            return self.replay.comm_s[round_idx - 1, ids]
        return settled.comm_s

    def recorded_energy(self, round_idx: int, ids: np.ndarray) -> np.ndarray | None:
        """A replay of a log that kept its energy logs the recorded energy: what a straggler computed and
        had dropped is in it, not in the steps the log kept (None: compute it)."""
        if self.replay is not None and self.replay.energy_j is not None:
            return self.replay.energy_j[round_idx - 1, ids]
        return None

    # -- resume -----------------------------------------------------------------------------------------
    def restore(self, logged: dict, done: int) -> None:
        """The clock and the devices' history as the completed rounds of a log left them."""
        clock = logged.get("metrics/clock_s")
        recorded = float(clock[done]) if clock is not None and clock.shape[0] > done else math.nan
        self.clock_s = recorded if math.isfinite(recorded) else 0.0  # a log from before the clock: from 0
        steps_all, late_all = logged["participation/steps"], logged["participation/late"]
        elapsed, comm_all = logged["participation/elapsed_s"], logged.get("participation/comm_s")
        for r in range(min(done, steps_all.shape[0])):
            ids = round_ids(logged["participation/selected"], r)
            steps, late = round_values(steps_all, r, ids), round_values(late_all, r, ids)
            if self.simulated:
                work = steps * self.timing.boards.step_s[ids]
            else:
                work = round_values(elapsed, r, ids).astype(np.float64)
            comm = (np.full(ids.size, np.nan) if comm_all is None
                    else round_values(comm_all, r, ids).astype(np.float64))
            taken = ~late & (steps > 0)
            self.history.add_round(ids, steps, np.where(taken, work, np.nan), comm)
