"""Fully connected layers over a batch: Z = b + A W with W stored (d_in, d_out) row-major, through the blocked
products of linalg.py (summation order there: from the bias, the inputs in index order, one fma each).

Activations of a batch are rows of a caller-owned buffer (any row stride, unit-stride rows), so a step
allocates nothing. Every weight gradient is written by its first term: the gradient is never zeroed.
"""

from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.fma import TILE_BYTES
from edgefed.kernels.linalg import (accumulate_outer, accumulate_product, block, copy_into, matrix, transpose_into,
                                    vector)
from edgefed.kernels.program import F_GRAD_IN, F_IN, F_MODE, F_NIN, F_NOUT, F_OUT, F_PARAM
from edgefed.kernels.sgd import apply_step, terms_slice

FUSED_WEIGHTS = 1 << 18  # a layer with this many weights or more (1 MB in float32) updates them in its backward
BLOCK_BYTES = 24576  # rows of W per block of a fused backward: 24 KB of gradient, inside a 32 KB L1


@njit(inline="always", **JIT)
def dense_forward(A, Z, W, bias, b, din, dout, relu):
    """Z[:b] <- bias + A[:b] W; relu: then ReLU, in place."""
    for r in range(b):
        copy_into(Z[r], bias)
    accumulate_product(A, W, Z, b, din, dout)
    if relu:
        for r in range(b):
            z = Z[r]
            for j in range(dout):
                if z[j] < 0:
                    z[j] = 0


@njit(inline="always", **JIT)
def relu_mask(acts, deltas, z0, r0, r1, n):
    """The deltas at z0 of samples r0..r1-1 <- themselves where the (post-ReLU) output is positive, else 0:
    a fused ReLU's derivative."""
    Z, D = block(acts, z0, n), block(deltas, z0, n)
    for r in range(r0, r1):
        z, d = Z[r], D[r]
        for j in range(n):
            if z[j] <= 0:
                d[j] = 0


@njit(inline="always", **JIT)
def bias_gradient(D, gb, b, n):
    """gb <- the sum of D's first b rows, in sample order."""
    for j in range(n):
        gb[j] = 0
    for r in range(b):
        d = D[r]
        for j in range(n):
            gb[j] += d[j]


@njit(inline="always", **JIT)
def dense_backward(A, W, D, gW, P, b, din, dout, need_p, wt, gt):
    """gW <- A^T D, and P <- D W^T when need_p (the input's deltas).

    A narrow layer (d_out smaller than a tile row, e.g. 10 classes) sums its gradient transposed, G^T = D^T A,
    whose rows are d_in long, then transposes it into place: the same fmas in the same order (fma's product
    commutes), at twice the speed (logistic regression at batch 20: 2.3 against 4.4 us).
    """
    if dout * D.itemsize < TILE_BYTES:
        GT = matrix(gt, 0, dout, din)
        accumulate_outer(D, A, GT, b, dout, din, True)
        for k in range(din):
            g = gW[k]
            for c in range(dout):
                g[c] = GT[c, k]
    else:
        accumulate_outer(A, D, gW, b, din, dout, True)
    if need_p:  # W^T packed first so the product streams contiguous rows like the forward pass
        WT = matrix(wt, 0, dout, din)
        transpose_into(W, WT, din, dout)
        accumulate_product(D, WT, P, b, dout, din, True)


