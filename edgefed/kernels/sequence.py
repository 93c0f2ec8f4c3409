"""Sequence layers over a whole batch: an embedding of token ids, and LSTM and GRU layers (PyTorch's semantics
and parameters, zero initial states, full backpropagation through time over each sample's sequence).

A sequence enters and leaves in the network's layout, step-major: a sample's (L, F) values in one row, as
PyTorch's batch_first. Inside, a recurrent layer works time-major over the batch: the input's part of every
step's pre-activations is one product of L*b rows before the recurrence, each step adds the previous states'
part as one product of b rows, and each weight gradient is one product over every (step, sample) pair.

What the backward pass reads is kept in the layer's work region of the activations (program.F_WORK), laid
out for the pass's b samples (`work_values` sizes it per sample): the input, time-major (L, b, F); then per
stacked layer its states h (L + 1, b, H) with h_0 = 0, an LSTM's cells c alike, and its gates (L, b, 4H)
(LSTM: i, f, g, o after their nonlinearities; GRU: r, z, n and W_hn h + b_hn), a GRU's input part (L, b, 3H)
and one step's state part (b, 3H). The backward pass overwrites the gates with their pre-activations'
gradients, and uses the same region of the deltas for the states' gradients from above (two (L, b, max(F, H))
buffers, one layer's output and the next one down's), the recurrent carries, a GRU's input gradients and the
gates' gradients packed for the weight gradients' products.

The products whose operand is a weight matrix, or the gates' gradients, read it packed into tile-wide column
panels (linalg.pack_columns, into the `cols` scratch, once a pass): the same fmas in the same order, at twice
the speed where rows of 4H values map to few cache sets. The gate loops run one nonlinearity at a time over a
row, and exp, the sigmoid and tanh are exponential.py's, so that they vectorize.

Weights are stored transposed against PyTorch's, (in, gates * H), as a dense layer's, so every product
streams rows; state_dict converts (layers/).

Arithmetic, the same on every CPU: a pre-activation starts from b_ih + b_hh (a GRU keeps the two parts
apart, as its n gate needs), then adds the input's terms and the previous state's, each in index order, one
fma each (linalg.py; h_0 = 0 adds nothing); each nonlinearity (exponential.py's) and each update of a cell,
a state or a gradient is evaluated in float64 from the stored values and rounded once where it is stored (an
LSTM's backward pass recomputes tanh(c_t) into the model dtype first). A bias's gradient sums the (step,
sample) pairs step by step, samples within; a weight's gradient adds the same pairs in the same order, one
fma each. An embedding's gradient adds each (sample, position)'s delta to its
token's row in sample order, then position; the padding_idx row gets none.
"""

import numpy as np
from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.dense import bias_gradient
from edgefed.kernels.exponential import sigmoid64, tanh64
from edgefed.kernels.fma import TILE_BYTES, fma
from edgefed.kernels.linalg import (accumulate_product, block, copy_into, matrix, pack_columns, packed_outer,
                                    packed_product, packed_values, transpose_into, vector)
from edgefed.kernels.program import (F_C, F_CO, F_GRAD_IN, F_H, F_IN, F_MODE, F_NOUT, F_OUT, F_PARAM, F_W,
                                     F_WORK)


def work_values(lstm: bool, length: int, features: int, hidden: int, layers: int, itemsize: int) -> int:
    """Values per sample of a recurrent layer's work region: what its forward pass keeps, or what its backward
    pass uses of the deltas' region, whichever is more (the layout in the module's docstring)."""
    L, F, H = length, features, hidden
    kept = L * F + layers * _layer_values.py_func(lstm, L, H)  # (its Python: planning compiles nothing)
    gates = (4 if lstm else 3) * H
    scratch = 2 * L * max(F, H) + 2 * H + (0 if lstm else 3 * L * H) + packed_values(L, gates, itemsize)
    return max(kept, scratch)


def pack_values(lstm: bool, features: int, hidden: int, itemsize: int) -> int:
    """Values of the `cols` scratch a recurrent layer packs its weights into."""
    gates = (4 if lstm else 3) * hidden
    return max(packed_values(max(features, hidden), gates, itemsize), packed_values(gates, hidden, itemsize))


