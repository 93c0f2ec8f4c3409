"""Multinomial logistic regression (softmax cross-entropy) over a flat parameter vector.

Layout of the d = f*C + C parameters: W (f x C, row-major: feature j, class c at j*C + c), then b (C).
Every array a kernel touches is passed in, so a local step allocates nothing; scalars arrive already cast
to the parameter dtype so float32 runs stay float32 all the way through.
"""

from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.fma import fma
from edgefed.kernels.linalg import accumulate_outer, accumulate_product, copy_into
from edgefed.kernels.random import draw_batch
from edgefed.kernels.sgd import apply_step
from edgefed.kernels.softmax import cross_entropy, softmax_xent


@njit(inline="always", **JIT)
def _logits(params, X, i, n_classes, z):
    """z <- x_i W + b."""
    f = X.shape[1]
    nw = f * n_classes
    for c in range(n_classes):
        z[c] = params[nw + c]
    for j in range(f):
        xj = X[i, j]
        base = j * n_classes
        for c in range(n_classes):
            z[c] = fma(xj, params[base + c], z[c])


@njit(inline="always", **JIT)
def _accumulate_grad(X, i, n_classes, prob, grad):
    """grad += x_i^T delta, with prob holding delta = softmax - onehot."""
    f = X.shape[1]
    nw = f * n_classes
    for j in range(f):
        xj = X[i, j]
        base = j * n_classes
        for c in range(n_classes):
            grad[base + c] = fma(xj, prob[c], grad[base + c])
    for c in range(n_classes):
        grad[nw + c] += prob[c]


@njit(inline="always", **JIT)
def _batch_grad(params, X, y, idx, b, n_classes, scale, grad, Z, Xb, GT):
    """grad <- scale * sum of the gradients of rows idx[:b] (no loss: the SGD path does not need it).

    The rows are gathered into Xb (b x f) so both products run over contiguous memory; Z (b x C) holds the
    logits, then scale * (softmax - onehot). The weight gradient is summed as GT = Z^T Xb (C x f) and
    transposed into place: its rows are f long, where W's are only C (10) long and do not fill the vectors
    (measured 2.3 against 4.4 us at batch 20, 60 -> 10).
    """
    f = X.shape[1]
    nw = f * n_classes
    W = params[:nw].reshape((f, n_classes))
    bias = params[nw:]
    gW = grad[:nw].reshape((f, n_classes))
    gb = grad[nw:]
    for r in range(b):
        copy_into(Xb[r], X[idx[r]])
        copy_into(Z[r], bias)
    accumulate_product(Xb, W, Z, b, f, n_classes)
    gb[:] = 0
    for r in range(b):
        z = Z[r]
        softmax_xent(z, y[idx[r]], scale, z)
        for c in range(n_classes):
            gb[c] += z[c]
    accumulate_outer(Z, Xb, GT, b, n_classes, f, True)
    for k in range(f):
        for c in range(n_classes):
            gW[k, c] = GT[c, k]


@njit(inline="always", **JIT)  # into _sgd_steps: one compilation fewer on a cold start
def _minibatch_grad(params, X, y, n_classes, b, inv_b, rng, perm, grad, Z, Xb, GT):
    """grad <- mean gradient over one minibatch of b samples (one oracle call), drawn as in _sgd_steps."""
    n = X.shape[0]
    if b < n:
        draw_batch(rng, perm, n, b)
    _batch_grad(params, X, y, perm, b, n_classes, inv_b, grad, Z, Xb, GT)


@njit(**JIT)
def _sgd_steps(params, X, y, n_classes, n_steps, b, lr, inv_b, rng, perm, terms, grad, Z, Xb, GT):
    """n_steps of params <- params - lr * (mean minibatch gradient + the algorithm's terms, sgd.py).

    A minibatch is a uniform b-subset (b <= n) of the n samples, drawn anew each step; b = n is the full
    gradient, summed in perm order.
    lr and inv_b = 1/b come in the parameter dtype.
    """
    for _ in range(n_steps):
        _minibatch_grad(params, X, y, n_classes, b, inv_b, rng, perm, grad, Z, Xb, GT)
        apply_step(params, grad, lr, terms)
    return n_steps


@njit(**JIT)
def _loss_grad(params, X, y, n_classes, grad, prob):
    """Mean loss over all n samples; grad <- full mean gradient (float64 sums for the loss)."""
    n = X.shape[0]
    grad[:] = 0
    loss = 0.0
    for i in range(n):
        _logits(params, X, i, n_classes, prob)
        loss += softmax_xent(prob, y[i], 1.0, prob)
        _accumulate_grad(X, i, n_classes, prob, grad)
    grad /= n
    return loss / n


@njit(**JIT)
def _loss_correct(params, X, y, n_classes, Z):
    """(sum of losses, number of correct argmax predictions) over all samples, Z.shape[0] rows at a time
    through the blocked product (4x the one-sample-at-a-time loop)."""
    f = X.shape[1]
    nw = f * n_classes
    W = params[:nw].reshape((f, n_classes))
    bias = params[nw:]
    n, chunk = X.shape[0], Z.shape[0]
    loss = 0.0
    correct = 0
    for i0 in range(0, n, chunk):
        m = min(chunk, n - i0)
        for r in range(m):
            copy_into(Z[r], bias)
        accumulate_product(X[i0:i0 + m], W, Z, m, f, n_classes)
        for r in range(m):
            sample_loss, best = cross_entropy(Z[r], y[i0 + r])
            loss += sample_loss
            if best == y[i0 + r]:
                correct += 1
    return loss, correct
