"""A sequential network as data: one compiled kernel per dtype runs any list of layers, every shape a run-time
value, so a new model made of known layer types compiles nothing new.

A model is a program: one int64 row per operation (program.py's columns) that edgefed/layers/ builds
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

from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.linalg import block, copy_into, matrix, vector
from edgefed.kernels.objective import CROSS_ENTROPY, MSE  # noqa: F401 - the losses' codes, for models
from edgefed.kernels.ops import LOSS, STEP, call_backward, call_forward, call_loss, call_step
from edgefed.kernels.program import (DENSE, DENSE_STEPPED, EMBEDDING, F_FROZEN, F_GRAD_IN, F_IN, F_MODE, F_NIN, F_NOUT,
                                     F_NPARAM, F_OUT, F_PERM, F_TYPE)
from edgefed.kernels.random import draw_batch

STEPS, MINIBATCH, ROWS, EVAL, FEATURES = 0, 1, 2, 3, 4  # modes of `network`


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
def _forward(ops, prog, slopes, perms, params, acts, aux, cols, pads, b, train, keep, rng):
    """Dense layers over the batch; each run of other operations between them sample by sample. Without
    keep (evaluation: no backward pass follows), a run works in acts' last row, which stays in cache, and
    only its output is copied to the sample's row."""
    n_ops = prog.shape[0]
    spare = acts.shape[0] - 1
    i = 1
    while i < n_ops:
        if _whole_batch(prog[i, F_TYPE]):
            call_forward(ops, prog[i, F_TYPE], _op(prog, i), slopes[i], perms, params, acts, aux, cols, pads, 0, b, train,
                         rng)
            i += 1
            continue
        j = i
        while j < n_ops and not _whole_batch(prog[j, F_TYPE]):
            j += 1
        first = block(acts, prog[i, F_IN], prog[i, F_NIN])
        last = block(acts, prog[j - 1, F_OUT], prog[j - 1, F_NOUT])
        for r in range(b):
            row = r if keep else spare
            if not keep:
                copy_into(first[spare], first[r])
            for k in range(i, j):
                call_forward(ops, prog[k, F_TYPE], _op(prog, k), slopes[k], perms, params, acts, aux, cols, pads, row,
                             row + 1, train, rng)
            if not keep:
                copy_into(last[r], last[spare])
        i = j


@njit(inline="always", **JIT)
def _backward(ops, prog, slopes, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, b,
              step, lr, terms):
    """grad <- the parameters' gradient from the output's deltas (already in deltas), in the forward pass's
    runs; with step, a large dense layer applies its weights' SGD step as it goes (dense.py) and leaves them
    out of grad."""
    i = prog.shape[0] - 1
    while i >= 1:
        if _whole_batch(prog[i, F_TYPE]):
            if _needs_backward(prog, i):
                call_backward(ops, prog[i, F_TYPE], _op(prog, i), slopes[i], perms, params, grad, acts, deltas, aux, tr,
                              cols, wt, gt, gblock, pads, 0, b, step, lr, terms)
            i -= 1
            continue
        j = i
        while j >= 1 and not _whole_batch(prog[j, F_TYPE]):
            j -= 1
        for r in range(b):
            for k in range(i, j, -1):
                if _needs_backward(prog, k):
                    call_backward(ops, prog[k, F_TYPE], _op(prog, k), slopes[k], perms, params, grad, acts, deltas,
                                  aux, tr, cols, wt, gt, gblock, pads, r, r + 1, step, lr, terms)
        i = j


@njit(inline="always", **JIT)
def _needs_backward(prog, i):
    """Whether operation i has a backward pass to run: parameters that train, or an input whose gradient a
    trainable layer below it needs (a frozen prefix, or a layer without parameters at the bottom, has none)."""
    return (prog[i, F_NPARAM] > 0 and prog[i, F_FROZEN] == 0) or prog[i, F_GRAD_IN] != 0


@njit(inline="always", **JIT)
def _whole_batch(t):
    """Whether an operation runs over the whole batch at once (a dense or sequence layer), not sample by
    sample."""
    return t == DENSE or t == DENSE_STEPPED or t >= EMBEDDING


