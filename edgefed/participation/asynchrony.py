"""Buffered asynchronous aggregation (FedBuff; Nguyen et al., AISTATS 2022) as arithmetic: the staleness
weights, the buffer's coefficients, and the schedule of tasks on a simulated clock.

C devices train at any time, each from the latest server model (version v) when it starts; reports are
taken in the order they finish (ties: the lower device id); every M taken reports make server update t:
x_t = x_{t-1} + eta_g sum_{k in the buffer} (w(tau_k) / M) Delta_k with tau_k = t - 1 - v_k. A report staler
than max_staleness is discarded (it counts towards no buffer). As soon as a report is taken (or discarded)
its device's slot starts a new task on a device drawn uniformly from the idle members: not training, and
not holding a report in the buffer being filled, so no buffer holds two reports of one device and no device
starts two tasks from one version. A task is named by (device, start version): the key of its streams.

Nothing here reads a clock or runs a model: the caller says how long a task takes on its device.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from edgefed.ids import find
from edgefed.rng import Purpose, generator

STALENESS = ("constant", "polynomial")


def staleness_weights(tau: np.ndarray, rule: str, exponent: float = 0.5) -> np.ndarray:
    """w(tau): 1 ("constant"), or (1 + tau)^-a ("polynomial"), in float64."""
    tau = np.asarray(tau, np.float64)
    if rule == "constant":
        return np.ones_like(tau)
    if rule == "polynomial":
        return (1.0 + tau) ** -float(exponent)
    raise ValueError(f"unknown staleness rule {rule!r}; choose from {', '.join(STALENESS)}")


def buffer_coefficients(tau: np.ndarray, buffer: int, rule: str, exponent: float = 0.5) -> np.ndarray:
    """p_k = w(tau_k) / M of the buffer's reports: what FedAvg's server update (2.4) multiplies Delta_k by."""
    return staleness_weights(tau, rule, exponent) / float(buffer)


@dataclass(frozen=True, order=True)
class Task:
    """One device's local work: ordered by when its report arrives, then by device id."""

    finish_s: float
    device: int
    version: int = field(compare=False)  # the server model it started from
    start_s: float = field(compare=False)
    steps: int = field(compare=False)


@dataclass(frozen=True)
class Update:
    """The reports that made server update t (taken: in arrival order) and those discarded while it filled."""

    version: int  # t
    time_s: float  # when the M-th report arrived
    taken: tuple[Task, ...]
    discarded: tuple[Task, ...]

    def staleness(self) -> np.ndarray:
        return np.array([self.version - 1 - task.version for task in self.taken], np.int64)


def draw_idle(seed: int, draw: int, members: np.ndarray, busy: set[int]) -> int | None:
    """The device the draw-th draw (1-based) starts a task on: uniform over the idle members (ascending), from
    its own stream; None when every member is busy. The draw is an index into the idle members (NumPy's
    choice of an array draws its index as of their count), found past the busy ones by search: no array of
    every idle member is made."""
    members = np.asarray(members, np.int64)
    taken = _positions(members, busy)
    if members.size - taken.size == 0:
        return None
    k = int(generator(seed, Purpose.ASYNC_SELECT, draw).choice(members.size - taken.size))
    for p in taken:  # the k-th idle member: step over each busy one at or before it
        if p > k:
            break
        k += 1
    return int(members[k])


def _positions(members: np.ndarray, busy: set[int]) -> np.ndarray:
    """Where the busy devices that are members sit among the (ascending) members, ascending."""
    at, found = find(members, sorted(busy))
    return at[found]


def idle_members(members: np.ndarray, busy: set[int]) -> np.ndarray:
    """The members not busy (a policy's view of whom it may start a task on)."""
    members = np.asarray(members, np.int64)
    return np.delete(members, _positions(members, busy))


