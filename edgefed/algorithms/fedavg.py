"""FedAvg (McMahan et al., docs/design.md 2.2-2.4): K local steps from the server model, then x + eta_g * sum p_k Delta_k."""

from __future__ import annotations

import numpy as np

from edgefed.algorithms.base import DELTA_X, Algorithm, ServerState
from edgefed.rng import Purpose


class FedAvg(Algorithm):
    """Plain local SGD on the device, no state kept between rounds; the weighted sum on the server."""

    default_weighting = "count_selected"

    def client_update(self, model, data, task, out):
        y = task.x.copy()
        run = task.stream(Purpose.LOCAL)
        steps = task.runner(lambda n: model.local_steps(y, data, run, n, task.batch_size, task.lr), task.n_steps)
        np.subtract(y, task.x, out=out[DELTA_X])
        return steps

    def server_update(self, state, reports):
        return ServerState(server_update(state.x, reports.device_ids, reports.vectors[DELTA_X], reports.coeffs,
                                         reports.lr_global))


def ascending(device_ids: np.ndarray) -> np.ndarray:
    """The order that visits rows by ascending device id: sums never depend on who answered first."""
    return np.argsort(np.asarray(device_ids), kind="stable")


def server_update(x: np.ndarray, device_ids, deltas: np.ndarray, coeffs: np.ndarray, lr_global: float) -> np.ndarray:
    """x + eta_g * sum_k p_k Delta_k, accumulated in float64 in ascending device id."""
    acc = np.zeros(x.shape[0], dtype=np.float64)
    for i in ascending(device_ids):
        if coeffs[i] != 0.0:
            acc += coeffs[i] * deltas[i].astype(np.float64)
    return (x.astype(np.float64) + lr_global * acc).astype(x.dtype)
