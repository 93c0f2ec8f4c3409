"""FedAvg (seed 000, DESIGN 2.2-2.4): K local steps from the server model, then x + eta_g * sum p_k Delta_k."""

import numpy as np


def client_update(model, x: np.ndarray, data, run, n_steps: int, batch_size, lr: float, out: np.ndarray):
    """Local SGD from x; out <- Delta_k = y_{k,s} - x. Returns the steps taken."""
    y = x.copy()
    steps = model.local_steps(y, data, run, n_steps, batch_size, lr)
    np.subtract(y, x, out=out)
    return steps


def server_update(x: np.ndarray, deltas: np.ndarray, coeffs: np.ndarray, lr_global: float) -> np.ndarray:
    """x + eta_g * sum_k p_k Delta_k, summed over rows in the given (ascending device id) order in float64."""
    acc = np.zeros(x.shape[0], dtype=np.float64)
    for delta, p in zip(deltas, coeffs):
        if p != 0.0:
            acc += p * delta.astype(np.float64)
    return (x.astype(np.float64) + lr_global * acc).astype(x.dtype)
