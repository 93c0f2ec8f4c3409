"""A sequential network as data: one compiled kernel per dtype runs any list of layers, every shape a run-time
value, so a new model made of known layer types compiles nothing new.

A model is a program: one int64 row per operation (program.py's columns) that edgefed/layers.py builds
once from the layer list, with offsets into the flat parameters and into one sample's activations. Row 0
gathers the input; the loss reads the last row's output. Activations, deltas and the int32 aux values
(pooling winners, dropout masks) are (rows, per-sample total) buffers the caller owns, each operation's
region stored layer-major (linalg.block), so a step allocates nothing; scratch (unrolled windows, packed
transposes, padded maps) likewise.

Each layer type's operations (conv.py, dense.py, pointwise.py, norm.py) are compiled apart, with one
forward and one backward signature for all, and `network` links each of them once: it is the only function
a model calls, in one of four modes (local SGD steps; the gradient of a drawn minibatch; the gradient of
given rows; evaluation), so a cold start compiles it once per dtype. (Numba optimizes and emits a linked
function again in every caller, so the dispatch here is inlined and the call tree stays shallow.)
"""

import numpy as np
from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.conv import (conv_backward_op, conv_forward_op, global_pool_backward_op, global_pool_forward_op,
                                  pool_backward_op, pool_forward_op)
from edgefed.kernels.dense import FUSED_WEIGHTS, dense_backward_op, dense_forward_op
from edgefed.kernels.fma import fma
from edgefed.kernels.linalg import block, copy_into, matrix, vector
from edgefed.kernels.norm import groupnorm_backward_op, groupnorm_forward_op
from edgefed.kernels.pointwise import (activation_backward_op, activation_forward_op, dropout_backward_op,
                                       dropout_forward_op, permute_backward_op, permute_forward_op)
from edgefed.kernels.program import (ACTIVATION, CONV, DENSE, DROPOUT, F_GRAD_IN, F_IN, F_MODE, F_NIN, F_NOUT,
                                     F_NPARAM, F_OUT, F_PARAM, F_PERM, F_TYPE, GLOBAL_POOL, GROUPNORM, PERMUTE, POOL)
from edgefed.kernels.random import draw_batch
from edgefed.kernels.sgd import apply_step, terms_slice
from edgefed.kernels.softmax import cross_entropy, softmax_xent

CROSS_ENTROPY, MSE = 0, 1  # losses
STEPS, MINIBATCH, ROWS, EVAL = 0, 1, 2, 3  # modes of `network`


@njit(inline="always", **JIT)
def _borrow2(a):
    """A 2-D C-contiguous array as a view that holds no reference (linalg.matrix)."""
    return matrix(a, 0, a.shape[0], a.shape[1])


@njit(inline="always", **JIT)
def _op(prog, i):
    """Row i of the program, a view that holds no reference (linalg.matrix)."""
    return vector(prog, i * prog.shape[1], prog.shape[1])


@njit(inline="always", **JIT)
def _gather(prog, perms, X, idx, first, m, acts):
    """The input rows (idx[:m], or first.. when idx is empty) into the first op's output, in its layout."""
    op = _op(prog, 0)
    n_in, order = op[F_NOUT], op[F_PERM]
    permuted = op[F_MODE] == 1
    rows = block(acts, op[F_OUT], n_in)
    for r in range(m):
        src = vector(X, (idx[r] if idx.shape[0] > 0 else first + r) * n_in, n_in)
        dst = rows[r]
        if permuted:
            for j in range(n_in):
                dst[j] = src[perms[order + j]]
        else:
            copy_into(dst, src)


@njit(inline="always", **JIT)
def _forward_one(op, s, perms, params, acts, aux, cols, pads, r0, r1, train, rng):
    t = op[F_TYPE]
    if t == CONV:
        conv_forward_op(op, s, perms, params, acts, aux, cols, pads, r0, r1, train, rng)
    elif t == POOL:
        pool_forward_op(op, s, perms, params, acts, aux, cols, pads, r0, r1, train, rng)
    elif t == GLOBAL_POOL:
        global_pool_forward_op(op, s, perms, params, acts, aux, cols, pads, r0, r1, train, rng)
    elif t == ACTIVATION:
        activation_forward_op(op, s, perms, params, acts, aux, cols, pads, r0, r1, train, rng)
    elif t == DROPOUT:
        dropout_forward_op(op, s, perms, params, acts, aux, cols, pads, r0, r1, train, rng)
    elif t == GROUPNORM:
        groupnorm_forward_op(op, s, perms, params, acts, aux, cols, pads, r0, r1, train, rng)
    elif t == PERMUTE:
        permute_forward_op(op, s, perms, params, acts, aux, cols, pads, r0, r1, train, rng)


