"""Group normalization (Wu and He, 2018), PyTorch's nn.GroupNorm: per sample and group of channels, the values
normalized by their mean and biased variance (eps = 1e-5), then scaled and shifted per channel.

One sample's map is (P, C) channels-last (P pixels; a vector is one pixel). Statistics are float64 sums in
(pixel, channel) order; the backward pass computes them again rather than storing them.
"""

import numpy as np
from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.fma import fma
from edgefed.kernels.linalg import block
from edgefed.kernels.program import F_C, F_GRAD_IN, F_H, F_IN, F_MODE, F_NOUT, F_OUT, F_PARAM, F_W

EPS = 1e-5


@njit(inline="always", **JIT)
def _stats(x, P, C, c0, c1):
    """(mean, 1 / sqrt(var + eps)) of channels c0..c1-1 over the P pixels."""
    m = P * (c1 - c0)
    total = 0.0
    for p in range(P):
        for c in range(c0, c1):
            total += x[p * C + c]
    mean = total / m
    sq = 0.0
    for p in range(P):
        for c in range(c0, c1):
            dv = np.float64(x[p * C + c]) - mean
            sq = fma(dv, dv, sq)
    return mean, 1.0 / np.sqrt(sq / m + EPS)


@njit(inline="always", **JIT)
def groupnorm_forward(x, gamma, beta, out, P, C, groups):
    per = C // groups
    for g in range(groups):
        c0, c1 = g * per, (g + 1) * per
        mean, rstd = _stats(x, P, C, c0, c1)
        for p in range(P):
            for c in range(c0, c1):
                xh = (np.float64(x[p * C + c]) - mean) * rstd
                out[p * C + c] = fma(xh, np.float64(gamma[c]), np.float64(beta[c]))


@njit(inline="always", **JIT)
def groupnorm_backward(x, gamma, dout, ggamma, gbeta, din, P, C, groups, need_din):
    """ggamma, gbeta += this sample's gradients; din <- the input's when need_din:
    dx = rstd (dxh - mean(dxh) - xh mean(dxh xh)) over the group, dxh = dout gamma."""
    per = C // groups
    for g in range(groups):
        c0, c1 = g * per, (g + 1) * per
        m = P * per
        mean, rstd = _stats(x, P, C, c0, c1)
        s1 = 0.0
        s2 = 0.0
        for p in range(P):
            for c in range(c0, c1):
                d = np.float64(dout[p * C + c])
                xh = (np.float64(x[p * C + c]) - mean) * rstd
                ggamma[c] = fma(d, xh, np.float64(ggamma[c]))
                gbeta[c] += d
                dxh = d * np.float64(gamma[c])
                s1 += dxh
                s2 = fma(dxh, xh, s2)
        if need_din:
            a, b = s1 / m, s2 / m
            for p in range(P):
                for c in range(c0, c1):
                    xh = (np.float64(x[p * C + c]) - mean) * rstd
                    dxh = np.float64(dout[p * C + c]) * np.float64(gamma[c])
                    din[p * C + c] = rstd * fma(-xh, b, dxh - a)


# -------------------------------------------------------------------------------- the operations of a batch
@njit(**JIT)
def groupnorm_forward_op(op, slope, perms, params, acts, aux, cols, pads, r0, r1, train, rng):
    n, p, C = op[F_NOUT], op[F_PARAM], op[F_C]
    X, Z = block(acts, op[F_IN], n), block(acts, op[F_OUT], n)
    for r in range(r0, r1):
        groupnorm_forward(X[r], params[p:p + C], params[p + C:p + 2 * C], Z[r], op[F_H] * op[F_W], C, op[F_MODE])


@njit(**JIT)
def groupnorm_backward_op(op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1,
                          step, lr, terms):
    """gamma's and beta's gradients summed over the batch in sample order (from zero at sample 0)."""
    n, p, C = op[F_NOUT], op[F_PARAM], op[F_C]
    gg, gbeta = grad[p:p + C], grad[p + C:p + 2 * C]
    if r0 == 0:
        for j in range(C):
            gg[j] = 0
            gbeta[j] = 0
    X, DX, DZ = block(acts, op[F_IN], n), block(deltas, op[F_IN], n), block(deltas, op[F_OUT], n)
    for r in range(r0, r1):
        groupnorm_backward(X[r], params[p:p + C], DZ[r], gg, gbeta, DX[r], op[F_H] * op[F_W], C, op[F_MODE],
                           op[F_GRAD_IN] == 1)
