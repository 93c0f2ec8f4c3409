"""SCAFFOLD (seed 002, DESIGN 2.5): control variates c_k on the devices, c on the server.

Local step: y <- y - lr * (g_k(y) - c_k + c), done inside the model's kernel with correction = c - c_k.
Control update after s_k > 0 steps: option I c_k+ = g_k(x) (one more oracle call at the round-start model,
from the device's CONTROL stream; `control_gradient = "full"` uses the full local gradient instead);
option II c_k+ = c_k - c + (x - y_k) / (s_k lr), with the steps actually taken. Devices report
Delta c_k = c_k+ - c_k and apply c_k <- c_k + Delta c_k only once the coordinator has accepted their report
(it may drop a non-finite or late one), so the devices, the server and the run log, which tracks every c_k
from the same Deltas, never disagree. A device that took no step keeps its control. Server:
c <- c + (1/N) sum over accepted devices of Delta c_k, which keeps c = mean_k c_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgefed.algorithms.fedavg import ascending


@dataclass(frozen=True)
class ScaffoldClient:
    option: str  # "I" or "II"
    control_batch: int | None  # option I's oracle batch; None: the full local gradient

    name = "scaffold"

    @property
    def needs_control_stream(self) -> bool:
        return self.option == "I" and self.control_batch is not None

    def local_update(self, model, data, run, control_run, runner, n_steps, batch_size, lr, x, c, c_k, out_dx,
                     out_dc):
        """Corrected local SGD from x; out_dx <- Delta x_k, out_dc <- Delta c_k (c_k itself is not touched)."""
        y = x.copy()
        correction = c - c_k
        steps = runner(lambda n: model.local_steps(y, data, run, n, batch_size, lr, correction), n_steps)
        np.subtract(y, x, out=out_dx)
        out_dc[:] = 0
        if steps == 0:
            return 0
        if self.option == "I":
            c_new = np.empty_like(x)
            if self.control_batch is None:
                model.loss_grad(x, data, c_new)
            else:
                model.oracle_grad(x, data, control_run, self.control_batch, c_new)
        else:
            c_new = c_k - c + (x - y) / x.dtype.type(steps * lr)
        np.subtract(c_new, c_k, out=out_dc)
        return steps


def initial_controls(model, data, x0: np.ndarray, init: str) -> np.ndarray:
    """c_k^0 of one device: zero, or its full local gradient at x0 (the initialization the seed's rates use)."""
    c_k = np.zeros_like(x0)
    if init == "gradient":
        model.loss_grad(x0, data, c_k)
    return c_k


def mean_control(controls: np.ndarray, dtype) -> np.ndarray:
    """c = (1/N) sum_k c_k over the rows given (ascending device id), accumulated in float64."""
    acc = np.zeros(controls.shape[1], dtype=np.float64)
    for row in controls:
        acc += row
    return (acc / controls.shape[0]).astype(dtype)


def server_control_update(c: np.ndarray, device_ids, delta_cs: np.ndarray, n_federation: int) -> np.ndarray:
    """c + (1/N) sum_k Delta c_k over the reporting devices, N the whole federation (not |S_r|)."""
    acc = np.zeros(c.shape[0], dtype=np.float64)
    for i in ascending(device_ids):
        acc += delta_cs[i].astype(np.float64)
    return (c.astype(np.float64) + acc / n_federation).astype(c.dtype)