@njit(inline="always", **JIT)
def _forward(prog, slopes, perms, params, acts, aux, cols, pads, b, train, keep, rng):
    """Dense layers over the batch; each run of other operations between them sample by sample. Without
    keep (evaluation: no backward pass follows), a run works in acts' last row, which stays in cache, and
    only its output is copied to the sample's row."""
    n_ops = prog.shape[0]
    spare = acts.shape[0] - 1
    i = 1
    while i < n_ops:
        if prog[i, F_TYPE] == DENSE:
            dense_forward_op(_op(prog, i), slopes[i], perms, params, acts, aux, cols, pads, 0, b, train, rng)
            i += 1
            continue
        j = i
        while j < n_ops and prog[j, F_TYPE] != DENSE:
            j += 1
        first = block(acts, prog[i, F_IN], prog[i, F_NIN])
        last = block(acts, prog[j - 1, F_OUT], prog[j - 1, F_NOUT])
        for r in range(b):
            row = r if keep else spare
            if not keep:
                copy_into(first[spare], first[r])
            for k in range(i, j):
                _forward_one(_op(prog, k), slopes[k], perms, params, acts, aux, cols, pads, row, row + 1, train, rng)
            if not keep:
                copy_into(last[r], last[spare])
        i = j


@njit(inline="always", **JIT)
def _loss(prog, labels, targets, idx, first, b, scale, loss_kind, acts, deltas, want_deltas, squares, loss):
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
def _backward_one(op, s, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1, step, lr,
                  terms):
    """One operation's backward pass over samples r0..r1-1; an operation without parameters is skipped where
    no layer before it has any (no input gradient is needed)."""
    t = op[F_TYPE]
    if t == CONV:
        conv_backward_op(op, s, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1, step,
                         lr, terms)
    elif t == GROUPNORM:
        groupnorm_backward_op(op, s, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1,
                              step, lr, terms)
    elif op[F_GRAD_IN] == 0:
        return
    elif t == POOL:
        pool_backward_op(op, s, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1, step,
                         lr, terms)
    elif t == GLOBAL_POOL:
        global_pool_backward_op(op, s, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1,
                                step, lr, terms)
    elif t == ACTIVATION:
        activation_backward_op(op, s, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1,
                               step, lr, terms)
    elif t == DROPOUT:
        dropout_backward_op(op, s, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1,
                            step, lr, terms)
    elif t == PERMUTE:
        permute_backward_op(op, s, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1,
                            step, lr, terms)


@njit(inline="always", **JIT)
def _backward(prog, slopes, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, b, step, lr,
              terms):
    """grad <- the parameters' gradient from the output's deltas (already in deltas), in the forward pass's
    runs; with step, a large dense layer applies its weights' SGD step as it goes (dense.py) and leaves them
    out of grad."""
    i = prog.shape[0] - 1
    while i >= 1:
        if prog[i, F_TYPE] == DENSE:
            dense_backward_op(_op(prog, i), slopes[i], perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock,
                              pads, 0, b, step, lr, terms)
            i -= 1
            continue
        j = i
        while j >= 1 and prog[j, F_TYPE] != DENSE:
            j -= 1
        for r in range(b):
            for k in range(i, j, -1):
                _backward_one(_op(prog, k), slopes[k], perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock,
                              pads, r, r + 1, step, lr, terms)
        i = j


@njit(inline="always", **JIT)
def _fuses(prog):
    """Whether a dense layer steps its weights in the backward pass (dense.FUSED_WEIGHTS or more)."""
    for i in range(1, prog.shape[0]):
        if prog[i, F_TYPE] == DENSE and prog[i, F_NIN] * prog[i, F_NOUT] >= FUSED_WEIGHTS:
            return True
    return False


@njit(inline="always", **JIT)
def _apply(prog, params, grad, lr, terms, fused):
    """The SGD step of every parameter not updated in the backward pass: the whole vector at once, or (fused)
    layer by layer around the weights already stepped (the same bits: each coordinate's update is its own)."""
    if not fused:
        apply_step(params, grad, lr, terms)
        return
    for i in range(1, prog.shape[0]):
        p, n = prog[i, F_PARAM], prog[i, F_NPARAM]
        if n == 0:
            continue
        if prog[i, F_TYPE] == DENSE and prog[i, F_NIN] * prog[i, F_NOUT] >= FUSED_WEIGHTS:
            p += prog[i, F_NIN] * prog[i, F_NOUT]  # the weights were stepped in the backward pass: their bias only
            n = prog[i, F_NOUT]
        apply_step(vector(params, p, n), vector(grad, p, n), lr, terms_slice(terms, p, p + n))


