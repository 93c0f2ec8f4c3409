"""Devices hosted in this process: the simulator's transport, and the worker behind every MPI device rank.

A `LocalTransport` hosts some devices (all of them in the simulator, its own share on an MPI rank): it
builds their data when first used, keeps their SCAFFOLD controls, runs the client algorithm for each
selected device (all K steps, a trace's steps, or as many as fit in the deadline), injects configured
faults, drives the CPU competitor, and measures what each device's work cost.
"""

from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from edgefed.algorithms import scaffold
from edgefed.errors import EdgefedError
from edgefed.kernels import jit_compilations
from edgefed.models import warm_model
from edgefed.rng import Purpose, kernel_state
from edgefed.runtime.contention import Competitor, pin
from edgefed.runtime.deadline import BoardReadings, DeadlineRunner, run_all
from edgefed.runtime.messages import Evaluation, LocalResults, RoundPlan


class InjectedFault(EdgefedError):
    """A `[[fault]] kind = "raise"` of the config went off."""


def _lowest_priority() -> None:
    """Make the calling thread yield to a competitor on its core (Linux: per-thread nice 19).

    Without this the scheduler splits a contended core about 50/50 whatever the competitor's duty cycle,
    and a 90 % competitor would cost the device only half its CPU.
    """
    if hasattr(os, "setpriority"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class LocalTransport:
    def __init__(self, problem, model, client, seed: int, batch_size: int | None, device_ids=None,
                 faults=(), contention=(), core: int | None = None):
        self.problem, self.model, self.client = problem, model, client
        self.eval_model = model.clone()  # evaluation may run while a late worker still computes
        self.seed, self.batch_size = seed, batch_size
        n = problem.n_devices
        self.device_ids = np.arange(n) if device_ids is None else np.asarray(device_ids, dtype=np.int64)
        self._row = {int(k): i for i, k in enumerate(self.device_ids)}
        if hasattr(problem, "host"):
            problem.host(self.device_ids)
        self._devices = {}
        self._faults = {(f.device, f.round): f for f in faults}
        self.controls = None  # (hosted devices, d) SCAFFOLD controls c_k, in device_ids order
        self._pending = None  # (round, device ids, Delta c rows) until the coordinator accepts them
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

    # -- SCAFFOLD controls -------------------------------------------------------------------------------
    def init_controls(self, x0: np.ndarray, init: str) -> np.ndarray:
        """The hosted devices' c_k^0; each device keeps its own, the coordinator gets a copy for the log."""
        self.controls = np.stack([scaffold.initial_controls(self.eval_model, self.data(int(k)), x0, init)
                                  for k in self.device_ids]) if self.device_ids.size else np.zeros((0, x0.size))
        return self.controls.copy()

    def reset_controls(self, x: np.ndarray, init: str, device_ids: np.ndarray) -> np.ndarray:
        """Fresh controls for these (hosted) devices, e.g. on arrival; returns their rows."""
        rows = np.stack([scaffold.initial_controls(self.eval_model, self.data(int(k)), x, init) for k in device_ids])
        for k, row in zip(device_ids, rows):
            self.controls[self._row[int(k)]] = row
        return rows

    def load_controls(self, controls: np.ndarray) -> None:
        """Restore the hosted devices' controls (rows in device_ids order)."""
        self.controls = np.array(controls, dtype=self.model.dtype)

    def accept(self, round_idx: int, device_ids: np.ndarray) -> None:
        """The coordinator kept these devices' reports of round_idx: they apply their Delta c_k."""
        if self._pending is None or self._pending[0] != round_idx:
            return  # nothing pending, or a late round the coordinator dropped
        _, ids, delta_c = self._pending
        for i in np.flatnonzero(np.isin(ids, device_ids)):
            self.controls[self._row[int(ids[i])]] += delta_c[i]
        self._pending = None

    # -- local work --------------------------------------------------------------------------------------
    def local_work(self, plan: RoundPlan, x: np.ndarray, c: np.ndarray | None = None) -> LocalResults:
        if self._pool is None:
            return self.work(plan, x, c)
        return self._pool.submit(self.work, plan, x, c).result()

    def submit(self, plan: RoundPlan, x: np.ndarray, c: np.ndarray | None):
        """Start the round's work on the worker thread (MPI device ranks); returns a Future."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1)
        return self._pool.submit(self.work, plan, x, c)

    def work(self, plan: RoundPlan, x: np.ndarray, c: np.ndarray | None) -> LocalResults:
        """Run the selected (hosted) devices of the plan one after the other, each from x."""
        n_sel, d = plan.device_ids.size, x.shape[0]
        deltas = np.zeros((n_sel, d), dtype=x.dtype)
        delta_c = np.zeros((n_sel, d), dtype=x.dtype) if self.controls is not None else None
        steps = np.zeros(n_sel, np.int32)
        elapsed, cpu = np.zeros(n_sel, np.float32), np.full(n_sel, np.nan, np.float32)
        freq, temp = np.full(n_sel, np.nan, np.float32), np.full(n_sel, np.nan, np.float32)
        late, compiled = np.zeros(n_sel, bool), np.zeros(n_sel, bool)
        for i, k in enumerate(plan.device_ids):
            k = int(k)
            data = self.data(k)
            if self.competitor is not None:
                self.competitor.set_load(self.contention[k % len(self.contention)])
            run = self.model.begin(data, kernel_state(self.seed, Purpose.LOCAL, plan.round_idx, k))
            control_run = None
            if self.client.needs_control_stream:
                control_run = self.model.begin(data, kernel_state(self.seed, Purpose.CONTROL, plan.round_idx, k))
            c_k = None if self.controls is None else self.controls[self._row[k]]
            compiled_before = jit_compilations()
            wall0, cpu0 = time.perf_counter(), time.thread_time()
            self._inject_fault(k, plan.round_idx)
            runner = run_all if plan.deadline_s is None else DeadlineRunner(float(plan.deadline_s[i]))
            steps[i] = self.client.local_update(self.model, data, run, control_run, runner, plan.steps_to_run(i),
                                                self.batch_size, plan.lr, x, c, c_k, deltas[i],
                                                None if delta_c is None else delta_c[i])
            wall = time.perf_counter() - wall0
            compiled[i] = jit_compilations() > compiled_before
            elapsed[i] = wall
            cpu[i] = 100.0 * (time.thread_time() - cpu0) / wall if wall > 0 else math.nan
            freq[i], temp[i] = self.readings.frequency_mhz(), self.readings.temperature_c()
            if plan.deadline_s is not None and wall > plan.deadline_s[i] + plan.grace_s:
                late[i] = True  # in one process a hung device is only noticed afterwards; its work is dropped
                steps[i] = 0
                deltas[i] = 0
                if delta_c is not None:
                    delta_c[i] = 0
        if self.competitor is not None:
            self.competitor.set_load(0.0)
        if delta_c is not None:
            self._pending = (plan.round_idx, plan.device_ids.copy(), delta_c)
        return LocalResults(deltas, steps, elapsed, cpu, delta_c, late, freq, temp, compiled)

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
