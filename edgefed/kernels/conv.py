"""Convolution and pooling over channels-last maps, one sample at a time, every shape a run-time value.

A map of C channels, H rows and W columns is stored as (H, W, C) flat: the C values of a pixel are
contiguous, so every inner loop runs over contiguous channels. A 1-D map (C, L) is the map (1, L, C).
Convolution weights are (kh, kw, c_in, c_out), so a window unrolled in (ky, kx, c_in) order times the
weights seen as (kh*kw*c_in, c_out) is the convolution (im2col): the blocked products of linalg.py then
run at the speed of a dense layer.

Summation order (as linalg.py: from the initial value, one fma per term): a pixel's outputs from the bias
over its window's taps in (ky, kx, c_in) order, padding zeros included; a weight gradient over the output
pixels in row-major order, one sample after another; an input gradient over the output pixels in
row-major order (col2im), each window row added in place.
"""

from numba import njit

from edgefed.kernels import JIT
from edgefed.kernels.dense import relu_mask
from edgefed.kernels.linalg import (accumulate_outer, accumulate_product, block, copy_into, matrix, transpose_into,
                                    vector)
from edgefed.kernels.program import (F_AUX, F_C, F_CO, F_GRAD_IN, F_H, F_HO, F_HP, F_IN, F_KH, F_KW, F_MODE, F_NIN,
                                     F_NOUT, F_OUT, F_PAD, F_PARAM, F_PL, F_PT, F_SH, F_SW, F_W, F_WO, F_WP, F_WT)

MAX, AVG, MAX_RELU = 0, 1, 2  # pooling kinds; MAX_RELU is ReLU then max pooling, computed as max then ReLU


@njit(inline="always", **JIT)
def _unroll(fmap, H, W, C, padded, HP, WP, pt, pl, kh, kw, sh, sw, HO, WO, cols):
    """cols (HO*WO, kh*kw*C) <- every output pixel's window of fmap (H, W, C).

    With padding, through padded (HP, WP, C), whose border is zero and never written here: a window row is
    then kw*C contiguous values, copied view to view without a bounds test (LLVM vectorizes the copy).
    """
    src = fmap
    if HP != H or WP != W:
        row = W * C
        for y in range(H):
            start = ((y + pt) * WP + pl) * C
            copy_into(padded[start:start + row], fmap[y * row:(y + 1) * row])
        src = padded
    width = kw * C
    depth = kh * width
    for oy in range(HO):
        for ox in range(WO):
            dst = cols[oy * WO + ox]
            for ky in range(kh):
                base = ((oy * sh + ky) * WP + ox * sw) * C
                copy_into(dst[ky * width:(ky + 1) * width], src[base:base + width])
    return depth


@njit(inline="always", **JIT)
def _fold(cols, H, W, C, padded, HP, WP, pt, pl, kh, kw, sh, sw, HO, WO, dinp):
    """col2im, the adjoint of _unroll: dinp (H, W, C) <- the rows of cols summed back onto their windows
    (in pixel order), the part on the padding dropped; padded's border is left zero again."""
    width = kw * C
    pad = HP != H or WP != W
    area = padded if pad else dinp
    area[:] = 0
    for oy in range(HO):
        for ox in range(WO):
            src = cols[oy * WO + ox]
            for ky in range(kh):
                base = ((oy * sh + ky) * WP + ox * sw) * C
                dst = area[base:base + width]
                part = src[ky * width:(ky + 1) * width]
                for t in range(width):
                    dst[t] += part[t]
    if pad:
        row = W * C
        for y in range(H):
            start = ((y + pt) * WP + pl) * C
            copy_into(dinp[y * row:(y + 1) * row], padded[start:start + row])
        padded[:] = 0


@njit(inline="always", **JIT)
def conv_forward(inp, Wt, bias, out, H, W, C, HP, WP, pt, pl, kh, kw, sh, sw, HO, WO, CO, cols_area, padded,
                 relu):
    """out (HO, WO, CO) <- bias + the convolution of inp (H, W, C) with Wt (kh*kw*C, CO); relu: then ReLU."""
    n, depth = HO * WO, kh * kw * C
    cols = matrix(cols_area, 0, n, depth)
    _unroll(inp, H, W, C, padded, HP, WP, pt, pl, kh, kw, sh, sw, HO, WO, cols)
    out2 = matrix(out, 0, n, CO)
    for r in range(n):
        copy_into(out2[r], bias)
    accumulate_product(cols, Wt, out2, n, depth, CO)
    if relu:
        for j in range(n * CO):
            if out[j] < 0:
                out[j] = 0


