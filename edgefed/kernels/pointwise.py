"""Layers that act on each value alone (activations, dropout) or only move values (a permutation), over one
sample's flat activations. Transcendental functions are evaluated in float64 and rounded once."""

import numpy as np
from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.fma import fma
from edgefed.kernels.linalg import block, copy_into
from edgefed.kernels.program import F_AUX, F_IN, F_MODE, F_NOUT, F_OUT, F_PERM
from edgefed.kernels.random import uniform

RELU, LEAKY_RELU, TANH, SIGMOID = 0, 1, 2, 3  # activation kinds
DROPPED, KEPT, PASSED = 0, 1, 2  # a dropout mask's values; PASSED: dropout off (the gradient of the model's
# deterministic objective passes through unscaled)


@njit(inline="always", **JIT)
def activation_forward(inp, out, n, kind, slope):
    for j in range(n):
        v = inp[j]
        if kind == RELU:
            out[j] = v if not v < 0 else 0
        elif kind == LEAKY_RELU:
            out[j] = v if v >= 0 else v * slope
        elif kind == TANH:
            out[j] = np.tanh(np.float64(v))
        else:
            out[j] = 1.0 / (1.0 + np.exp(-np.float64(v)))


@njit(inline="always", **JIT)
def activation_backward(inp, out, dout, din, n, kind, slope):
    """din <- dout times the derivative: ReLU's and leaky ReLU's from the input's sign (PyTorch's: the
    slope at 0), tanh's 1 - out^2 and the sigmoid's out (1 - out) from the output."""
    for j in range(n):
        d = dout[j]
        if kind == RELU:
            din[j] = d if inp[j] > 0 else 0
        elif kind == LEAKY_RELU:
            din[j] = d if inp[j] > 0 else d * slope
        elif kind == TANH:
            o = np.float64(out[j])
            din[j] = fma(-o, o, 1.0) * d
        else:
            o = np.float64(out[j])
            din[j] = o * (1.0 - o) * d


@njit(inline="always", **JIT)
def dropout_forward(inp, out, mask, n, rate, rng):
    """Inverted dropout: each value kept with probability 1 - rate (one uniform draw from the device's
    stream per value, in order) and scaled by 1 / (1 - rate); mask[j] = 1 where kept."""
    scale = 1.0 / (1.0 - rate)
    for j in range(n):
        if uniform(rng) >= rate:
            mask[j] = KEPT
            out[j] = inp[j] * scale
        else:
            mask[j] = DROPPED
            out[j] = 0


@njit(inline="always", **JIT)
def dropout_backward(mask, dout, din, n, rate):
    scale = 1.0 / (1.0 - rate)
    for j in range(n):
        m = mask[j]
        din[j] = dout[j] * scale if m == KEPT else (dout[j] if m == PASSED else 0)


@njit(inline="always", **JIT)
def permute_forward(inp, out, order, n):
    """out[j] <- inp[order[j]]: one layout of the same values to another (e.g. channels-last to PyTorch's
    channels-first order before a reshape)."""
    for j in range(n):
        out[j] = inp[order[j]]


@njit(inline="always", **JIT)
def permute_backward(dout, din, order, n):
    for j in range(n):
        din[order[j]] = dout[j]


# -------------------------------------------------------------------------------- the operations of a batch
@njit(**JIT)
def activation_forward_op(op, slope, perms, params, acts, aux, cols, pads, r0, r1, train, rng):
    n = op[F_NOUT]
    X, Z = block(acts, op[F_IN], n), block(acts, op[F_OUT], n)
    for r in range(r0, r1):
        activation_forward(X[r], Z[r], n, op[F_MODE], slope)


@njit(**JIT)
def activation_backward_op(op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1,
                           step, lr, terms):
    n = op[F_NOUT]
    X, Z = block(acts, op[F_IN], n), block(acts, op[F_OUT], n)
    DX, DZ = block(deltas, op[F_IN], n), block(deltas, op[F_OUT], n)
    for r in range(r0, r1):
        activation_backward(X[r], Z[r], DZ[r], DX[r], n, op[F_MODE], slope)


@njit(**JIT)
def dropout_forward_op(op, slope, perms, params, acts, aux, cols, pads, r0, r1, train, rng):
    """Training: masks drawn sample by sample; otherwise the identity (its mask says so, for a full gradient)."""
    n = op[F_NOUT]
    X, Z, M = block(acts, op[F_IN], n), block(acts, op[F_OUT], n), block(aux, op[F_AUX], n)
    for r in range(r0, r1):
        if train:
            dropout_forward(X[r], Z[r], M[r], n, slope, rng)
        else:
            copy_into(Z[r], X[r])
            m = M[r]
            for j in range(n):
                m[j] = PASSED


@njit(**JIT)
def dropout_backward_op(op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1, step,
                        lr, terms):
    n = op[F_NOUT]
    DX, DZ, M = block(deltas, op[F_IN], n), block(deltas, op[F_OUT], n), block(aux, op[F_AUX], n)
    for r in range(r0, r1):
        dropout_backward(M[r], DZ[r], DX[r], n, slope)


@njit(**JIT)
def permute_forward_op(op, slope, perms, params, acts, aux, cols, pads, r0, r1, train, rng):
    n = op[F_NOUT]
    order = perms[op[F_PERM]:op[F_PERM] + n]
    X, Z = block(acts, op[F_IN], n), block(acts, op[F_OUT], n)
    for r in range(r0, r1):
        permute_forward(X[r], Z[r], order, n)


@njit(**JIT)
def permute_backward_op(op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1, step,
                        lr, terms):
    n = op[F_NOUT]
    order = perms[op[F_PERM]:op[F_PERM] + n]
    DX, DZ = block(deltas, op[F_IN], n), block(deltas, op[F_OUT], n)
    for r in range(r0, r1):
        permute_backward(DZ[r], DX[r], order, n)