@njit(inline="always", **JIT)
def _padded(n, itemsize):
    """n rounded up to whole tiles (as packed_values)."""
    nr = TILE_BYTES // itemsize
    return (n + nr - 1) // nr * nr


@njit(inline="always", **JIT)
def _layer_values(lstm, L, H):
    """Values per sample one stacked layer keeps."""
    if lstm:
        return 2 * (L + 1) * H + 4 * L * H
    return (L + 1) * H + 4 * L * H + 3 * L * H + 3 * H


@njit(inline="always", **JIT)
def _layer_params(op, k, GW):
    """Where stacked layer k's parameters start: per layer weight_ih (in, GW), weight_hh (H, GW), bias_ih,
    bias_hh, in PyTorch's order (GW = gates x H)."""
    F0, H = op[F_C], op[F_CO]
    p = op[F_PARAM]
    for j in range(k):
        p += GW * ((F0 if j == 0 else H) + H + 2)
    return p


# ------------------------------------------------------------------------------------------------- LSTM
@njit(inline="always", **JIT)
def _lstm_layer_forward(params, p, acts, cols, X0, F, S0, C0, G0, b, L, H):
    """One stacked layer over the time-major input at X0 (L*b, F): states at S0, cells at C0, gates at G0."""
    GW, n = 4 * H, L * b
    Wih, Whh = matrix(params, p, F, GW), matrix(params, p + F * GW, H, GW)
    bih, bhh = vector(params, p + (F + H) * GW, GW), vector(params, p + (F + H + 1) * GW, GW)
    G = matrix(acts, G0, n, GW)
    for q in range(n):
        g = G[q]
        for j in range(GW):
            g[j] = bih[j] + bhh[j]
    pack_columns(Wih, F, GW, cols)
    packed_product(matrix(acts, X0, n, F), cols, G, n, F, GW, False)
    pack_columns(Whh, H, GW, cols)
    for j in range(b * H):
        acts.flat[S0 + j] = 0  # (flat: the work region's own layout, not acts' rows)
        acts.flat[C0 + j] = 0
    for s in range(L):
        if s > 0:
            packed_product(matrix(acts, S0 + s * b * H, b, H), cols, matrix(acts, G0 + s * b * GW, b, GW), b, H, GW,
                           False)
        for r in range(b):
            q = G0 + (s * b + r) * GW
            gif, gg, go = vector(acts, q, 2 * H), vector(acts, q + 2 * H, H), vector(acts, q + 3 * H, H)
            for j in range(2 * H):
                gif[j] = sigmoid64(np.float64(gif[j]))
            for j in range(H):
                gg[j] = tanh64(np.float64(gg[j]))
            for j in range(H):
                go[j] = sigmoid64(np.float64(go[j]))
            gi, gf = vector(acts, q, H), vector(acts, q + H, H)
            cp, cn = vector(acts, C0 + (s * b + r) * H, H), vector(acts, C0 + ((s + 1) * b + r) * H, H)
            for j in range(H):
                cn[j] = fma(np.float64(gf[j]), np.float64(cp[j]), np.float64(gi[j]) * np.float64(gg[j]))
            hn = vector(acts, S0 + ((s + 1) * b + r) * H, H)
            for j in range(H):
                hn[j] = np.float64(go[j]) * tanh64(np.float64(cn[j]))