@njit(**JIT)
def network(ops, prog, slopes, perms, loss_kind, params, X, labels, targets, idx, n, b, n_steps,
            lr, scale, terms, rng, mode, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, outputs):
    """One entry for everything a model computes; returns (summed loss, count). forward_ops, backward_ops:
    each operation's compiled forward and backward, indexed by its code (ops.tables: only the model's own are
    compiled).

    STEPS: n_steps of params <- params - lr (mean gradient of a minibatch of b of the n rows + the
    algorithm's terms, sgd.py); a minibatch is drawn into idx[:b] from rng as every model draws it (b = n:
    the full batch, in idx order); count = steps, loss = the sum over every sample trained on of its loss
    squared. MINIBATCH: grad <- scale * the summed gradient of one such minibatch. ROWS: grad <- scale * the
    summed gradient of rows idx[:b] (dropout off: the model's deterministic objective). EVAL: loss and
    correct predictions of rows 0..n-1, acts.shape[0] - 1 at a time, and their outputs (the last layer's,
    e.g. logits) into outputs when it has n rows. FEATURES: EVAL's outputs without a loss (a program that ends
    before the network's last layer: a frozen prefix's outputs, models.Sequential.features).
    scale and lr come in the parameter dtype; losses are float64 sums. A label outside the classes stops it:
    count is then -1 - its row.
    """
    # Borrowed views of every buffer (no reference count): the operations' calls then count nothing up and
    # down for their arguments (an atomic operation each way per array: 0.2 us of a logreg step, measured).
    prog, slopes, perms, params = (matrix(prog, 0, prog.shape[0], prog.shape[1]), vector(slopes, 0, slopes.shape[0]),
                                   vector(perms, 0, perms.shape[0]), vector(params, 0, params.shape[0]))
    X, grad = matrix(X, 0, X.shape[0], X.shape[1]), vector(grad, 0, grad.shape[0])
    acts, deltas = matrix(acts, 0, acts.shape[0], acts.shape[1]), matrix(deltas, 0, deltas.shape[0], deltas.shape[1])
    aux, tr = matrix(aux, 0, aux.shape[0], aux.shape[1]), matrix(tr, 0, tr.shape[0], tr.shape[1])
    cols, wt, gt, gblock, pads = (vector(cols, 0, cols.shape[0]), vector(wt, 0, wt.shape[0]),
                                  vector(gt, 0, gt.shape[0]), vector(gblock, 0, gblock.shape[0]),
                                  vector(pads, 0, pads.shape[0]))
    empty = idx[:0]
    # flags as run-time values: a constant argument would make Numba compile each callee again for it
    evaluate = mode == EVAL or mode == FEATURES
    train, step, want_deltas = mode == STEPS or mode == MINIBATCH, mode == STEPS, not evaluate
    # one pass of gather, forward, loss (and backward, step) serves every mode: a copy of each inlined once
    chunk = acts.shape[0] - 1  # EVAL: rows at a time, the last row the runs' scratch
    passes = (n + chunk - 1) // chunk if evaluate else (n_steps if step else 1)
    loss, correct = 0.0, 0
    for it in range(passes):
        rows, first, m = idx, 0, b
        if evaluate:
            rows, first = empty, it * chunk
            m = min(chunk, n - first)
        elif mode != ROWS and b < n:
            draw_batch(rng, idx, n, b)
        _gather(prog, perms, X, rows, first, m, acts)
        _forward(ops, prog, slopes, perms, params, acts, aux, cols, pads, m, train, want_deltas, rng)
        # EVAL: one running sum over every sample, whatever the chunks; STEPS: of the squared sample losses over
        # every step (a report field, no extra pass)
        right = 0
        if mode != FEATURES:
            loss, right = call_loss(ops, LOSS, prog, labels, targets, rows, first, m, scale, loss_kind, acts, deltas,
                                    want_deltas, step, loss if evaluate or step else 0.0)
        if right < 0:
            return loss, right
        if evaluate:
            correct += right
            if outputs.shape[0] == n:
                last = prog[prog.shape[0] - 1]
                Z = block(acts, last[F_OUT], last[F_NOUT])
                for r in range(m):
                    copy_into(outputs[first + r], Z[r])
            continue
        _backward(ops, prog, slopes, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads,
                  m, step, lr, terms)
        if step:
            call_step(ops, STEP, prog, params, grad, lr, terms)
    if evaluate:
        return loss, correct
    return loss, passes if step else (0 if mode == ROWS else 1)
