"""The in-process transport (the simulator): every device lives in this process, built when first used."""

from __future__ import annotations

import time

import numpy as np

from edgefed.algorithms import fedavg
from edgefed.rng import Purpose, kernel_state
from edgefed.runtime.messages import Evaluation, LocalResults, RoundPlan


class LocalTransport:
    def __init__(self, problem, model, seed: int, batch_size: int | None):
        self.problem, self.model, self.seed, self.batch_size = problem, model, seed, batch_size
        self._devices = {}

    def data(self, device_id: int):
        data = self._devices.get(device_id)
        if data is None:
            data = self._devices[device_id] = self.problem.device(device_id)
        return data

    def local_work(self, plan: RoundPlan, x: np.ndarray) -> LocalResults:
        n_sel = plan.device_ids.size
        deltas = np.empty((n_sel, x.shape[0]), dtype=x.dtype)
        steps = np.zeros(n_sel, np.int32)
        elapsed = np.zeros(n_sel, np.float32)
        cpu = np.full(n_sel, np.nan, np.float32)
        for i, k in enumerate(plan.device_ids):
            data = self.data(int(k))
            run = self.model.begin(data, kernel_state(self.seed, Purpose.LOCAL, plan.round_idx, int(k)))
            wall0, cpu0 = time.perf_counter(), time.process_time()
            steps[i] = fedavg.client_update(self.model, x, data, run, int(plan.budgets[i]), self.batch_size,
                                            plan.lr, deltas[i])
            wall = time.perf_counter() - wall0
            elapsed[i] = wall
            if wall > 0:
                cpu[i] = 100.0 * (time.process_time() - cpu0) / wall
        return LocalResults(deltas, steps, elapsed, cpu)

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