@njit(inline="always", **JIT)
def _lstm_layer_backward(params, grad, p, acts, deltas, wt, cols, X0, F, S0, C0, G0, dA0, dX0, need_dx, dh0, dc0, pd0, b,
                         L, H):
    """The layer's gradients from its states' gradients from above at dA0 (L*b, H); with need_dx, its input's
    into dX0 (L*b, F). The gates at G0 become their pre-activations' gradients; pd0: room for them packed."""
    GW, n = 4 * H, L * b
    Wih, Whh = matrix(params, p, F, GW), matrix(params, p + F * GW, H, GW)
    dh, dc = matrix(deltas, dh0, b, H), matrix(deltas, dc0, b, H)
    for r in range(b):
        for j in range(H):
            dh[r, j] = 0
            dc[r, j] = 0
    WhhT = matrix(wt, 0, GW, H)
    transpose_into(Whh, WhhT, H, GW)
    pack_columns(WhhT, GW, H, cols)
    tcs = vector(deltas, pd0, H)  # (the packed room is free until the loop ends)
    for s in range(L - 1, -1, -1):
        for r in range(b):
            g = vector(acts, G0 + (s * b + r) * GW, GW)
            cp, cn = vector(acts, C0 + (s * b + r) * H, H), vector(acts, C0 + ((s + 1) * b + r) * H, H)
            above, carry, cell = vector(deltas, dA0 + (s * b + r) * H, H), dh[r], dc[r]
            for j in range(H):
                tcs[j] = tanh64(np.float64(cn[j]))
            for j in range(H):
                i, f, c, o = np.float64(g[j]), np.float64(g[H + j]), np.float64(g[2 * H + j]), np.float64(g[3 * H + j])
                tc = np.float64(tcs[j])
                d = np.float64(above[j]) + np.float64(carry[j])
                dcell = np.float64(cell[j]) + d * o * (1.0 - tc * tc)
                g[j] = dcell * c * i * (1.0 - i)
                g[H + j] = dcell * np.float64(cp[j]) * f * (1.0 - f)
                g[2 * H + j] = dcell * i * (1.0 - c * c)
                g[3 * H + j] = d * tc * o * (1.0 - o)
                cell[j] = dcell * f
        if s > 0:
            packed_product(matrix(acts, G0 + s * b * GW, b, GW), cols, dh, b, GW, H, True)
    D = matrix(acts, G0, n, GW)
    bias_gradient(D, vector(grad, p + (F + H) * GW, GW), n, GW)
    copy_into(vector(grad, p + (F + H + 1) * GW, GW), vector(grad, p + (F + H) * GW, GW))  # b_hh's = b_ih's
    _weight_gradients(acts, deltas, grad, p, X0, F, S0, D, D, pd0, GW, n, H, True)
    if need_dx:
        _input_gradient(Wih, wt, matrix(acts, G0, n, GW), matrix(deltas, dX0, n, F), F, GW, n)


# -------------------------------------------------------------------------------------------------- GRU
@njit(inline="always", **JIT)
def _gru_layer_forward(params, p, acts, cols, X0, F, S0, G0, GI0, GH0, b, L, H):
    """One stacked layer over the time-major input at X0 (L*b, F): states at S0, gates at G0 (r, z, n and
    W_hn h + b_hn), the input's part at GI0, a step's state part at GH0."""
    GW, n = 3 * H, L * b
    Wih, Whh = matrix(params, p, F, GW), matrix(params, p + F * GW, H, GW)
    bih, bhh = vector(params, p + (F + H) * GW, GW), vector(params, p + (F + H + 1) * GW, GW)
    GI, GH = matrix(acts, GI0, n, GW), matrix(acts, GH0, b, GW)
    for q in range(n):
        copy_into(GI[q], bih)
    pack_columns(Wih, F, GW, cols)
    packed_product(matrix(acts, X0, n, F), cols, GI, n, F, GW, False)
    pack_columns(Whh, H, GW, cols)
    for j in range(b * H):
        acts.flat[S0 + j] = 0
    for s in range(L):
        for r in range(b):
            copy_into(GH[r], bhh)
        if s > 0:
            packed_product(matrix(acts, S0 + s * b * H, b, H), cols, GH, b, H, GW, False)
        for r in range(b):
            qi, qh, q = GI0 + (s * b + r) * GW, GH0 + r * GW, G0 + (s * b + r) * 4 * H
            gi2, gh2, g2 = vector(acts, qi, 2 * H), vector(acts, qh, 2 * H), vector(acts, q, 2 * H)
            for j in range(2 * H):
                g2[j] = sigmoid64(np.float64(gi2[j]) + np.float64(gh2[j]))
            ghn, hh = vector(acts, qh + 2 * H, H), vector(acts, q + 3 * H, H)
            for j in range(H):
                hh[j] = ghn[j]
            gin, gr, gn = vector(acts, qi + 2 * H, H), vector(acts, q, H), vector(acts, q + 2 * H, H)
            for j in range(H):
                gn[j] = tanh64(np.float64(gin[j]) + np.float64(gr[j]) * np.float64(ghn[j]))
            gz = vector(acts, q + H, H)
            hp, hn = vector(acts, S0 + (s * b + r) * H, H), vector(acts, S0 + ((s + 1) * b + r) * H, H)
            for j in range(H):
                z, c = np.float64(gz[j]), np.float64(gn[j])
                hn[j] = (1.0 - z) * c + z * np.float64(hp[j])


