"""Devices hosted in this process: the simulator's transport, and the worker behind every MPI device rank.

A `LocalTransport` hosts some devices (all of them in the simulator, its own share on an MPI rank): it
builds their data when first used, keeps the vectors the algorithm gives each device (SCAFFOLD's
controls), runs the algorithm's client update for each selected device (all K steps, a trace's steps, or
as many as fit in the deadline), injects configured faults, drives the CPU competitor, and measures what
each device's work cost.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from edgefed.algorithms.base import LocalTask
from edgefed.errors import EdgefedError
from edgefed.kernels import jit_compilations
from edgefed.models import warm_model
from edgefed.rng import kernel_state
from edgefed.runtime.contention import Competitor, pin
from edgefed.runtime.deadline import BoardReadings, DeadlineRunner, run_all
from edgefed.transport import Evaluation, LocalResults, RoundPlan


class InjectedFault(EdgefedError):
    """A `[[fault]] kind = "raise"` of the config went off."""


def _lowest_priority() -> None:
    """Make the calling thread yield to a competitor on its core (Linux: per-thread nice 19).

    Without this the scheduler splits a contended core about 50/50 whatever the competitor's duty cycle,
    and a 90 % competitor would cost the device only half its CPU.
    """
    if hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _read_only(values: np.ndarray) -> np.ndarray:
    view = values.view()
    view.flags.writeable = False
    return view


class LocalTransport:
    def __init__(self, problem, model, algorithm, seed: int, batch_size: int | None, device_ids=None,
                 faults=(), contention=(), core: int | None = None):
        self.problem, self.model, self.algorithm = problem, model, algorithm
        self.eval_model = model.clone()  # evaluation may run while a late worker still computes
        self.seed, self.batch_size = seed, batch_size
        n = problem.n_devices
        self.device_ids = np.arange(n) if device_ids is None else np.asarray(device_ids, dtype=np.int64)
        self._row = {int(k): i for i, k in enumerate(self.device_ids)}
        if hasattr(problem, "host"):
            problem.host(self.device_ids)
        self._devices = {}
        self._faults = {(f.device, f.round): f for f in faults}
        self.vectors = None  # {device vector: (hosted devices, d) rows in device_ids order}, e.g. SCAFFOLD's c_k
        self._pending = None  # (round, device ids, {delta name: rows}) until the coordinator accepts them
        self.readings = BoardReadings(core)
        self.contention = tuple(contention)
        self.competitor = None
        self._pool = None
        if self.contention:
            pin(core if core is not None else 0)
            self.competitor = Competitor(core if core is not None else 0)  # started before any priority drop
            self._pool = ThreadPoolExecutor(1, initializer=_lowest_priority)

    def data(self, device_id: int):
        data = self._devices.get(device_id)
        if data is None:
            data = self._devices[device_id] = self.problem.device(device_id)
        return data

    def warmup(self) -> tuple[int, float]:
        """Compile (or load from cache) every kernel a round uses, so no round pays for it.

        Returns (kernels compiled, seconds): compiled is 0 when the cache was warm (`edgefed warmup`).
        """
        if self.device_ids.size == 0:
            return 0, 0.0
        before, t0 = jit_compilations(), time.perf_counter()
        warm_model(self.model, self.data(int(self.device_ids[0])), self.batch_size)
        return jit_compilations() - before, time.perf_counter() - t0

    # -- device vectors (SCAFFOLD's controls) ------------------------------------------------------------
    def start_devices(self, x: np.ndarray, device_ids: np.ndarray) -> dict[str, np.ndarray]:
        """Fresh vectors for these (hosted) devices, joining at x; each device keeps its own, the caller gets
        a copy of their rows (in device_ids order) for the log."""
        vectors = self.algorithm.device_vectors
        if self.vectors is None:
            self.vectors = {v.name: np.zeros((self.device_ids.size, x.size), x.dtype) for v in vectors}
        fresh = [self.algorithm.device_start(self.eval_model, self.data(int(k)), x) for k in device_ids]
        rows = {v.name: np.stack([f[v.name] for f in fresh]) if fresh else np.zeros((0, x.size), x.dtype)
                for v in vectors}
        for name, values in rows.items():
            for k, row in zip(device_ids, values):
                self.vectors[name][self._row[int(k)]] = row
        return rows

    def load_devices(self, rows: dict[str, np.ndarray]) -> None:
        """Restore the hosted devices' vectors (rows in device_ids order; in the simulator, every device)."""
        self.vectors = {name: np.array(values, dtype=self.model.dtype) for name, values in rows.items()}

    def accept(self, round_idx: int, device_ids: np.ndarray) -> None:
        """The coordinator kept these devices' reports of round_idx: they add their Deltas to their vectors."""
        if self._pending is None or self._pending[0] != round_idx:
            return  # nothing pending, or a late round the coordinator dropped
        _, ids, deltas = self._pending
        for i in np.flatnonzero(np.isin(ids, device_ids)):
            for v in self.algorithm.device_vectors:
                self.vectors[v.name][self._row[int(ids[i])]] += deltas[v.delta][i]
        self._pending = None

    # -- local work --------------------------------------------------------------------------------------
    def local_work(self, plan: RoundPlan, state) -> LocalResults:
        if self._pool is None:
            return self.work(plan, state)
        return self._pool.submit(self.work, plan, state).result()

    def submit(self, plan: RoundPlan, state):
        """Start the round's work on the worker thread (MPI device ranks); returns a Future."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1)
        return self._pool.submit(self.work, plan, state)

    def work(self, plan: RoundPlan, state) -> LocalResults:
        """Run the selected (hosted) devices of the plan one after the other, each from the server state."""
        # In this process the devices read the server's own vectors and the engine reads the devices' reports
        # as they are: read only both ways, so no algorithm changes in place what an MPI rank would only see a
        # copy of. (x stays writable: the kernels are compiled for writable arrays; LocalTask says hands off.)
        x, algo = state.x, self.algorithm
        server = {name: _read_only(value) for name, value in state.vectors.items()}
        n_sel, d = plan.device_ids.size, x.shape[0]
        out = {name: np.zeros((n_sel, d), dtype=x.dtype) for name in algo.reports}
        steps = np.zeros(n_sel, np.int32)
        elapsed, cpu = np.zeros(n_sel, np.float32), np.full(n_sel, np.nan, np.float32)
        freq, temp = np.full(n_sel, np.nan, np.float32), np.full(n_sel, np.nan, np.float32)
        late, compiled = np.zeros(n_sel, bool), np.zeros(n_sel, bool)
        for i, k in enumerate(plan.device_ids):
            k = int(k)
            data = self.data(k)
            if self.competitor is not None:
                self.competitor.set_load(self.contention[k % len(self.contention)])
            own = {} if self.vectors is None else {name: _read_only(rows[self._row[k]])
                                                   for name, rows in self.vectors.items()}
            compiled_before = jit_compilations()
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            self._inject_fault(k, plan.round_idx)
            runner = run_all if plan.deadline_s is None else DeadlineRunner(float(plan.deadline_s[i]))
            task = LocalTask(x, server, own, plan.steps_to_run(i), plan.lr, self.batch_size, runner,
                             self._streams(data, plan.round_idx, k))
            steps[i] = algo.client_update(self.model, data, task, {name: rows[i] for name, rows in out.items()})
            wall = time.perf_counter() - wall0
            compiled[i] = jit_compilations() > compiled_before
            elapsed[i] = wall
            cpu[i] = 100.0 * (time.thread_time() - cpu0) / wall if wall > 0 else math.nan
            freq[i], temp[i] = self.readings.frequency_mhz(), self.readings.temperature_c()
            if plan.deadline_s is not None and wall > plan.deadline_s[i] + plan.grace_s:
                late[i] = True  # in one process a hung device is only noticed afterwards; its work is dropped
                steps[i] = 0
                for rows in out.values():
                    rows[i] = 0
        if self.competitor is not None:
            self.competitor.set_load(0.0)
        if algo.device_vectors:
            self._pending = (plan.round_idx, plan.device_ids.copy(), {v.delta: out[v.delta] for v in algo.device_vectors})
        return LocalResults({name: _read_only(rows) for name, rows in out.items()}, steps, elapsed, cpu, late, freq,
                            temp, compiled)

    def _streams(self, data, round_idx: int, device_id: int):
        """stream(purpose): the model's generator workspace on (seed, purpose, round, device)."""
        return lambda purpose: self.model.begin(data, kernel_state(self.seed, purpose, round_idx, device_id))

    def _inject_fault(self, device_id: int, round_idx: int) -> None:
        fault = self._faults.get((device_id, round_idx))
        if fault is None:
            return
        if fault.kind == "raise":
            raise InjectedFault(f"injected fault: device {device_id} raised in round {round_idx} ([[fault]] in the config)")
        time.sleep(fault.seconds)

    # -- evaluation --------------------------------------------------------------------------------------
    def evaluate(self, x: np.ndarray) -> Evaluation:
        """Evaluation of the hosted devices (others NaN / 0), indexed by device id."""
        n = self.problem.n_devices
        train = np.full(n, np.nan)
        test_loss = np.zeros(n)
        correct = np.zeros(n, np.int64)
        n_test = np.zeros(n, np.int64)
        for k in self.device_ids:
            data = self.data(int(k))
            train[k] = self.eval_model.train_loss(x, data)
            if self.problem.has_test:
                test_loss[k], correct[k] = self.eval_model.loss_correct(x, data.X_test, data.y_test)
                n_test[k] = data.y_test.size
        return Evaluation(train, test_loss, correct, n_test)

    def close(self, failed: bool = False) -> None:
        if self.competitor is not None:
            self.competitor.stop()
            self.competitor = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._devices.clear()
