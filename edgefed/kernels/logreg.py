"""Multinomial logistic regression (softmax cross-entropy) over a flat parameter vector.

Layout of the d = f*C + C parameters: W (f x C, row-major: feature j, class c at j*C + c), then b (C).
Every array a kernel touches is passed in, so a local step allocates nothing; scalars arrive already cast
to the parameter dtype so float32 runs stay float32 all the way through.
"""

import numpy as np
from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.random import draw_batch
from edgefed.kernels.sgd import apply_step


@njit(**JIT)
def _logits_softmax(params, X, i, n_classes, prob, label):
    """prob <- softmax(x_i W + b); returns the cross-entropy -log softmax(z)[label] in float64.

    The loss comes from the logits (log-sum-exp), not from log(prob), so it stays finite when a
    probability underflows.
    """
    f = X.shape[1]
    nw = f * n_classes
    for c in range(n_classes):
        prob[c] = params[nw + c]
    for j in range(f):
        xj = X[i, j]
        base = j * n_classes
        for c in range(n_classes):
            prob[c] += xj * params[base + c]
    zmax = prob[0]
    for c in range(1, n_classes):
        if prob[c] > zmax:
            zmax = prob[c]
    z_label = prob[label]
    total = prob[0] * 0
    for c in range(n_classes):
        prob[c] = np.exp(prob[c] - zmax)
        total += prob[c]
    for c in range(n_classes):
        prob[c] /= total
    return np.log(np.float64(total)) + np.float64(zmax) - np.float64(z_label)


@njit(**JIT)
def _accumulate_grad(X, i, n_classes, prob, grad):
    """grad += x_i^T (prob - onehot), with prob already holding prob - onehot."""
    f = X.shape[1]
    nw = f * n_classes
    for j in range(f):
        xj = X[i, j]
        base = j * n_classes
        for c in range(n_classes):
            grad[base + c] += xj * prob[c]
    for c in range(n_classes):
        grad[nw + c] += prob[c]


@njit(**JIT)
def _batch_grad(params, X, y, idx, b, n_classes, scale, grad, Z, Xb):
    """grad <- scale * sum of the gradients of rows idx[:b] (no loss: the SGD path does not need it).

    The rows are gathered into Xb (b x f) so both products run weight-row-outer over contiguous memory;
    Z (b x C) holds the logits, then scale * (softmax - onehot).
    """
    f = X.shape[1]
    nw = f * n_classes
    W = params[:nw].reshape((f, n_classes))
    bias = params[nw:]
    gW = grad[:nw].reshape((f, n_classes))
    gb = grad[nw:]
    for r in range(b):
        Xb[r] = X[idx[r]]
        Z[r] = bias
    for k in range(f):
        w = W[k]
        for r in range(b):
            a = Xb[r, k]
            for c in range(n_classes):
                Z[r, c] += a * w[c]
    grad[:] = 0
    for r in range(b):
        z = Z[r]
        zmax = z[0]
        for c in range(1, n_classes):
            if z[c] > zmax:
                zmax = z[c]
        total = z[0] * 0
        for c in range(n_classes):
            z[c] = np.exp(z[c] - zmax)
            total += z[c]
        for c in range(n_classes):
            z[c] = z[c] / total * scale
        z[y[idx[r]]] -= scale
        for c in range(n_classes):
            gb[c] += z[c]
    for k in range(f):
        g = gW[k]
        for r in range(b):
            a = Xb[r, k]
            for c in range(n_classes):
                g[c] += a * Z[r, c]


@njit(**JIT)
def _minibatch_grad(params, X, y, n_classes, b, inv_b, rng, perm, grad, Z, Xb):
    """grad <- mean gradient over one minibatch of b samples (one oracle call), drawn as in _sgd_steps."""
    n = X.shape[0]
    if b < n:
        draw_batch(rng, perm, n, b)
    _batch_grad(params, X, y, perm, b, n_classes, inv_b, grad, Z, Xb)


@njit(**JIT)
def _sgd_steps(params, X, y, n_classes, n_steps, b, lr, inv_b, rng, perm, correction, grad, Z, Xb):
    """n_steps of params <- params - lr * (mean minibatch gradient + correction).

    A minibatch is a uniform b-subset (b <= n) of the n samples, drawn anew each step; b = n is the full
    gradient, summed in perm order. `correction` is empty (plain SGD) or holds SCAFFOLD's c - c_k.
    lr and inv_b = 1/b come in the parameter dtype.
    """
    for _ in range(n_steps):
        _minibatch_grad(params, X, y, n_classes, b, inv_b, rng, perm, grad, Z, Xb)
        apply_step(params, grad, lr, correction)
    return n_steps


@njit(**JIT)
def _loss_grad(params, X, y, n_classes, grad, prob):
    """Mean loss over all n samples; grad <- full mean gradient (float64 sums for the loss)."""
    n = X.shape[0]
    grad[:] = 0
    loss = 0.0
    for i in range(n):
        loss += _logits_softmax(params, X, i, n_classes, prob, y[i])
        prob[y[i]] -= 1
        _accumulate_grad(X, i, n_classes, prob, grad)
    grad /= n
    return loss / n


@njit(**JIT)
def _loss_correct(params, X, y, n_classes, prob):
    """(sum of losses, number of correct argmax predictions) over all samples."""
    n = X.shape[0]
    loss = 0.0
    correct = 0
    for i in range(n):
        loss += _logits_softmax(params, X, i, n_classes, prob, y[i])
        best = 0
        for c in range(1, n_classes):
            if prob[c] > prob[best]:
                best = c
        if best == y[i]:
            correct += 1
    return loss, correct