@njit(inline="always", **JIT)
def _gru_layer_backward(params, grad, p, acts, deltas, wt, cols, X0, F, S0, G0, dA0, dX0, need_dx, dh0, dGi0, pd0, b,
                        L, H):
    """As _lstm_layer_backward: the input part's gradients (r, z, n) go to dGi0 (L*b, 3H), the state part's
    (r, z, r * n's) over the gates at G0."""
    GW, n = 3 * H, L * b
    Wih, Whh = matrix(params, p, F, GW), matrix(params, p + F * GW, H, GW)
    dh = matrix(deltas, dh0, b, H)
    for r in range(b):
        for j in range(H):
            dh[r, j] = 0
    WhhT = matrix(wt, 0, GW, H)
    transpose_into(Whh, WhhT, H, GW)
    pack_columns(WhhT, GW, H, cols)
    for s in range(L - 1, -1, -1):
        for r in range(b):
            g, gi = vector(acts, G0 + (s * b + r) * 4 * H, 4 * H), vector(deltas, dGi0 + (s * b + r) * GW, GW)
            hp, above, carry = vector(acts, S0 + (s * b + r) * H, H), vector(deltas, dA0 + (s * b + r) * H, H), dh[r]
            for j in range(H):
                rg, z, c, hh = np.float64(g[j]), np.float64(g[H + j]), np.float64(g[2 * H + j]), np.float64(g[3 * H + j])
                d = np.float64(above[j]) + np.float64(carry[j])
                dan = d * (1.0 - z) * (1.0 - c * c)
                dar = dan * hh * rg * (1.0 - rg)
                daz = d * (np.float64(hp[j]) - c) * z * (1.0 - z)
                gi[j] = dar
                gi[H + j] = daz
                gi[2 * H + j] = dan
                g[j] = dar
                g[H + j] = daz
                g[2 * H + j] = dan * rg
                carry[j] = d * z
        if s > 0:
            packed_product(matrix(acts, G0 + s * b * 4 * H, b, 4 * H), cols, dh, b, GW, H, False)
    DI, DH = matrix(deltas, dGi0, n, GW), matrix(acts, G0, n, 4 * H)
    bias_gradient(DI, vector(grad, p + (F + H) * GW, GW), n, GW)
    bias_gradient(DH, vector(grad, p + (F + H + 1) * GW, GW), n, GW)
    _weight_gradients(acts, deltas, grad, p, X0, F, S0, DI, DH, pd0, GW, n, H, False)
    if need_dx:
        _input_gradient(Wih, wt, matrix(deltas, dGi0, n, GW), matrix(deltas, dX0, n, F), F, GW, n)


# ------------------------------------------------------------------------------------------ both kinds
@njit(inline="always", **JIT)
def _weight_gradients(acts, deltas, grad, p, X0, F, S0, DI, DH, pd0, GW, n, H, same):
    """weight_ih's and weight_hh's gradients from the input part's pre-activation gradients DI and the state
    part's DH (same: one matrix, an LSTM's; the first GW columns of each row are read), each packed at pd0."""
    P = vector(deltas, pd0, n * _padded(GW, deltas.itemsize))
    pack_columns(DI, n, GW, P)
    packed_outer(matrix(acts, X0, n, F), P, matrix(grad, p, F, GW), n, F, GW, True)
    if not same:
        pack_columns(DH, n, GW, P)
    packed_outer(matrix(acts, S0, n, H), P, matrix(grad, p + F * GW, H, GW), n, H, GW, True)


