"""McMahan et al.'s CNN: two 5x5 "same" convolutions (32 then 64 channels), each with ReLU and 2x2 max pooling,
a 512-unit ReLU layer, and a softmax output: 1,663,370 parameters for 28x28 inputs and 10 classes.

Flat parameters: conv1 W (5, 5, 1, 32) [ky, kx, c_in, c_out], b (32); conv2 W (5, 5, 32, 64), b (64);
fc1 W (7*7*64, 512) over the pooled map flattened as (y, x, channel), b (512); fc2 W (512, C), b (C).
Feature maps are channels-last, so every inner loop runs over contiguous output channels. All buffers are
caller-owned; a step allocates nothing.

Summation order (as linalg.py: from the initial value, one fma per term): convolutions as im2col products,
a pixel's outputs from the bias over its window's taps in (ky, kx, c_in) order, padding zeros included;
a weight gradient over the pixels in row-major order, then over the batch in sample order.
"""

import numpy as np
from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.linalg import accumulate_outer, accumulate_product, copy_into, transpose_into
from edgefed.kernels.softmax import cross_entropy, softmax_xent
from edgefed.kernels.sgd import apply_step, terms_slice

K, PAD = 5, 2
FC1_ROWS = 12  # rows of fc1's W per block of its fused backward: 12 x 512 floats, 24 KB of a 32 KB L1


def scratch_size(side: int) -> int:
    """Floats of scratch a step needs (see _scratch): one sample's unrolled windows (conv2's are the larger),
    conv2's packed W^T, the zero-bordered copies of each convolution's input, and a block of fc1's gradient."""
    s2 = side // 2
    return s2 * s2 * K * K * 32 + 64 * K * K * 32 + (side + 2 * PAD) ** 2 + (s2 + 2 * PAD) ** 2 * 32 + FC1_ROWS * 512