@njit(inline="always", **JIT)
def conv_backward(inp, WT, dout, gW, gb, dinp, H, W, C, HP, WP, pt, pl, kh, kw, sh, sw, HO, WO, CO, cols_area,
                  padded, first, need_dinp):
    """gW (kh*kw*C, CO), gb += one sample's gradients (first: gW = them); dinp <- the gradient w.r.t. the
    input when need_dinp. WT: the weights packed as (CO, kh*kw*C), once per step.

    With the windows unrolled again: gW += cols^T dout, and d(cols) = dout W^T folded back onto the map.
    """
    n, depth = HO * WO, kh * kw * C
    cols = matrix(cols_area, 0, n, depth)
    _unroll(inp, H, W, C, padded, HP, WP, pt, pl, kh, kw, sh, sw, HO, WO, cols)
    d2 = matrix(dout, 0, n, CO)
    for r in range(n):
        for co in range(CO):
            gb[co] += d2[r, co]
    accumulate_outer(cols, d2, gW, n, depth, CO, first)
    if need_dinp:
        accumulate_product(d2, WT, cols, n, CO, depth, True)  # the windows' gradient, in their place
        _fold(cols, H, W, C, padded, HP, WP, pt, pl, kh, kw, sh, sw, HO, WO, dinp)


@njit(inline="always", **JIT)
def pool_forward(inp, out, arg, H, W, C, kh, kw, sh, sw, HO, WO, kind):
    """out (HO, WO, C) <- max (or mean) over each kh x kw window of inp (H, W, C), no padding, the last
    partial window dropped (PyTorch's floor); arg keeps a max's winner (tap index, first of equals).
    MAX_RELU: ReLU after the max, which equals the max of the ReLUs (both monotone) at a quarter of the
    work. A mean sums its taps in (ky, kx) order in the map's type, then scales once.

    Taps outermost, channels innermost: every pass runs over C contiguous values (vectorized)."""
    inv = 1.0 / (kh * kw)
    for oy in range(HO):
        for ox in range(WO):
            o = (oy * WO + ox) * C
            dst, win = out[o:o + C], arg[o:o + C]
            first = ((oy * sh) * W + ox * sw) * C
            copy_into(dst, inp[first:first + C])
            if kind != AVG:  # a mean keeps no winners (and has no room for them)
                for c in range(C):
                    win[c] = 0
            for ky in range(kh):
                for kx in range(kw):
                    if ky == 0 and kx == 0:
                        continue
                    at = ((oy * sh + ky) * W + ox * sw + kx) * C
                    src = inp[at:at + C]
                    q = ky * kw + kx
                    if kind == AVG:
                        for c in range(C):
                            dst[c] += src[c]
                    else:
                        for c in range(C):
                            if src[c] > dst[c]:
                                dst[c] = src[c]
                                win[c] = q
            if kind == AVG:
                for c in range(C):
                    dst[c] = dst[c] * inv
            elif kind == MAX_RELU:
                for c in range(C):
                    if not dst[c] > 0:
                        dst[c] = 0


