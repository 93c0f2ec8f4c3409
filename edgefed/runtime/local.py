"""The in-process transport (the simulator): every device lives in this process, built when first used."""

from __future__ import annotations

import time

import numpy as np

from edgefed.algorithms import scaffold
from edgefed.rng import Purpose, kernel_state
from edgefed.runtime.messages import Evaluation, LocalResults, RoundPlan


class LocalTransport:
    """Runs the client algorithm for each selected device; holds the devices' data and SCAFFOLD controls."""

    def __init__(self, problem, model, client, seed: int, batch_size: int | None):
        self.problem, self.model, self.client = problem, model, client
        self.seed, self.batch_size = seed, batch_size
        self._devices = {}
        self.controls = None  # (N, d) device controls c_k, SCAFFOLD only
        self._pending = None  # (device ids, Delta c rows) of the last round, until the coordinator accepts

    def data(self, device_id: int):
        data = self._devices.get(device_id)
        if data is None:
            data = self._devices[device_id] = self.problem.device(device_id)
        return data

    def init_controls(self, x0: np.ndarray, init: str) -> np.ndarray:
        """Every device's c_k^0; each device keeps its own, the coordinator gets a copy for the log."""
        self.controls = np.stack([scaffold.initial_controls(self.model, self.data(k), x0, init)
                                  for k in range(self.problem.n_devices)])
        return self.controls.copy()

    def load_controls(self, controls: np.ndarray) -> None:
        self.controls = np.array(controls, dtype=self.model.dtype)

    def local_work(self, plan: RoundPlan, x: np.ndarray, c: np.ndarray | None = None) -> LocalResults:
        n_sel, d = plan.device_ids.size, x.shape[0]
        deltas = np.empty((n_sel, d), dtype=x.dtype)
        delta_c = np.zeros((n_sel, d), dtype=x.dtype) if self.controls is not None else None
        steps = np.zeros(n_sel, np.int32)
        elapsed = np.zeros(n_sel, np.float32)
        cpu = np.full(n_sel, np.nan, np.float32)
        for i, k in enumerate(plan.device_ids):
            k = int(k)
            data = self.data(k)
            run = self.model.begin(data, kernel_state(self.seed, Purpose.LOCAL, plan.round_idx, k))
            control_run = None
            if self.client.needs_control_stream:
                control_run = self.model.begin(data, kernel_state(self.seed, Purpose.CONTROL, plan.round_idx, k))
            c_k = None if self.controls is None else self.controls[k]
            dc = None if delta_c is None else delta_c[i]
            wall0, cpu0 = time.perf_counter(), time.process_time()
            steps[i] = self.client.local_update(self.model, data, run, control_run, int(plan.budgets[i]),
                                                self.batch_size, plan.lr, x, c, c_k, deltas[i], dc)
            wall = time.perf_counter() - wall0
            elapsed[i] = wall
            if wall > 0:
                cpu[i] = 100.0 * (time.process_time() - cpu0) / wall
        if delta_c is not None:
            self._pending = (plan.device_ids, delta_c)
        return LocalResults(deltas, steps, elapsed, cpu, delta_c)

    def accept(self, device_ids: np.ndarray) -> None:
        """The coordinator kept these devices' reports: they apply their Delta c_k."""
        if self._pending is None:
            return
        ids, delta_c = self._pending
        for i in np.flatnonzero(np.isin(ids, device_ids)):
            self.controls[ids[i]] += delta_c[i]
        self._pending = None

    def evaluate(self, x: np.ndarray) -> Evaluation:
        n = self.problem.n_devices
        train = np.full(n, np.nan)
        test_loss = np.zeros(n)
        correct = np.zeros(n, np.int64)
        n_test = np.zeros(n, np.int64)
        for k in range(n):
            data = self.data(k)
            train[k] = self.model.train_loss(x, data)
            if self.problem.has_test:
                test_loss[k], correct[k] = self.model.loss_correct(x, data.X_test, data.y_test)
                n_test[k] = data.y_test.size
        return Evaluation(train, test_loss, correct, n_test)

    def close(self) -> None:
        self._devices.clear()
