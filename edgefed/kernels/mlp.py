"""Multilayer perceptron with ReLU hidden layers and a softmax output (McMahan et al.'s 2NN: 784-200-200-10).

Flat parameter layout, layer by layer: W_l (d_l x d_{l+1}, row-major: input unit i, output unit j at
i*d_{l+1} + j), then b_l (d_{l+1}). `sizes` holds (d_0, ..., d_L) and `offsets` the start of each W_l
(the b_l follow their W_l). Activations and deltas live in caller-owned buffers of batch x sum(d_l), so a
step allocates nothing. Inner loops run over contiguous rows of W (and skip the zeros ReLU leaves), which
LLVM vectorizes without fastmath.
"""

import numpy as np
from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.linalg import accumulate_outer, accumulate_product, copy_into, transpose_into
from edgefed.kernels.random import draw_batch
from edgefed.kernels.softmax import cross_entropy, softmax_xent
from edgefed.kernels.sgd import apply_step


@njit(inline="always", **JIT)
def _layer(params, offsets, sizes, layer):
    """(W, b) of one layer as views of the flat parameters: W is d_l x d_{l+1}."""
    din, dout = sizes[layer], sizes[layer + 1]
    w0 = offsets[layer]
    return params[w0:w0 + din * dout].reshape((din, dout)), params[w0 + din * dout:w0 + din * dout + dout]


@njit(inline="always", **JIT)
def _forward(params, sizes, offsets, X, idx, b, acts):
    """acts[l] (b x d_l, stacked) <- the activations for the rows idx[:b] of X; the last layer holds logits.

    2-D views of the flat buffers (not index arithmetic on them) are what lets LLVM vectorize the inner
    loops: measured 16 vs 2 GFLOP/s on the 2NN's first layer.
    """
    n_layers = sizes.shape[0] - 1
    d0 = sizes[0]
    A = acts[:b * d0].reshape((b, d0))
    for r in range(b):
        copy_into(A[r], X[idx[r]])
    a_off = 0
    for layer in range(n_layers):
        din, dout = sizes[layer], sizes[layer + 1]
        W, bias = _layer(params, offsets, sizes, layer)
        A = acts[a_off:a_off + b * din].reshape((b, din))
        z_off = a_off + b * din
        Z = acts[z_off:z_off + b * dout].reshape((b, dout))
        for r in range(b):
            for j in range(dout):
                Z[r, j] = bias[j]
        accumulate_product(A, W, Z, b, din, dout)
        if layer < n_layers - 1:
            for r in range(b):
                for j in range(dout):
                    if Z[r, j] < 0:
                        Z[r, j] = 0
        a_off = z_off
    return a_off  # where the logits start


@njit(inline="always", **JIT)
def _softmax_rows(acts, out_off, b, n_classes, y, idx, deltas, scale):
    """The output layer's deltas (same offset in deltas as the logits in acts) <- scale * (softmax - onehot);
    returns the summed cross-entropy (float64)."""
    Z = acts[out_off:out_off + b * n_classes].reshape((b, n_classes))
    D = deltas[out_off:out_off + b * n_classes].reshape((b, n_classes))
    loss = 0.0
    for r in range(b):
        loss += softmax_xent(Z[r], y[idx[r]], scale, D[r])
    return loss


@njit(inline="always", **JIT)
def _backward(params, sizes, offsets, a_offs, b, acts, deltas, grad, wt):
    """grad <- the gradient whose output deltas are already in deltas (last layer); acts from _forward.

    a_offs[l] = b * (d_0 + ... + d_{l-1}): where layer l's activations (and deltas) start; wt is scratch
    for the largest transposed hidden weight matrix.
    """
    n_layers = sizes.shape[0] - 1
    for layer in range(n_layers - 1, -1, -1):
        din, dout = sizes[layer], sizes[layer + 1]
        W, _ = _layer(params, offsets, sizes, layer)
        gW, gb = _layer(grad, offsets, sizes, layer)
        A = acts[a_offs[layer]:a_offs[layer] + b * din].reshape((b, din))
        D = deltas[a_offs[layer + 1]:a_offs[layer + 1] + b * dout].reshape((b, dout))
        gb[:] = 0
        for r in range(b):
            for j in range(dout):
                gb[j] += D[r, j]
        accumulate_outer(A, D, gW, b, din, dout, True)  # written by its first term: grad is never zeroed
        if layer > 0:  # deltas of the hidden layer below: (D W^T) * relu'
            # W^T is packed first so the product streams contiguous rows like the forward pass.
            WT = wt[:dout * din].reshape((dout, din))
            transpose_into(W, WT, din, dout)
            P = deltas[a_offs[layer]:a_offs[layer] + b * din].reshape((b, din))
            accumulate_product(D, WT, P, b, dout, din, True)
            for r in range(b):
                for k in range(din):
                    if A[r, k] <= 0:
                        P[r, k] = 0


@njit(inline="always", **JIT)
def _batch_grad(params, sizes, offsets, a_offs, X, y, idx, b, scale, grad, acts, deltas, wt):
    """grad <- scale * (sum of gradients over the rows idx[:b]); returns their summed loss."""
    out_off = _forward(params, sizes, offsets, X, idx, b, acts)
    loss = _softmax_rows(acts, out_off, b, sizes[sizes.shape[0] - 1], y, idx, deltas, scale)
    _backward(params, sizes, offsets, a_offs, b, acts, deltas, grad, wt)
    return loss


@njit(inline="always", **JIT)  # into _sgd_steps: one compilation fewer on a cold start
def _minibatch_grad(params, sizes, offsets, a_offs, X, y, b, inv_b, rng, perm, grad, acts, deltas, wt):
    """grad <- mean gradient over one minibatch of b samples, drawn as in logreg (one oracle call)."""
    if b < X.shape[0]:
        draw_batch(rng, perm, X.shape[0], b)
    return _batch_grad(params, sizes, offsets, a_offs, X, y, perm, b, inv_b, grad, acts, deltas, wt)


@njit(**JIT)
def _sgd_steps(params, sizes, offsets, a_offs, X, y, n_steps, b, lr, inv_b, rng, perm, terms, grad, acts,
               deltas, wt):
    """n_steps of params <- params - lr * (mean minibatch gradient + the algorithm's terms, sgd.py)."""
    for _ in range(n_steps):
        _minibatch_grad(params, sizes, offsets, a_offs, X, y, b, inv_b, rng, perm, grad, acts, deltas, wt)
        apply_step(params, grad, lr, terms)
    return n_steps


@njit(**JIT)
def _loss_correct(params, sizes, offsets, X, y, chunk, acts):
    """(sum of losses, correct predictions) over all samples, `chunk` rows at a time."""
    n = X.shape[0]
    n_classes = sizes[sizes.shape[0] - 1]
    idx = np.arange(n)  # once per evaluation, not per step
    loss = 0.0
    correct = 0
    for start in range(0, n, chunk):
        b = min(chunk, n - start)
        out_off = _forward(params, sizes, offsets, X, idx[start:], b, acts)
        Z = acts[out_off:out_off + b * n_classes].reshape((b, n_classes))
        for r in range(b):
            sample_loss, best = cross_entropy(Z[r], y[start + r])
            loss += sample_loss
            if best == y[start + r]:
                correct += 1
    return loss, correct
