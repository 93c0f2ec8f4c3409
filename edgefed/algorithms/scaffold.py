"""SCAFFOLD (Karimireddy et al., ICML 2020; docs/design.md 2.5): control variates c_k on the devices, c on the server.

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

from edgefed.algorithms.base import DELTA_X, Algorithm, DeviceRows, DeviceVector, ServerState, ServerVector
from edgefed.algorithms.fedavg import ascending, server_update
from edgefed.kernels.sgd import step_terms
from edgefed.rng import Purpose

OPTIONS = ("I", "II")
INITS = ("zero", "gradient")
CONTROL_GRADIENTS = ("oracle", "full")


@dataclass(frozen=True)
class Scaffold(Algorithm):
    option: str = "II"  # "I" or "II"
    init: str = "zero"  # c_k^0: "zero", or "gradient" (the full local gradient at x_0)
    control_gradient: str = "oracle"  # option I's g_k(x): one minibatch ("oracle") or the full gradient

    default_weighting = "uniform"  # the paper's 1/S
    server_vectors = (ServerVector("c", "scaffold/c", "server control c after those rounds"),)
    device_vectors = (DeviceVector("c_clients", "scaffold/c_clients", "device controls c_k (row k)", "delta_c",
                                   "SCAFFOLD", "controls"),)
    report_vectors = ("delta_c",)
    model_calls = ("oracle_grad", "loss_grad")

    @property
    def zero_start(self) -> bool:
        return self.init == "zero"

    @classmethod
    def from_config(cls, cfg) -> "Scaffold":
        s = cfg.scaffold
        return cls(s.option, s.init, s.control_gradient)

    def client_update(self, model, data, task, out):
        """Corrected local SGD from x; Delta x_k and Delta c_k out (c_k itself is not touched)."""
        x, c, c_k = task.x, task.server["c"], task.own["c_clients"]
        y = x.copy()
        terms = step_terms(x.dtype, correction=c - c_k)
        run = task.stream(Purpose.LOCAL)
        steps = task.runner(lambda n: model.local_steps(y, data, run, n, task.batch_size, task.lr, terms),
                            task.n_steps)
        np.subtract(y, x, out=out[DELTA_X])
        out_dc = out["delta_c"]
        out_dc[:] = 0
        if steps == 0:
            return 0
        if self.option == "I":
            c_new = np.empty_like(x)
            if self.control_gradient == "full" or task.batch_size is None:
                model.loss_grad(x, data, c_new)
            else:
                model.oracle_grad(x, data, task.stream(Purpose.CONTROL), task.batch_size, c_new)
        else:
            c_new = c_k - c + (x - y) / x.dtype.type(steps * task.lr)
        np.subtract(c_new, c_k, out=out_dc)
        return steps

    def server_update(self, state, reports):
        x = server_update(state.x, reports.device_ids, reports.vectors[DELTA_X], reports.coeffs, reports.lr_global)
        ok = reports.reported
        c = server_control_update(state.vectors["c"], reports.device_ids[ok], reports.vectors["delta_c"][ok],
                                  reports.n_federation)
        return ServerState(x, {"c": c})

    def device_start(self, model, data, x):
        return {"c_clients": initial_controls(model, data, x, self.init)}

    def server_start(self, x0, member_rows):
        return {"c": mean_control(member_rows["c_clients"], x0.dtype)}

    def federation_changed(self, state, member_rows):
        """c re-averaged over the new federation, so c = mean c_k holds across the shift."""
        return ServerState(state.x, {**state.vectors, "c": mean_control(member_rows["c_clients"], state.x.dtype)})


def initial_controls(model, data, x0: np.ndarray, init: str) -> np.ndarray:
    """c_k^0 of one device: zero, or its full local gradient at x0 (the initialization the paper's rates use)."""
    c_k = np.zeros_like(x0)
    if init == "gradient":
        model.loss_grad(x0, data, c_k)
    return c_k


def mean_control(controls: DeviceRows, dtype) -> np.ndarray:
    """c = (1/N) sum_k c_k over the N members (ascending device id), accumulated in float64. Members whose
    c_k is not held are zero: skipping them is exact (the sum starts at +0.0 and adding +0.0 changes nothing)."""
    acc = np.zeros(controls.rows.shape[1], dtype=np.float64)
    for row in controls.rows:
        acc += row
    return (acc / controls.n).astype(dtype)


def server_control_update(c: np.ndarray, device_ids, delta_cs: np.ndarray, n_federation: int) -> np.ndarray:
    """c + (1/N) sum_k Delta c_k over the reporting devices, N the whole federation (not |S_r|)."""
    acc = np.zeros(c.shape[0], dtype=np.float64)
    for i in ascending(device_ids):
        acc += delta_cs[i].astype(np.float64)
    return (c.astype(np.float64) + acc / n_federation).astype(c.dtype)