def transposed_size(side: int) -> int:
    """Floats per sample of the transposed fc1 deltas (dH^T, 512) and input gradient (dP2^T)."""
    return 512 + (side // 4) ** 2 * 64


def layout(side: int, n_classes: int):
    """(parameter offsets, total parameters, activation sizes per sample) for a side x side input."""
    s2, s4 = side // 2, side // 4
    shapes = [(K * K * 1 * 32, 32), (K * K * 32 * 64, 64), (s4 * s4 * 64 * 512, 512), (512 * n_classes, n_classes)]
    offsets, off = [], 0
    for w, b in shapes:
        offsets.append(off)
        off += w + b
    # per sample: input, conv1 (before ReLU and pooling), pool1, conv2, pool2, fc1, logits
    acts = (side * side, side * side * 32, s2 * s2 * 32, s2 * s2 * 64, s4 * s4 * 64, 512, n_classes)
    return np.array(offsets, np.int64), off, np.array(acts, np.int64)


@njit(**JIT)
def _unroll(fmap, side, cin, padded, cols):
    """im2col: cols (side*side, K*K*cin) <- every output pixel's 5x5 window of fmap (side, side, cin).

    Through padded, (side+4, side+4, cin) with a zero border that is never written: a window's row is then
    5*cin contiguous values, copied without a bounds test, view to view (so LLVM vectorizes the copy):
    measured 2x the per-tap loop with tests on conv1, the same on conv2.
    """
    width = K * cin
    for y in range(side):
        row = padded[y + PAD]
        src = fmap[y]
        for x in range(side):
            for c in range(cin):
                row[x + PAD, c] = src[x, c]
    flat = padded.reshape((side + 2 * PAD, (side + 2 * PAD) * cin))
    for y in range(side):
        for x in range(side):
            dst = cols[y * side + x]
            for ky in range(K):
                copy_into(dst[ky * width:(ky + 1) * width], flat[y + ky, x * cin:x * cin + width])


@njit(**JIT)
def _fold(cols, side, cin, padded, dinp):
    """col2im, the adjoint of _unroll: dinp (side, side, cin) <- the rows of cols summed back onto their
    windows (in pixel order), the part on the padding dropped. padded's border is restored to zero.
    View to view, as _unroll: measured 5x the per-tap loop with bounds tests on conv2."""
    width = K * cin
    padded[:] = 0
    flat = padded.reshape((side + 2 * PAD, (side + 2 * PAD) * cin))
    for y in range(side):
        for x in range(side):
            src = cols[y * side + x]
            for ky in range(K):
                dst = flat[y + ky, x * cin:x * cin + width]
                part = src[ky * width:(ky + 1) * width]
                for t in range(width):
                    dst[t] += part[t]
    for y in range(side):
        row = padded[y + PAD]
        for x in range(side):
            for c in range(cin):
                dinp[y, x, c] = row[x + PAD, c]
    padded[:] = 0


@njit(**JIT)
def _scratch(scratch, side):
    """(windows, conv2 W^T, conv1's padded input, conv2's padded input, fc1 gradient block) as views of the
    flat scratch."""
    s2 = side // 2
    n_cols, n_wt = s2 * s2 * K * K * 32, 64 * K * K * 32
    p1, p2 = side + 2 * PAD, s2 + 2 * PAD
    o1 = n_cols + n_wt
    o2 = o1 + p1 * p1
    o3 = o2 + p2 * p2 * 32
    return (scratch[:n_cols], scratch[n_cols:o1].reshape((64, K * K * 32)), scratch[o1:o2].reshape((p1, p1, 1)),
            scratch[o2:o3].reshape((p2, p2, 32)), scratch[o3:o3 + FC1_ROWS * 512].reshape((FC1_ROWS, 512)))


@njit(**JIT)
def _conv_forward(inp, W, bias, out, side, cin, cout, cols_area, padded):
    """out (side, side, cout) <- conv(inp (side, side, cin), W (K, K, cin, cout)) + bias, zero padding (its ReLU
    comes with the pooling).

    As a product of the unrolled windows (im2col) with W seen as (K*K*cin, cout): the blocked product then
    runs at the speed of a dense layer (measured 4x the direct loops on the 14x14x32 -> 64 convolution).
    """
    n, depth = side * side, K * K * cin
    cols = cols_area[:n * depth].reshape((n, depth))
    _unroll(inp, side, cin, padded, cols)
    out2 = out.reshape((n, cout))
    for r in range(n):
        copy_into(out2[r], bias)
    accumulate_product(cols, W.reshape((depth, cout)), out2, n, depth, cout)


@njit(**JIT)
def _pool_forward(inp, out, arg, side, ch):
    """out (side/2, side/2, ch) <- ReLU of the 2x2 max pooling of inp (side, side, ch), the convolution's
    outputs before their ReLU; arg keeps the winner (0..3). ReLU after pooling equals pooling after ReLU
    (both monotone), and costs a quarter of the pass."""
    half = side // 2
    for y in range(half):
        for x in range(half):
            for c in range(ch):
                best = inp[2 * y, 2 * x, c]
                which = 0
                for q in range(1, 4):
                    v = inp[2 * y + q // 2, 2 * x + q % 2, c]
                    if v > best:
                        best = v
                        which = q
                out[y, x, c] = best if best > 0 else 0
                arg[y, x, c] = which


@njit(**JIT)
def _views(params, offsets, side, n_classes):
    s4 = side // 4
    o = offsets
    w1 = params[o[0]:o[0] + K * K * 32].reshape((K, K, 1, 32))
    b1 = params[o[0] + K * K * 32:o[1]]
    w2 = params[o[1]:o[1] + K * K * 32 * 64].reshape((K, K, 32, 64))
    b2 = params[o[1] + K * K * 32 * 64:o[2]]
    w3 = params[o[2]:o[2] + s4 * s4 * 64 * 512].reshape((s4 * s4 * 64, 512))
    b3 = params[o[2] + s4 * s4 * 64 * 512:o[3]]
    w4 = params[o[3]:o[3] + 512 * n_classes].reshape((512, n_classes))
    b4 = params[o[3] + 512 * n_classes:o[3] + 512 * n_classes + n_classes]
    return w1, b1, w2, b2, w3, b3, w4, b4


@njit(**JIT)
def _pool_backward(dout, arg, din, side, ch, act):
    """Route each pooled gradient to its winner; ReLU's derivative uses act (the convolution's outputs)."""
    din[:] = 0
    half = side // 2
    for y in range(half):
        for x in range(half):
            for c in range(ch):
                q = arg[y, x, c]
                yy, xx = 2 * y + q // 2, 2 * x + q % 2
                if act[yy, xx, c] > 0:
                    din[yy, xx, c] = dout[y, x, c]


@njit(**JIT)
def _conv_backward(inp, WT, dout, gW, gb, dinp, side, cin, cout, cols_area, padded, first, need_dinp):
    """gW, gb += the convolution's gradients for one sample (first: gW = them); dinp <- the gradient w.r.t.
    its input if need_dinp. WT: W packed as (cout, K*K*cin), once per step.

    With the windows unrolled again: gW += cols^T dout, and d(cols) = dout W^T folded back onto the map.
    """
    n, depth = side * side, K * K * cin
    cols = cols_area[:n * depth].reshape((n, depth))
    _unroll(inp, side, cin, padded, cols)
    d2 = dout.reshape((n, cout))
    for r in range(n):
        for co in range(cout):
            gb[co] += d2[r, co]
    accumulate_outer(cols, d2, gW.reshape((depth, cout)), n, depth, cout, first)
    if need_dinp:
        accumulate_product(d2, WT, cols, n, cout, depth, True)  # the windows' gradient, in their place
        _fold(cols, side, cin, padded, dinp)


@njit(**JIT)
def _features_one(params, offsets, side, n_classes, x, a1, p1, g1, a2, p2, g2, scratch):
    """The convolutional part for one sample: conv1, pool1, conv2, pool2."""
    w1, b1, w2, b2, _, _, _, _ = _views(params, offsets, side, n_classes)
    cols, _, pad1, pad2, _ = _scratch(scratch, side)
    s2 = side // 2
    _conv_forward(x.reshape((side, side, 1)), w1, b1, a1.reshape((side, side, 32)), side, 1, 32, cols, pad1)
    _pool_forward(a1.reshape((side, side, 32)), p1.reshape((s2, s2, 32)), g1.reshape((s2, s2, 32)), side, 32)
    _conv_forward(p1.reshape((s2, s2, 32)), w2, b2, a2.reshape((s2, s2, 64)), s2, 32, 64, cols, pad2)
    _pool_forward(a2.reshape((s2, s2, 64)), p2.reshape((s2 // 2, s2 // 2, 64)), g2.reshape((s2 // 2, s2 // 2, 64)),
                  s2, 64)


@njit(**JIT)
def _dense_forward(P2, H, Z, w3, b3, w4, b4, b):
    """H <- ReLU(b3 + P2 w3), Z <- b4 + H w4 over the first b rows: the dense layers of a batch at once."""
    for r in range(b):
        copy_into(H[r], b3)
        copy_into(Z[r], b4)
    accumulate_product(P2, w3, H, b, w3.shape[0], w3.shape[1])
    for r in range(b):
        for j in range(H.shape[1]):
            if H[r, j] < 0:
                H[r, j] = 0
    accumulate_product(H, w4, Z, b, w4.shape[0], w4.shape[1])


@njit(inline="always", **JIT)
def _starts(side):
    """Where each part of one sample's activations starts (layout()'s order: input, conv1, pool1, conv2,
    pool2, fc1, logits) and how many pooling winners pool1 keeps: (o1, o2, o3, o4, o5, o6, n2)."""
    s2, s4 = side // 2, side // 4
    o1 = side * side
    o2 = o1 + side * side * 32
    o3 = o2 + s2 * s2 * 32
    o4 = o3 + s2 * s2 * 64
    o5 = o4 + s4 * s4 * 64
    return o1, o2, o3, o4, o5, o5 + 512, s2 * s2 * 32


@njit(**JIT)
def _fc1_backward(P2, dH, w3, g3, dP2, b, DT, PT, gblock, step, params, w3_start, lr, terms):
    """dP2 <- dH w3^T and g3 <- P2^T dH, block by block of FC1_ROWS rows of w3; with step, each block is
    applied at once (w3 -= lr (g3 + terms), as apply_step) instead of being stored in g3.

    At a small batch fc1 is bound by memory, not arithmetic (w3 is 6.4 MB): fused, w3 streams once per
    backward pass (read, then written) and its gradient never leaves the L1 cache, where the gradient,
    then the update, would stream it three times more. The bits are those of the unfused pass: each block's
    products are computed from the old w3 before the block is updated, and nothing later reads w3.
    """
    n4, width = w3.shape
    transpose_into(dH, DT, b, width)
    for k0 in range(0, n4, FC1_ROWS):
        rows = min(FC1_ROWS, n4 - k0)
        accumulate_product(w3[k0:k0 + rows], DT, PT[k0:k0 + rows], rows, width, b, True)  # dP2^T = w3 dH^T
        G = gblock[:rows] if step else g3[k0:k0 + rows]
        accumulate_outer(P2[:, k0:k0 + rows], dH, G, b, rows, width, True)
        if step:
            start, stop = w3_start + k0 * width, w3_start + (k0 + rows) * width
            apply_step(params[start:stop], gblock[:rows].reshape(-1), lr, terms_slice(terms, start, stop))
    transpose_into(PT, dP2, n4, b)


@njit(**JIT)
def _batch_grad(params, offsets, side, n_classes, X, y, idx, b, scale, grad, acts, deltas, args, tr, scratch, w4t,
                step, lr, terms):
    """grad <- scale * sum of the gradients of the rows idx[:b]; returns their summed loss (float64).
    step: the SGD step itself, params -= lr (grad + terms) as apply_step (grad's fc1 part then unused).

    acts/deltas: (b, per-sample activation total) in the model dtype; args: (b, pooling winners) int8;
    tr: (b, transposed_size) scratch; w4t: (n_classes, 512) scratch. Convolutions run sample by sample
    (conv2 as one im2col product); the dense layers over the whole batch, so their weights stream once
    per step. Every weight gradient is written by its first term, so grad is never zeroed as a whole.
    """
    s2, s4 = side // 2, side // 4
    o1, o2, o3, o4, o5, o6, n2 = _starts(side)
    n4 = o5 - o4
    w1, b1, w2, b2, w3, b3, w4, b4 = _views(params, offsets, side, n_classes)
    g1, gb1, g2, gb2, g3, gb3, g4, gb4 = _views(grad, offsets, side, n_classes)
    for r in range(b):
        a = acts[r]
        copy_into(a[:o1], X[idx[r]])
        _features_one(params, offsets, side, n_classes, a[:o1], a[o1:o2], a[o2:o3], args[r, :n2], a[o3:o4],
                      a[o4:o5], args[r, n2:n2 + n4], scratch)
    P2, H, Z = acts[:b, o4:o5], acts[:b, o5:o6], acts[:b, o6:o6 + n_classes]
    _dense_forward(P2, H, Z, w3, b3, w4, b4, b)
    dP2, dH, dZ = deltas[:b, o4:o5], deltas[:b, o5:o6], deltas[:b, o6:o6 + n_classes]
    gb1[:] = 0
    gb2[:] = 0
    gb3[:] = 0
    gb4[:] = 0
    loss = 0.0
    for r in range(b):
        dz = dZ[r]
        loss += softmax_xent(Z[r], y[idx[r]], scale, dz)
        for c in range(n_classes):
            gb4[c] += dz[c]
    transpose_into(w4, w4t, 512, n_classes)
    accumulate_product(dZ, w4t, dH, b, n_classes, 512, True)
    for r in range(b):
        for j in range(512):
            if H[r, j] <= 0:
                dH[r, j] = 0
            gb3[j] += dH[r, j]
    accumulate_outer(H, dZ, g4, b, 512, n_classes, True)
    cols, W2T, pad1, pad2, gblock = _scratch(scratch, side)
    flat = tr.reshape(-1)
    w3_start = offsets[2]
    _fc1_backward(P2, dH, w3, g3, dP2, b, flat[:512 * b].reshape((512, b)),
                  flat[512 * b:(512 + n4) * b].reshape((n4, b)), gblock, step, params, w3_start, lr, terms)
    transpose_into(w2.reshape((K * K * 32, 64)), W2T, K * K * 32, 64)
    for r in range(b):
        a, dl = acts[r], deltas[r]
        a1, p1, a2 = a[o1:o2], a[o2:o3], a[o3:o4]
        q1, q2 = args[r, :n2], args[r, n2:n2 + n4]
        da1, dp1, da2 = dl[o1:o2], dl[o2:o3], dl[o3:o4]
        _pool_backward(dl[o4:o5].reshape((s4, s4, 64)), q2.reshape((s4, s4, 64)), da2.reshape((s2, s2, 64)), s2, 64,
                       a2.reshape((s2, s2, 64)))
        _conv_backward(p1.reshape((s2, s2, 32)), W2T, da2.reshape((s2, s2, 64)), g2, gb2, dp1.reshape((s2, s2, 32)),
                       s2, 32, 64, cols, pad2, r == 0, True)
        _pool_backward(dp1.reshape((s2, s2, 32)), q1.reshape((s2, s2, 32)), da1.reshape((side, side, 32)), side, 32,
                       a1.reshape((side, side, 32)))
        _conv_backward(a[:o1].reshape((side, side, 1)), W2T, da1.reshape((side, side, 32)), g1, gb1,
                       da1.reshape((side, side, 32)), side, 1, 32, cols, pad1, r == 0, False)
    if step:
        w3_stop = w3_start + n4 * 512
        apply_step(params[:w3_start], grad[:w3_start], lr, terms_slice(terms, 0, w3_start))
        apply_step(params[w3_stop:], grad[w3_stop:], lr, terms_slice(terms, w3_stop, params.shape[0]))
    return loss


@njit(**JIT)
def _loss_correct(params, offsets, side, n_classes, X, y, act, arg, scratch, P2, H, Z):
    """(sum of losses, correct predictions) over all samples: the convolutions sample by sample into P2,
    then the dense layers over P2.shape[0] samples at once, as in training (act/arg: one sample's buffers)."""
    o1, o2, o3, o4, _, _, n2 = _starts(side)
    _, _, _, _, w3, b3, w4, b4 = _views(params, offsets, side, n_classes)
    n, chunk = X.shape[0], P2.shape[0]
    loss = 0.0
    correct = 0
    for i0 in range(0, n, chunk):
        m = min(chunk, n - i0)
        for r in range(m):
            x_ = act[:o1]
            copy_into(x_, X[i0 + r])
            _features_one(params, offsets, side, n_classes, x_, act[o1:o2], act[o2:o3], arg[:n2], act[o3:o4],
                          P2[r], arg[n2:], scratch)
        _dense_forward(P2, H, Z, w3, b3, w4, b4, m)
        for r in range(m):
            sample_loss, best = cross_entropy(Z[r], y[i0 + r])
            loss += sample_loss
            if best == y[i0 + r]:
                correct += 1
    return loss, correct
