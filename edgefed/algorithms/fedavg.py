"""FedAvg (seed 000, DESIGN 2.2-2.4): K local steps from the server model, then x + eta_g * sum p_k Delta_k."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FedAvgClient:
    """The device side of FedAvg: plain local SGD, no state kept between rounds."""

    name = "fedavg"
    needs_control_stream = False

    def local_update(self, model, data, run, control_run, runner, n_steps, batch_size, lr, x, c, c_k, out_dx,
                     out_dc):
        """Local SGD from x for up to n_steps (`runner` decides how many); out_dx <- Delta_k = y_{k,s} - x.

        Returns the steps taken.
        """
        y = x.copy()
        steps = runner(lambda n: model.local_steps(y, data, run, n, batch_size, lr), n_steps)
        np.subtract(y, x, out=out_dx)
        return steps


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