@njit(**JIT)
def network(prog, slopes, perms, loss_kind, params, X, labels, targets, idx, n, b, n_steps, lr, scale, terms, rng,
            mode, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, outputs):
    """One entry for everything a model computes; returns (summed loss, count).

    STEPS: n_steps of params <- params - lr (mean gradient of a minibatch of b of the n rows + the
    algorithm's terms, sgd.py); a minibatch is drawn into idx[:b] from rng as every model draws it (b = n:
    the full batch, in idx order); count = steps, loss = the sum over every sample trained on of its loss
    squared. MINIBATCH: grad <- scale * the summed gradient of one such minibatch. ROWS: grad <- scale * the
    summed gradient of rows idx[:b] (dropout off: the model's deterministic objective). EVAL: loss and correct predictions of rows 0..n-1, acts.shape[0] - 1 at a time,
    and their outputs (the last layer's, e.g. logits) into outputs when it has n rows.
    scale and lr come in the parameter dtype; losses are float64 sums. A label outside the classes stops it:
    count is then -1 - its row.
    """
    # Borrowed views of every buffer (no reference count): the operations' calls then count nothing up and
    # down for their arguments (an atomic operation each way per array: 0.2 us of a logreg step, measured).
    prog, slopes, perms, params, X = (_borrow2(prog), vector(slopes, 0, slopes.shape[0]),
                                      vector(perms, 0, perms.shape[0]), vector(params, 0, params.shape[0]), _borrow2(X))
    grad, acts, deltas, aux, tr = (vector(grad, 0, grad.shape[0]), _borrow2(acts), _borrow2(deltas), _borrow2(aux),
                                   _borrow2(tr))
    cols, wt, gt, gblock, pads = (vector(cols, 0, cols.shape[0]), vector(wt, 0, wt.shape[0]),
                                  vector(gt, 0, gt.shape[0]), vector(gblock, 0, gblock.shape[0]),
                                  vector(pads, 0, pads.shape[0]))
    empty = idx[:0]
    # flags as run-time values: a constant argument would make Numba compile each callee again for it
    train, step, want_deltas = mode == STEPS or mode == MINIBATCH, mode == STEPS, mode != EVAL
    if mode == EVAL:
        chunk = acts.shape[0] - 1  # the last row is the runs' scratch
        loss = 0.0
        correct = 0
        for i0 in range(0, n, chunk):
            m = min(chunk, n - i0)
            _gather(prog, perms, X, empty, i0, m, acts)
            _forward(prog, slopes, perms, params, acts, aux, cols, pads, m, train, want_deltas, rng)
            loss, right = _loss(prog, labels, targets, empty, i0, m, scale, loss_kind, acts, deltas, want_deltas,
                                False, loss)  # one running sum over every sample, whatever the chunks
            if right < 0:
                return loss, right
            correct += right
            if outputs.shape[0] == n:
                last = prog[prog.shape[0] - 1]
                Z = block(acts, last[F_OUT], last[F_NOUT])
                for r in range(m):
                    copy_into(outputs[i0 + r], Z[r])
        return loss, correct
    if mode == ROWS:
        _gather(prog, perms, X, idx, 0, b, acts)
        _forward(prog, slopes, perms, params, acts, aux, cols, pads, b, train, want_deltas, rng)
        loss, bad = _loss(prog, labels, targets, idx, 0, b, scale, loss_kind, acts, deltas, want_deltas, False, 0.0)
        if bad < 0:
            return loss, bad
        _backward(prog, slopes, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, b, step, lr,
                  terms)
        return loss, 0
    steps = n_steps if step else 1
    fused = _fuses(prog)
    loss = 0.0
    for _ in range(steps):
        if b < n:
            draw_batch(rng, idx, n, b)
        _gather(prog, perms, X, idx, 0, b, acts)
        _forward(prog, slopes, perms, params, acts, aux, cols, pads, b, train, want_deltas, rng)
        # STEPS: one running sum of the squared sample losses over every step (a report field, no extra pass)
        loss, bad = _loss(prog, labels, targets, idx, 0, b, scale, loss_kind, acts, deltas, want_deltas, step,
                          loss if step else 0.0)
        if bad < 0:
            return loss, bad
        _backward(prog, slopes, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, b, step, lr,
                  terms)
        if step:
            _apply(prog, params, grad, lr, terms, fused)
    return loss, steps
