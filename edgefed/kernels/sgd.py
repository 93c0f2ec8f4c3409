"""The update every model's SGD step ends with, in one place."""

from numba import njit

from edgefed.kernels import JIT


@njit(**JIT)
def apply_step(params, grad, lr, correction):
    """params <- params - lr * (grad + correction); `correction` is empty (plain SGD) or SCAFFOLD's c - c_k."""
    if correction.shape[0] == params.shape[0]:
        for k in range(params.shape[0]):
            params[k] -= lr * (grad[k] + correction[k])
    else:
        for k in range(params.shape[0]):
            params[k] -= lr * grad[k]
