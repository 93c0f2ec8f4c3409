"""The quadratic oracle of docs/design.md 3.3: f_k(x) = 1/2 sum_j a_j (x_j - b_j)^2, g_k(x) = a * (x - b) (+ noise)."""

import numpy as np
from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.fma import fma
from edgefed.kernels.random import normal
from edgefed.kernels.sgd import step_coordinate


@njit(**JIT)
def _sgd_steps(x, a, b, n_steps, lr, noise_std, rng, terms):
    """n_steps of x <- x - lr * (g(x) + the algorithm's terms); the gradient is separable, so coordinates
    update in place. Returns the sum over the steps of f(x_t)^2, f at each step's starting point (the
    quadratic's "sample" is a step: Oort's statistical utility, docs/design.md 2.18)."""
    d = x.shape[0]
    noisy = noise_std > 0
    squares = 0.0
    for _ in range(n_steps):
        f = 0.0
        for j in range(d):
            r = x[j] - b[j]
            f += 0.5 * np.float64(a[j]) * np.float64(r) * np.float64(r)
            g = a[j] * r
            if noisy:
                g = fma(noise_std, normal(rng), g)
            step_coordinate(x, j, g, lr, terms)
        squares = fma(f, f, squares)
    return squares


@njit(**JIT)
def _loss_grad(x, a, b, grad):
    """f(x) in float64; grad <- a * (x - b) exactly."""
    loss = 0.0
    for j in range(x.shape[0]):
        r = x[j] - b[j]
        grad[j] = a[j] * r
        loss += 0.5 * np.float64(a[j]) * np.float64(r) * np.float64(r)
    return loss


@njit(**JIT)
def _oracle_grad(x, a, b, noise_std, rng, grad):
    """grad <- g(x): the exact gradient plus, with noise_std > 0, fresh Gaussian noise (one oracle call)."""
    for j in range(x.shape[0]):
        grad[j] = a[j] * (x[j] - b[j])
        if noise_std > 0:
            grad[j] = fma(noise_std, normal(rng), grad[j])
