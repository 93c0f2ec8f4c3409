"""The async loop: FedBuff's server updates (docs/design.md 2.14).

`rounds` counts server updates. On a simulated clock the schedule (participation/asynchrony.py) decides,
as arithmetic on the boards' step and link times, which reports make each update and how stale they are;
the engine then runs each of those tasks through the transport from the server model it started from
(kept here for as long as a task of it can still be taken), with the streams of (its start version + 1,
its device), so a task's report is the same whenever it is computed. On a measured clock (a real
federation, under mpirun) `LiveSchedule` sends each task to its device's rank as it starts and takes the
reports as they arrive. Everything else (evaluation, the log, the resume state) is the round engine's.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from edgefed.algorithms.base import RoundReports, ServerState
from edgefed.engine.clock import Settled
from edgefed.engine.rounds import RoundEngine, RoundSummary
from edgefed.participation.asynchrony import (Recorded, Schedule, Task, Update, buffer_coefficients, draw_idle,
                                              idle_members)
from edgefed.participation.timing import steps_within
from edgefed.transport import PROBE_BYTES, LocalResults, RoundPlan


class AsyncEngine(RoundEngine):
    def __init__(self, cfg, algorithm, n_train, transport, log, on_round=None, trace=None, timing=None,
                 count_labels=None, submodels=None):
        """submodels: None ([submodel] refuses mode = "async")."""
        super().__init__(cfg, algorithm, n_train, transport, log, on_round, trace, timing, count_labels)
        a = cfg.asynchronous
        # a replay's schedule is the recorded one (participation.trace = RUN.h5); a measured clock's is the
        # real federation's (under MPI); else the simulated clock's
        if isinstance(trace, Recorded):
            self.schedule = trace
        elif self.timing.clock == "measured":
            self.schedule = LiveSchedule(self)
        else:
            self.schedule = Schedule(cfg.seed, a.concurrency, a.buffer, a.max_staleness, self._duration,
                                     self._pick if self.considered else None)
        self._drawn: dict[int, float] = {}  # a selection policy's considered devices and scores since the last row
        self._asked = (np.zeros(self.n_devices, np.int64), np.zeros(self.n_devices, np.int64))  # probes: down, up
        self.versions: dict[int, ServerState] = {}  # the server models a task in flight may have started from
        recorded = self.schedule.staleness.max(initial=0) if isinstance(trace, Recorded) else 0
        self.window = max(a.max_staleness, int(recorded))  # the oldest version a taken report can start from

    def _duration(self, device: int) -> tuple[int, float]:
        """(steps, seconds) of a task of this device: its budget (or what fits in its deadline) at its
        board's step time, plus its links."""
        boards, k = self.timing.boards, np.array([device])
        steps = self._budgets[k]
        if self.timing.deadlines is not None:
            steps = steps_within(steps, boards.step_s[k], self.timing.deadlines[k])
        comm = boards.comm_or_zero(k) + self.timing.transfer_s(k, self.timing.round_bytes)
        return int(steps[0]), float(steps[0] * boards.step_s[device] + comm[0])

    def _pick(self, draw: int, idle: np.ndarray) -> tuple[int, float]:
        """A selection policy's device for the draw-th task, among the idle members, for the server update
        its report will go into (the policy's round), and the seconds choosing took on a simulated clock."""
        self._probed = None
        choice = self.selection.select(dataclasses.replace(self._view(self.schedule.version + 1, idle, 1), draw=draw))
        self._drawn.update(zip(choice.candidates.tolist(), choice.utility.tolist()))
        if self._probed is None:
            return int(choice.selected[0]), 0.0
        asked, seconds, answered = self._probed
        self._asked[0][asked] += self.state.x.nbytes  # the probes' bytes since the last row
        self._asked[1][answered] += PROBE_BYTES
        return int(choice.selected[0]), seconds

    def _probes_sent(self) -> bool:
        return self.considered  # (a policy's probes add up over the update's draws, in _asked)

    def _probe_bytes(self, up: int) -> np.ndarray:
        return self._asked[up].copy()

    def _considered_row(self, round_idx: int) -> dict:
        """Row t: what the policy considered in the draws since row t - 1 (a device's latest score)."""
        if not self.considered:
            return {}
        if isinstance(self.schedule, Recorded) and self.schedule.candidate is not None:  # a replay: the log's
            return {"participation/candidate": self.schedule.candidate[round_idx - 1],
                    "participation/utility": self.schedule.utility[round_idx - 1]}
        candidate, utility = np.zeros(self.n_devices, bool), np.full(self.n_devices, np.nan)
        for k, score in self._drawn.items():
            candidate[k], utility[k] = True, score
        self._drawn = {}
        return {"participation/candidate": candidate, "participation/utility": utility}

    def _kept_schedule(self) -> bool:
        """With a selection policy the schedule's tasks in flight are kept: its draws cannot be simulated again."""
        return self.considered and isinstance(self.schedule, Schedule)

    def _extra_slots(self) -> dict:
        return {**super()._extra_slots(), **(self.schedule.state() if self._kept_schedule() else {})}

    def _learn(self, round_idx: int, ids: np.ndarray, res: LocalResults, reported: np.ndarray) -> None:
        """What update round_idx's reports tell a selection policy: their losses, and their devices' speeds
        and links for its forecasts (the simulated clock's, or as measured)."""
        if not self.considered:
            return
        self._observe(RoundPlan(round_idx, ids, self._budgets[ids], 0.0), res, reported)
        boards = self.timing.boards
        work = (res.steps * boards.step_s[ids] if self.clock.simulated else res.elapsed_s.astype(np.float64))
        self.clock.history.add_round(ids, res.steps, np.where(reported, work, np.nan), res.comm_s.astype(np.float64))

    def start(self, x0: np.ndarray) -> ServerState:
        state = super().start(x0)
        self.versions[0] = state
        self.schedule.fill(self.federation.ids)
        return state

    def resume(self, state: dict, done: int, logged: dict | None = None) -> ServerState:
        """The server state after update `done`, the schedule as it stood then (simulated again: it is
        arithmetic on the boards' times, or the recorded one), and the models its tasks in flight started
        from (the log's trajectory: every version is stored with [log] every = 1)."""
        resumed = state
        state = super().resume(state, done, logged)
        if self._kept_schedule():
            self.schedule.restore(resumed)
        else:
            self.schedule.fill(self.federation.ids)
            for _ in range(done):
                self.schedule.next_update(self.federation.ids)
        stored = dict(zip(logged["trajectory/round"].tolist(), logged["trajectory/x"]))
        for v in range(max(done - self.window, 0), done + 1):
            self.versions[v] = ServerState(stored[v].copy()) if v < done else state
        return state

    def _reports(self, tasks: tuple[Task, ...]) -> LocalResults:
        """The tasks' reports, a row each in ascending device id, each run from its start version (or, on a
        real federation, as they came)."""
        tasks = tuple(sorted(tasks, key=lambda task: task.device))
        if isinstance(self.schedule, LiveSchedule):
            return _stacked([self.schedule.reports[task.device] for task in tasks])
        n, d, dtype = len(tasks), self.state.x.size, self.state.x.dtype
        vectors = {name: np.zeros((n, d), dtype) for name in self.algorithm.reports}
        measured = {name: np.full(n, np.nan, np.float32) for name in ("elapsed", "cpu", "freq", "temp")}
        compiled, bytes_up = np.zeros(n, bool), np.zeros(n, np.int64)
        for version in sorted({task.version for task in tasks}):
            rows = np.array([i for i, task in enumerate(tasks) if task.version == version])
            ids = np.array([tasks[i].device for i in rows], np.int64)
            plan = RoundPlan(version + 1, ids, self._budgets[ids], self.learning_rate(version + 1),
                             steps=np.array([tasks[i].steps for i in rows], np.int32), down_bytes=self.down_bytes())
            res = self.transport.local_work(plan, self.versions[version])
            for name in vectors:
                vectors[name][rows] = res.vectors[name]
            for name, values in zip(measured, (res.elapsed_s, res.cpu_percent, res.cpu_freq_mhz, res.temperature_c)):
                measured[name][rows] = values
            compiled[rows], bytes_up[rows] = res.compiled, 0 if res.bytes_up is None else res.bytes_up
        ids = np.array([task.device for task in tasks], np.int64)
        steps = np.array([task.steps for task in tasks], np.int32)
        if self.timing.boards is None:  # a replay without the boards: the links' time is not known
            comm = np.full(n, np.nan)
        else:
            comm = self.timing.boards.comm_or_zero(ids) + self.timing.transfer_s(ids, self.down_bytes() + bytes_up)
        finish = np.array([task.finish_s for task in tasks])
        return LocalResults(vectors, steps, measured["elapsed"], measured["cpu"], np.zeros(n, bool), measured["freq"],
                            measured["temp"], compiled, finish, comm.astype(np.float32), np.full(n, -1, np.int16),
                            comm.astype(np.float32), bytes_up=bytes_up)

    def round(self, round_idx: int) -> ServerState:
        wall0 = time.perf_counter()
        a, t = self.cfg.asynchronous, self.cfg.train
        update = self.schedule.next_update(self.federation.ids)
        res = self._reports(update.taken)
        ids = np.array(sorted(task.device for task in update.taken), np.int64)
        version_of = {task.device: task.version for task in update.taken}
        staleness = np.array([round_idx - 1 - version_of[int(k)] for k in ids], np.int64)
        nonfinite = np.zeros(ids.size, bool)
        for values in res.vectors.values():
            nonfinite |= ~np.isfinite(values).all(axis=1)
        coeffs = np.where(nonfinite, 0.0, buffer_coefficients(staleness, a.buffer, a.staleness, a.staleness_exponent))
        reported = (coeffs != 0.0) & (res.steps > 0)
        coeffs[~reported] = 0.0
        reports = RoundReports(ids, res.vectors, coeffs, reported, t.lr_global, self.federation.ids.size)
        # central privacy: w(tau_k) Delta_k clipped to C, a_k = M p_k (docs/design.md 2.19)
        state, extra = self.privacy.server_update(self.algorithm, self.state, reports, a.buffer, round_idx)
        self.state = self._declared(state, "server_update")
        self.versions[round_idx] = self.state
        self._learn(round_idx, ids, res, reported)
        for v in [v for v in self.versions if v < round_idx - self.window]:
            del self.versions[v]  # no task of it can be taken any more
        self.clock.clock_s = update.time_s
        if round_idx < self.cfg.rounds:  # the last update starts no task: none of them would be used
            self.schedule.after_update(self.federation.ids)

        evaluate, store = self._due(round_idx)
        metrics = self.metrics(self.transport.evaluate(self.state.x)) if evaluate else (math.nan,) * 3
        elapsed = time.perf_counter() - wall0
        self.log.ensure_room()
        self.log.append({**self._update_row(round_idx, update, ids, res, coeffs, nonfinite, staleness, metrics,
                                            elapsed), **extra})
        self._count_labels(ids)
        elapsed = self._stage_and_commit(round_idx, None, store, wall0=wall0)
        discarded = sum(1 for task in update.discarded if task.device not in set(ids.tolist()))  # as the row says
        self.on_round(RoundSummary(round_idx, self.cfg.rounds, *metrics, int(reported.sum()), self.federation.ids.size,
                                   int(nonfinite.sum()), elapsed, discarded, int(res.steps.sum()),
                                   int(self._budgets[ids].sum()), int(reported.sum()), evaluate))
        return self.state

    def _update_row(self, round_idx, update, ids, res, coeffs, nonfinite, staleness, metrics, elapsed) -> dict:
        """Row t of the log: the taken reports as a round's selected devices, the discarded ones late."""
        discarded = sorted((task for task in update.discarded if task.device not in set(ids.tolist())),
                           key=lambda task: task.device)  # a device redrawn after its discard may report too
        late_ids = np.array([task.device for task in discarded], np.int64)
        every = np.concatenate([ids, late_ids])
        order = np.argsort(every, kind="stable")
        n_late = late_ids.size

        def widen(values, fill):  # the taken reports' values, then the discarded ones', in device order
            return np.concatenate([values, np.full(n_late, fill, np.asarray(values).dtype)])[order]

        late_steps = np.array([task.steps for task in discarded], np.int32)
        steps = np.concatenate([res.steps, late_steps])[order]
        late = np.concatenate([np.zeros(ids.size, bool), np.ones(n_late, bool)])[order]
        plan = RoundPlan(round_idx, every[order], self._budgets[every[order]], self.learning_rate(round_idx),
                         down_bytes=self.down_bytes())
        comm = widen(res.comm_s, np.nan)
        row_res = LocalResults({}, steps, widen(res.elapsed_s, np.nan), widen(res.cpu_percent, np.nan), late,
                               widen(res.cpu_freq_mhz, np.nan), widen(res.temperature_c, np.nan),
                               widen(res.compiled, False), widen(res.finish_s, np.nan), comm, widen(res.core, -1), comm,
                               bytes_up=widen(res.bytes_up, 0))
        settled = Settled(late, steps, comm, math.nan, math.nan, self.clock.busy_s(plan.device_ids, steps, row_res))
        tasks = {task.device: task for task in (*update.taken, *discarded)}
        held = np.array([tasks[k].finish_s - tasks[k].start_s for k in plan.device_ids.tolist()])  # its task's time
        row = self._round_row(plan, row_res, settled, widen(coeffs, 0.0), widen(nonfinite, False), metrics, elapsed,
                              self.clock.clock_s, held)
        tau = np.full(self.n_devices, -1, np.int32)
        tau[ids] = staleness
        tau[late_ids] = [round_idx - 1 - task.version for task in discarded]
        row["participation/staleness"] = tau
        for sent in self._asked:
            sent[:] = 0
        return row