@njit(inline="always", **JIT)
def _input_gradient(Wih, wt, D, DX, F, GW, n):
    """DX (n, F) <- D W_ih^T, W_ih^T packed first."""
    WT = matrix(wt, 0, GW, F)
    transpose_into(Wih, WT, F, GW)
    accumulate_product(D, WT, DX, n, GW, F, True)


@njit(inline="always", **JIT)
def _time_major_input(op, acts, base, b):
    """The op's input (b, L*F), step-major rows, into the work region's first (L*b, F), time-major."""
    L, F0 = op[F_W], op[F_C]
    X = block(acts, op[F_IN], L * F0)
    for s in range(L):
        for r in range(b):
            x, out = X[r], vector(acts, base + (s * b + r) * F0, F0)
            for j in range(F0):
                out[j] = x[s * F0 + j]


@njit(inline="always", **JIT)
def _output(op, acts, S0, b):
    """The top layer's states at S0 into the op's output: every step's (b, L*H), or the last step's (b, H)."""
    L, H = op[F_W], op[F_CO]
    Z = block(acts, op[F_OUT], op[F_NOUT])
    every = op[F_MODE] == 1
    for r in range(b):
        z = Z[r]
        for s in range(L if every else 1):
            h = vector(acts, S0 + ((s + 1 if every else L) * b + r) * H, H)
            for j in range(H):
                z[s * H + j] = h[j]


@njit(inline="always", **JIT)
def _backward_start(op, deltas, b):
    """The deltas' work region's two (L*b, max(F, H)) buffers, states' gradients from above and the input's
    (the next layer down's), and where the carries start; the output's deltas into the first, time-major."""
    L, M = op[F_W], max(op[F_C], op[F_CO])
    above = deltas.shape[0] * op[F_WORK]
    _deltas_from_above(op, deltas, above, b)
    return above, above + b * L * M, above + 2 * b * L * M


@njit(inline="always", **JIT)
def _deltas_from_above(op, deltas, above, b):
    """The output's deltas as the top layer's states' gradients at `above`, time-major (L*b, H)."""
    L, H = op[F_W], op[F_CO]
    DZ = block(deltas, op[F_OUT], op[F_NOUT])
    every = op[F_MODE] == 1
    for s in range(L):
        for r in range(b):
            d = vector(deltas, above + (s * b + r) * H, H)
            for j in range(H):
                d[j] = DZ[r, s * H + j] if every else (DZ[r, j] if s == L - 1 else 0)


@njit(inline="always", **JIT)
def _input_deltas(op, deltas, at, b):
    """The first layer's input gradient at `at` (L*b, F), back to the op's input rows, step-major."""
    L, F0 = op[F_W], op[F_C]
    DX = block(deltas, op[F_IN], L * F0)
    for s in range(L):
        for r in range(b):
            d, dx = vector(deltas, at + (s * b + r) * F0, F0), DX[r]
            for j in range(F0):
                dx[s * F0 + j] = d[j]


# -------------------------------------------------------------------------------- the operations of a batch
# Each kind's operation walks its stacked layers itself (one shared driver with a kind flag would compile both
# kinds' layers into each operation: 2 s more of every cold start, measured).
@njit(**JIT)
def lstm_forward_op(op, slope, perms, params, acts, aux, cols, pads, r0, b, train, rng):
    L, F0, H, K = op[F_W], op[F_C], op[F_CO], op[F_H]
    base, per = acts.shape[0] * op[F_WORK], _layer_values(True, L, H)
    _time_major_input(op, acts, base, b)
    X0, F, S0 = base, F0, base
    for k in range(K):
        S0 = base + b * (L * F0 + k * per)
        _lstm_layer_forward(params, _layer_params(op, k, 4 * H), acts, cols, X0, F, S0, S0 + b * (L + 1) * H,
                            S0 + 2 * b * (L + 1) * H, b, L, H)
        X0, F = S0 + b * H, H  # its states h_1..h_L: the next layer's input
    _output(op, acts, S0, b)