@njit(inline="always", **JIT)
def dense_backward_step(A, W, D, P, b, din, dout, need_p, DT, PT, gblock, params, w_start, lr, terms):
    """dense_backward's weight part for a large layer, with the SGD step applied block by block of rows of W
    (W -= lr (G + terms), as apply_step) instead of storing G; P <- D W^T when need_p.

    At a small batch a large layer is bound by memory, not arithmetic: fused, W streams once per backward
    pass (read, then written) and its gradient never leaves L1, where storing the gradient and applying it
    after would stream it three times more (McMahan's CNN's 3136 x 512 layer: 1.6 ms a step saved). The bits
    are those of the unfused pass: each block's products are computed from the old W before the block is
    updated, and nothing later in the step reads W. DT (d_out, b) and PT (d_in, b) are scratch.
    """
    rows_per = max(1, BLOCK_BYTES // (dout * W.itemsize))
    transpose_into(D, DT, b, dout)
    for k0 in range(0, din, rows_per):
        rows = min(rows_per, din - k0)
        if need_p:
            accumulate_product(W[k0:k0 + rows], DT, PT[k0:k0 + rows], rows, dout, b, True)  # P^T = W D^T
        G = matrix(gblock, 0, rows, dout)
        accumulate_outer(A[:, k0:k0 + rows], D, G, b, rows, dout, True)
        start, stop = w_start + k0 * dout, w_start + (k0 + rows) * dout
        apply_step(vector(params, start, stop - start), vector(gblock, 0, rows * dout), lr,
                   terms_slice(terms, start, stop))
    if need_p:
        transpose_into(PT, P, din, b)


# -------------------------------------------------------------------------------- the operations of a batch
@njit(**JIT)
def dense_forward_op(op, slope, perms, params, acts, aux, cols, pads, r0, b, train, rng):
    nin, nout, p = op[F_NIN], op[F_NOUT], op[F_PARAM]
    w = nin * nout
    dense_forward(block(acts, op[F_IN], nin), block(acts, op[F_OUT], nout), matrix(params, p, nin, nout),
                  vector(params, p + w, nout), b, nin, nout, op[F_MODE] == 1)


@njit(**JIT)
def dense_backward_op(op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, b, step,
                      lr, terms):
    """Over the whole batch (r0 is 0): the layer's gradient into grad, and the input's deltas when a layer
    before has parameters; a fused ReLU's derivative first."""
    nin, nout, p = op[F_NIN], op[F_NOUT], op[F_PARAM]
    need = _dense_backward_start(op, params, grad, acts, deltas, b)
    dense_backward(block(acts, op[F_IN], nin), matrix(params, p, nin, nout), block(deltas, op[F_OUT], nout),
                   matrix(grad, p, nin, nout), block(deltas, op[F_IN], nin), b, nin, nout, need, wt, gt)


@njit(**JIT)
def dense_stepped_backward_op(op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, b,
                              step, lr, terms):
    """A layer of FUSED_WEIGHTS or more (program.DENSE_STEPPED): as dense_backward_op, but with step its
    weights' SGD step is taken here (dense_backward_step; its bias's gradient still goes to grad). An operation
    of its own, so that the models without such a layer never compile it."""
    nin, nout, p = op[F_NIN], op[F_NOUT], op[F_PARAM]
    need = _dense_backward_start(op, params, grad, acts, deltas, b)
    A, W, D, P = (block(acts, op[F_IN], nin), matrix(params, p, nin, nout), block(deltas, op[F_OUT], nout),
                  block(deltas, op[F_IN], nin))
    if step:
        dense_backward_step(A, W, D, P, b, nin, nout, need, matrix(tr, 0, nout, b), matrix(tr, nout * b, nin, b),
                            gblock, params, p, lr, terms)
    else:
        dense_backward(A, W, D, matrix(grad, p, nin, nout), P, b, nin, nout, need, wt, gt)


@njit(inline="always", **JIT)
def _dense_backward_start(op, params, grad, acts, deltas, b):
    """A fused ReLU's derivative, and the bias's gradient; whether the input's deltas are needed."""
    nin, nout, p = op[F_NIN], op[F_NOUT], op[F_PARAM]
    if op[F_MODE] == 1:
        relu_mask(acts, deltas, op[F_OUT], 0, b, nout)
    bias_gradient(block(deltas, op[F_OUT], nout), vector(grad, p + nin * nout, nout), b, nout)
    return op[F_GRAD_IN] == 1
