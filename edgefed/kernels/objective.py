"""What every network does after its layers, in every model alike: the loss of a batch's outputs (and their
deltas), and the SGD step of the parameters. Compiled apart from the network kernel (and called through the
table of kernels/ops.py, row OBJECTIVE), so that a cold start compiles them beside it.
"""

import numpy as np
from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.fma import fma
from edgefed.kernels.linalg import block, vector
from edgefed.kernels.program import DENSE_STEPPED, F_FROZEN, F_NIN, F_NOUT, F_NPARAM, F_OUT, F_PARAM, F_TYPE
from edgefed.kernels.sgd import apply_step, terms_slice
from edgefed.kernels.softmax import cross_entropy, softmax_xent

CROSS_ENTROPY, MSE = 0, 1  # losses


@njit(**JIT)
def loss_op(prog, labels, targets, idx, first, b, scale, loss_kind, acts, deltas, want_deltas, squares, loss):
    """(loss + the losses of rows idx[:b] (or first..), one by one, correct predictions); want_deltas: the
    output's deltas <- scale * dloss/doutput (cross-entropy: softmax - onehot; mse: 2 (z - t) / width);
    squares: add each loss squared instead (Oort's statistical utility, docs/design.md 2.18)."""
    op = prog[prog.shape[0] - 1]
    width = op[F_NOUT]
    Z, D = block(acts, op[F_OUT], width), block(deltas, op[F_OUT], width)
    correct = 0
    for r in range(b):
        k = idx[r] if idx.shape[0] > 0 else first + r
        z = Z[r]
        if loss_kind == CROSS_ENTROPY and not 0 <= labels[k] < width:
            return loss, -1 - k  # the outputs are indexed by the label: nothing is computed with one outside them
        if loss_kind == CROSS_ENTROPY:
            if want_deltas:
                sample_loss = softmax_xent(z, labels[k], scale, D[r])
                loss = fma(sample_loss, sample_loss, loss) if squares else loss + sample_loss
            else:
                sample_loss, best = cross_entropy(z, labels[k])
                loss += sample_loss
                if best == labels[k]:
                    correct += 1
        else:
            t = targets[k]
            sq = 0.0
            for j in range(width):
                diff = np.float64(z[j]) - np.float64(t[j])
                sq = fma(diff, diff, sq)
            sample_loss = sq / width
            loss = fma(sample_loss, sample_loss, loss) if squares else loss + sample_loss
            if want_deltas:
                d = D[r]
                for j in range(width):
                    d[j] = (2.0 * scale / width) * (np.float64(z[j]) - np.float64(t[j]))
    return loss, correct


@njit(inline="always", **JIT)
def _fuses(prog):
    """Whether a dense layer steps its weights in the backward pass (DENSE_STEPPED)."""
    for i in range(1, prog.shape[0]):
        if prog[i, F_TYPE] == DENSE_STEPPED:
            return True
    return False


@njit(inline="always", **JIT)
def _trainable(prog):
    """The trainable parameters' count: they come first in the vector, the frozen ones after them."""
    n = 0
    for i in range(1, prog.shape[0]):
        if prog[i, F_FROZEN] == 0:
            n += prog[i, F_NPARAM]
    return n


@njit(**JIT)
def step_op(prog, params, grad, lr, terms):
    """The SGD step of every parameter not updated in the backward pass: the trainable ones as one piece, or
    (fused) layer by layer around the weights already stepped (the same bits: each coordinate's update is its
    own). One call of apply_step: each call is inlined, and costs its compilation again. Frozen parameters
    (after the trainable ones) get none."""
    n_ops = prog.shape[0]
    fused = _fuses(prog)
    trainable = 0 if fused else _trainable(prog)
    i = 1
    while True:
        p, n = 0, trainable
        if fused:
            while i < n_ops and (prog[i, F_NPARAM] == 0 or prog[i, F_FROZEN] == 1):
                i += 1
            if i == n_ops:
                return
            p, n = prog[i, F_PARAM], prog[i, F_NPARAM]
            if prog[i, F_TYPE] == DENSE_STEPPED:
                p += prog[i, F_NIN] * prog[i, F_NOUT]  # the weights were stepped in the backward pass: the bias only
                n = prog[i, F_NOUT]
            i += 1
        apply_step(vector(params, p, n), vector(grad, p, n), lr, terms_slice(terms, p, p + n))
        if not fused:
            return