@njit(**JIT)
def lstm_backward_op(op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, b, step,
                     lr, terms):
    L, F0, H, K = op[F_W], op[F_C], op[F_CO], op[F_H]
    base, per = acts.shape[0] * op[F_WORK], _layer_values(True, L, H)
    above, below, dh0 = _backward_start(op, deltas, b)
    for k in range(K - 1, -1, -1):
        at = base + b * (L * F0 + k * per)
        X0, F = (base, F0) if k == 0 else (at - b * per + b * H, H)
        _lstm_layer_backward(params, grad, _layer_params(op, k, 4 * H), acts, deltas, wt, cols, X0, F, at,
                             at + b * (L + 1) * H, at + 2 * b * (L + 1) * H, above, below, k > 0 or op[F_GRAD_IN] == 1,
                             dh0, dh0 + b * H, dh0 + 2 * b * H, b, L, H)
        above, below = below, above
    if op[F_GRAD_IN] == 1:
        _input_deltas(op, deltas, above, b)


@njit(**JIT)
def gru_forward_op(op, slope, perms, params, acts, aux, cols, pads, r0, b, train, rng):
    L, F0, H, K = op[F_W], op[F_C], op[F_CO], op[F_H]
    base, per = acts.shape[0] * op[F_WORK], _layer_values(False, L, H)
    _time_major_input(op, acts, base, b)
    X0, F, S0 = base, F0, base
    for k in range(K):
        S0 = base + b * (L * F0 + k * per)
        G0 = S0 + b * (L + 1) * H
        _gru_layer_forward(params, _layer_params(op, k, 3 * H), acts, cols, X0, F, S0, G0, G0 + 4 * b * L * H,
                           G0 + 7 * b * L * H, b, L, H)
        X0, F = S0 + b * H, H
    _output(op, acts, S0, b)


@njit(**JIT)
def gru_backward_op(op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, b, step,
                    lr, terms):
    L, F0, H, K = op[F_W], op[F_C], op[F_CO], op[F_H]
    base, per = acts.shape[0] * op[F_WORK], _layer_values(False, L, H)
    above, below, dh0 = _backward_start(op, deltas, b)
    for k in range(K - 1, -1, -1):
        at = base + b * (L * F0 + k * per)
        X0, F = (base, F0) if k == 0 else (at - b * per + b * H, H)
        _gru_layer_backward(params, grad, _layer_params(op, k, 3 * H), acts, deltas, wt, cols, X0, F, at,
                            at + b * (L + 1) * H, above, below, k > 0 or op[F_GRAD_IN] == 1, dh0, dh0 + 2 * b * H,
                            dh0 + 2 * b * H + 3 * b * L * H, b, L, H)
        above, below = below, above
    if op[F_GRAD_IN] == 1:
        _input_deltas(op, deltas, above, b)


@njit(**JIT)
def embedding_forward_op(op, slope, perms, params, acts, aux, cols, pads, r0, b, train, rng):
    """Each position's row of the (num, dim) table; the ids arrive as exact values in the model dtype (checked
    against num when the data is read, not here)."""
    L, D = op[F_W], op[F_CO]
    X, Z, W = block(acts, op[F_IN], L), block(acts, op[F_OUT], L * D), matrix(params, op[F_PARAM], op[F_C], D)
    for r in range(b):
        x, z = X[r], Z[r]
        for s in range(L):
            w = W[np.int64(x[s])]
            for j in range(D):
                z[s * D + j] = w[j]


@njit(**JIT)
def embedding_backward_op(op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, b,
                          step, lr, terms):
    V, L, D, pad = op[F_C], op[F_W], op[F_CO], op[F_MODE] - 1
    G = matrix(grad, op[F_PARAM], V, D)
    for t in range(V):
        g = G[t]
        for j in range(D):
            g[j] = 0
    X, DZ = block(acts, op[F_IN], L), block(deltas, op[F_OUT], L * D)
    for r in range(b):
        x, d = X[r], DZ[r]
        for s in range(L):
            t = np.int64(x[s])
            if t != pad:
                g = G[t]
                for j in range(D):
                    g[j] += d[s * D + j]
