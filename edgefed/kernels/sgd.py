"""The update every model's SGD step ends with, and the terms an algorithm adds to it, in one place.

An algorithm's local step is y <- y - lr * (g(y) + its terms). The terms travel through every model's
kernel as one tuple that only this module opens, so a new term (FedProx's proximal pull, say) is a change
here and in the algorithm that asks for it, not in each model. Empty arrays stand for absent terms, so
every algorithm calls the same compiled kernel.
"""

import numpy as np
from numba import njit

from edgefed.kernels import JIT

_EMPTY = {np.dtype(np.float32): np.zeros(0, np.float32), np.dtype(np.float64): np.zeros(0, np.float64)}


def step_terms(dtype, correction: np.ndarray | None = None) -> tuple:
    """The terms of a local step in the kernels' form: (correction,), SCAFFOLD's c - c_k or empty."""
    return (_EMPTY[np.dtype(dtype)] if correction is None else correction,)


@njit(**JIT)
def apply_step(params, grad, lr, terms):
    """params <- params - lr * (grad + correction)."""
    correction = terms[0]
    if correction.shape[0] == params.shape[0]:
        for k in range(params.shape[0]):
            params[k] -= lr * (grad[k] + correction[k])
    else:
        for k in range(params.shape[0]):
            params[k] -= lr * grad[k]


@njit(**JIT)
def step_coordinate(params, j, g, lr, terms):
    """apply_step for coordinate j alone, for kernels whose gradient comes one coordinate at a time."""
    correction = terms[0]
    if correction.shape[0] == params.shape[0]:
        g += correction[j]
    params[j] -= lr * g