class Schedule:
    """Tasks in flight on a simulated clock. `duration(device) -> (steps, seconds)` says how much a task of
    that device does and how long it takes (its steps at its board's speed, plus its links); `pick(draw,
    idle) -> (device, seconds)`, when given, chooses the device a task starts on (a selection policy) and
    what choosing took before it starts; by default it is drawn uniformly."""

    def __init__(self, seed: int, concurrency: int, buffer: int, max_staleness: int, duration, pick=None):
        self.seed, self.concurrency, self.buffer, self.max_staleness = seed, concurrency, buffer, max_staleness
        self.duration, self.pick = duration, pick
        self.version = 0  # the latest server model
        self.draws = 0  # devices drawn so far: the key of the next draw's stream
        self.flight: list[Task] = []  # a heap
        self.buffered: list[Task] = []

    def busy(self) -> set[int]:
        return {t.device for t in self.flight} | {t.device for t in self.buffered}

    def _start(self, members: np.ndarray, now: float) -> None:
        """One new task on an idle member (none when every member is busy)."""
        if self.pick is None:
            device, chosen_s = draw_idle(self.seed, self.draws + 1, members, self.busy()), 0.0
        else:
            idle = idle_members(members, self.busy())
            device, chosen_s = self.pick(self.draws + 1, idle) if idle.size else (None, 0.0)
        if device is None:
            return
        self.draws += 1
        steps, seconds = self.duration(device)
        start = now + float(chosen_s)
        heapq.heappush(self.flight, Task(start + float(seconds), device, self.version, start, int(steps)))

    # -- resume: with a selection policy the draws depend on what the run reported, so the tasks in flight
    # are kept in the log rather than simulated again
    def state(self) -> dict:
        flight = np.full((self.concurrency, 5), np.nan)
        for i, t in enumerate(self.flight):
            flight[i] = (t.finish_s, t.device, t.version, t.start_s, t.steps)
        return {"async_flight": flight, "async_counters": np.array([self.version, self.draws], np.int64)}

    def restore(self, values: dict) -> None:
        self.version, self.draws = (int(v) for v in values["async_counters"])
        self.flight = [Task(float(f), int(d), int(v), float(s), int(n)) for f, d, v, s, n in values["async_flight"]
                       if not math.isnan(f)]
        heapq.heapify(self.flight)
        self.buffered = []

    def fill(self, members: np.ndarray, now: float = 0.0) -> None:
        """Start tasks until `concurrency` are in flight (or every member is busy)."""
        while len(self.flight) < self.concurrency and len(self.busy()) < len(members):
            self._start(members, now)

    def next_update(self, members: np.ndarray) -> Update:
        """Take reports in arrival order until M are buffered; each taken or discarded report's slot starts
        a new task at its arrival. Returns server update version + 1 (the caller applies it)."""
        discarded = []
        while len(self.buffered) < self.buffer:
            if not self.flight:
                raise RuntimeError("no task in flight: the federation has fewer idle members than the buffer needs")
            task = heapq.heappop(self.flight)
            if self.version - task.version > self.max_staleness:
                discarded.append(task)
            else:
                self.buffered.append(task)
            if len(self.buffered) < self.buffer:  # the M-th report's slot starts once the model is new
                self._start(members, task.finish_s)
        taken, self.buffered = tuple(self.buffered), []
        self.version += 1
        now = taken[-1].finish_s
        self.fill(members, now)
        return Update(self.version, now, taken, tuple(discarded))

    def after_update(self, members: np.ndarray) -> None:
        """Nothing: the new tasks started with the update (their reports are computed when taken)."""


class Recorded:
    """The schedule of a recorded async run, update by update as its log holds it (participation.trace =
    RUN.h5 with mode = "async"): which reports each update took and discarded, from which versions, with
    how many steps, and when."""

    def __init__(self, staleness: np.ndarray, late: np.ndarray, steps: np.ndarray, clock_s: np.ndarray | None,
                 candidate: np.ndarray | None = None, utility: np.ndarray | None = None):
        self.staleness, self.late, self.steps, self.clock_s = staleness, late, steps, clock_s
        self.candidate, self.utility = candidate, utility  # a selection policy's rows, copied into the replay
        self.version = 0

    def fill(self, members: np.ndarray, now: float = 0.0) -> None:
        """Nothing to start: the recorded tasks are the log's."""

    def next_update(self, members: np.ndarray) -> Update:
        t = self.version + 1
        tau, late, steps = self.staleness[t - 1], self.late[t - 1], self.steps[t - 1]

        def tasks(mask):
            return tuple(Task(math.nan, int(k), int(t - 1 - tau[k]), math.nan, int(steps[k])) for k in np.flatnonzero(mask))

        self.version = t
        when = math.nan if self.clock_s is None else float(self.clock_s[t])
        return Update(t, when, tasks((tau >= 0) & ~late), tasks((tau >= 0) & late))

    def after_update(self, members: np.ndarray) -> None:
        """Nothing: the recorded tasks are the log's."""