@njit(inline="always", **JIT)
def pool_backward(dout, arg, din, inp, H, W, C, kh, kw, sh, sw, HO, WO, kind):
    """din (H, W, C) <- each pooled gradient routed to its winner (max; with MAX_RELU only where the winner
    is positive) or spread evenly over its window (mean). Windows that overlap (stride < size) add up."""
    din[:] = 0
    overlap = sh < kh or sw < kw
    inv = 1.0 / (kh * kw)
    for oy in range(HO):
        for ox in range(WO):
            o = (oy * WO + ox) * C
            for c in range(C):
                d = dout[o + c]
                if kind == AVG:
                    d = d * inv
                    for ky in range(kh):
                        for kx in range(kw):
                            din[((oy * sh + ky) * W + ox * sw + kx) * C + c] += d
                    continue
                q = arg[o + c]
                at = ((oy * sh + q // kw) * W + ox * sw + q % kw) * C + c
                if kind == MAX_RELU and not inp[at] > 0:
                    continue
                if overlap:
                    din[at] += d
                else:
                    din[at] = d


@njit(inline="always", **JIT)
def global_pool_forward(inp, out, P, C):
    """out (C) <- the mean over the P pixels of inp (P, C): a float64 sum in pixel order, one rounding."""
    inv = 1.0 / P
    for c in range(C):
        total = 0.0
        for p in range(P):
            total += inp[p * C + c]
        out[c] = total * inv


@njit(inline="always", **JIT)
def global_pool_backward(dout, din, P, C):
    inv = 1.0 / P
    for p in range(P):
        for c in range(C):
            din[p * C + c] = dout[c] * inv


# -------------------------------------------------------------------------------- the operations of a batch
@njit(**JIT)
def conv_forward_op(op, slope, perms, params, acts, aux, cols, pads, r0, r1, train, rng):
    C, CO = op[F_C], op[F_CO]
    depth = op[F_KH] * op[F_KW] * C
    p = op[F_PARAM]
    Wt = matrix(params, p, depth, CO)
    bias = vector(params, p + depth * CO, CO)
    pad = vector(pads, op[F_PAD], op[F_HP] * op[F_WP] * C if op[F_HP] != op[F_H] or op[F_WP] != op[F_W] else 0)
    X, Z = block(acts, op[F_IN], op[F_NIN]), block(acts, op[F_OUT], op[F_NOUT])
    for r in range(r0, r1):
        conv_forward(X[r], Wt, bias, Z[r], op[F_H], op[F_W], C, op[F_HP], op[F_WP], op[F_PT], op[F_PL], op[F_KH],
                     op[F_KW], op[F_SH], op[F_SW], op[F_HO], op[F_WO], CO, cols, pad, op[F_MODE] == 1)


@njit(**JIT)
def conv_backward_op(op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1, step, lr,
                     terms):
    """Samples r0..r1-1 of the weights' gradient (samples in order, sample 0 written fresh), and their input
    deltas when a layer before has parameters; a fused ReLU's derivative first."""
    C, CO = op[F_C], op[F_CO]
    depth = op[F_KH] * op[F_KW] * C
    p = op[F_PARAM]
    need = op[F_GRAD_IN] == 1
    if op[F_MODE] == 1:
        relu_mask(acts, deltas, op[F_OUT], r0, r1, op[F_NOUT])
    WT = matrix(wt, op[F_WT], CO, depth)
    gW = matrix(grad, p, depth, CO)
    gb = vector(grad, p + depth * CO, CO)
    if r0 == 0:  # the step's first sample: W^T packed once per step, the bias's gradient from zero
        if need:
            transpose_into(matrix(params, p, depth, CO), WT, depth, CO)
        for j in range(CO):
            gb[j] = 0
    pad = vector(pads, op[F_PAD], op[F_HP] * op[F_WP] * C if op[F_HP] != op[F_H] or op[F_WP] != op[F_W] else 0)
    X, DX = block(acts, op[F_IN], op[F_NIN]), block(deltas, op[F_IN], op[F_NIN])
    DZ = block(deltas, op[F_OUT], op[F_NOUT])
    for r in range(r0, r1):
        conv_backward(X[r], WT, DZ[r], gW, gb, DX[r], op[F_H], op[F_W], C, op[F_HP], op[F_WP], op[F_PT], op[F_PL],
                      op[F_KH], op[F_KW], op[F_SH], op[F_SW], op[F_HO], op[F_WO], CO, cols, pad, r == 0, need)


@njit(**JIT)
def pool_forward_op(op, slope, perms, params, acts, aux, cols, pads, r0, r1, train, rng):
    X, Z, A = block(acts, op[F_IN], op[F_NIN]), block(acts, op[F_OUT], op[F_NOUT]), block(aux, op[F_AUX], op[F_NOUT])
    for r in range(r0, r1):
        pool_forward(X[r], Z[r], A[r], op[F_H], op[F_W], op[F_C], op[F_KH], op[F_KW], op[F_SH], op[F_SW], op[F_HO],
                     op[F_WO], op[F_MODE])


@njit(**JIT)
def pool_backward_op(op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1, step, lr,
                     terms):
    X, DX = block(acts, op[F_IN], op[F_NIN]), block(deltas, op[F_IN], op[F_NIN])
    DZ, A = block(deltas, op[F_OUT], op[F_NOUT]), block(aux, op[F_AUX], op[F_NOUT])
    for r in range(r0, r1):
        pool_backward(DZ[r], A[r], DX[r], X[r], op[F_H], op[F_W], op[F_C], op[F_KH], op[F_KW], op[F_SH], op[F_SW],
                      op[F_HO], op[F_WO], op[F_MODE])


@njit(**JIT)
def global_pool_forward_op(op, slope, perms, params, acts, aux, cols, pads, r0, r1, train, rng):
    X, Z = block(acts, op[F_IN], op[F_NIN]), block(acts, op[F_OUT], op[F_NOUT])
    for r in range(r0, r1):
        global_pool_forward(X[r], Z[r], op[F_H] * op[F_W], op[F_C])


@njit(**JIT)
def global_pool_backward_op(op, slope, perms, params, grad, acts, deltas, aux, tr, cols, wt, gt, gblock, pads, r0, r1,
                            step, lr, terms):
    DX, DZ = block(deltas, op[F_IN], op[F_NIN]), block(deltas, op[F_OUT], op[F_NOUT])
    for r in range(r0, r1):
        global_pool_backward(DZ[r], DX[r], op[F_H] * op[F_W], op[F_C])
