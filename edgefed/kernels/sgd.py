"""The update every model's SGD step ends with, and the terms an algorithm adds to it, in one place.

An algorithm's local step is y <- y - lr * (g(y) + its terms). The terms travel through every model's
kernel as one tuple that only this module opens, so a new term (FedProx's proximal pull, say) is a change
here and in the algorithm that asks for it, not in each model. Empty arrays stand for absent terms, so
every algorithm calls the same compiled kernel.
"""

import numpy as np
from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.fma import fma

_EMPTY = {np.dtype(np.float32): np.zeros(0, np.float32), np.dtype(np.float64): np.zeros(0, np.float64)}


def step_terms(dtype, correction: np.ndarray | None = None, anchor: np.ndarray | None = None,
               mu: float = 0.0) -> tuple:
    """The terms of a local step in the kernels' form, (correction, anchor, [mu]): SCAFFOLD's c - c_k, and
    FedProx's proximal pull mu (y - anchor) towards the round's server model; empty arrays where absent."""
    empty = _EMPTY[np.dtype(dtype)]
    return (empty if correction is None else correction, empty if anchor is None else anchor,
            np.full(1, mu, np.dtype(dtype)))


@njit(inline="always", **JIT)
def apply_step(params, grad, lr, terms):
    """params <- params - lr * (grad + mu (params - anchor) + correction), each term only where given.

    In fmas: g = fma(mu, params - anchor, grad), then + correction, then params = fma(-lr, g, params).
    """
    correction, anchor, mu = terms[0], terms[1], terms[2][0]
    step = -lr
    if anchor.shape[0] == params.shape[0]:
        corrected = correction.shape[0] == params.shape[0]
        for k in range(params.shape[0]):
            g = fma(mu, params[k] - anchor[k], grad[k])
            if corrected:
                g += correction[k]
            params[k] = fma(step, g, params[k])
    elif correction.shape[0] == params.shape[0]:
        for k in range(params.shape[0]):
            params[k] = fma(step, grad[k] + correction[k], params[k])
    else:
        for k in range(params.shape[0]):
            params[k] = fma(step, grad[k], params[k])


@njit(inline="always", **JIT)
def terms_slice(terms, start, stop):
    """The terms of params[start:stop] (an absent term stays absent): a kernel that updates part of the
    parameters itself (the CNN's fc1, fused with its gradient) updates the rest with these."""
    correction, anchor, mu = terms[0], terms[1], terms[2]
    if correction.shape[0] > 0:
        correction = correction[start:stop]
    if anchor.shape[0] > 0:
        anchor = anchor[start:stop]
    return correction, anchor, mu


@njit(inline="always", **JIT)
def step_coordinate(params, j, g, lr, terms):
    """apply_step for coordinate j alone, for kernels whose gradient comes one coordinate at a time."""
    correction, anchor, mu = terms[0], terms[1], terms[2][0]
    if anchor.shape[0] == params.shape[0]:
        g = fma(mu, params[j] - anchor[j], g)
    if correction.shape[0] == params.shape[0]:
        g += correction[j]
    params[j] = fma(-lr, g, params[j])