def _stacked(results: list[LocalResults]) -> LocalResults:
    """One LocalResults of single-device ones, rows in the list's order."""
    vectors = {name: np.concatenate([r.vectors[name] for r in results]) for name in results[0].vectors}
    rows = {f.name: np.concatenate([getattr(r, f.name) for r in results])
            for f in dataclasses.fields(LocalResults)
            if f.name not in ("vectors", "round_s") and getattr(results[0], f.name) is not None}
    return LocalResults(vectors, **rows)


class LiveSchedule:
    """FedBuff on a real federation (under MPI, the measured clock): each task goes to its device's rank as
    it starts, from the latest model; reports are taken in the order they arrive, which the log records, so
    a replay of the log is exact."""

    def __init__(self, engine: AsyncEngine):
        self.engine, self.a = engine, engine.cfg.asynchronous
        self.version = self.draws = 0
        self.flight: dict[int, tuple[int, float]] = {}  # device -> (start version, start s)
        self.buffered: list[tuple[Task, LocalResults]] = []
        self.reports: dict[int, LocalResults] = {}  # of the update just made
        self.t0 = time.perf_counter()

    def busy(self) -> set[int]:
        return set(self.flight) | {task.device for task, _ in self.buffered}

    def _start(self, members: np.ndarray, now: float) -> None:
        e = self.engine
        if e.considered:  # a selection policy chooses among the idle members
            idle = idle_members(members, self.busy())
            device = e._pick(self.draws + 1, idle)[0] if idle.size else None
        else:
            device = draw_idle(e.cfg.seed, self.draws + 1, members, self.busy())
        if device is None:
            return
        self.draws += 1
        ids = np.array([device], np.int64)
        deadline = None if e.timing.deadlines is None else e.timing.deadlines[ids]  # the task stops at it
        plan = RoundPlan(self.version + 1, ids, e._budgets[ids], e.learning_rate(self.version + 1),
                         steps=e._budgets[ids].astype(np.int32), deadline_s=deadline, down_bytes=e.down_bytes())
        e.transport.start_task(plan, e.state.x)
        self.flight[device] = (self.version, now)

    def fill(self, members: np.ndarray, now: float | None = None) -> None:
        now = time.perf_counter() - self.t0 if now is None else now
        while len(self.flight) < self.a.concurrency and len(self.busy()) < len(members):
            self._start(members, now)

    def after_update(self, members: np.ndarray) -> None:
        """The M-th report's slot, and any free one, start from the new model."""
        self.fill(members)

    def next_update(self, members: np.ndarray) -> Update:
        discarded = []
        while len(self.buffered) < self.a.buffer:
            if not self.flight:
                raise RuntimeError("no task in flight: the federation has fewer idle members than the buffer needs")
            device, res, when = self.engine.transport.next_report()
            now = when - self.t0
            version, start = self.flight.pop(device)
            task = Task(now, device, version, start, int(res.steps[0]))
            if self.version - version > self.a.max_staleness:
                discarded.append(task)
            else:
                self.buffered.append((task, res))
            if len(self.buffered) < self.a.buffer:
                self._start(members, now)
        self.version += 1
        taken, self.buffered = self.buffered, []
        self.reports = {task.device: res for task, res in taken}
        return Update(self.version, taken[-1][0].finish_s, tuple(task for task, _ in taken), tuple(discarded))
