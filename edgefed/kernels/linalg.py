"""Small dense products the model kernels share, written so LLVM vectorizes them without fastmath.

Every sum runs in a fixed order, so a product gives the same bits on every run and every rank.
"""

from numba import njit

from edgefed.kernels import JIT


@njit(**JIT)
def accumulate_product(A, W, Z, b, din, dout):
    """Z += A W in tiles of four rows of A by four rows of W.

    Each loaded element of W feeds four rows of Z, and each store of Z carries four products, so the loop is
    neither load- nor store-bound: measured 28-40 GFLOP/s against 18-27 for one row of W at a time.
    """
    r0 = 0
    while r0 + 4 <= b:
        z0, z1, z2, z3 = Z[r0], Z[r0 + 1], Z[r0 + 2], Z[r0 + 3]
        k = 0
        while k + 4 <= din:
            w0, w1, w2, w3 = W[k], W[k + 1], W[k + 2], W[k + 3]
            a00, a01, a02, a03 = A[r0, k], A[r0, k + 1], A[r0, k + 2], A[r0, k + 3]
            a10, a11, a12, a13 = A[r0 + 1, k], A[r0 + 1, k + 1], A[r0 + 1, k + 2], A[r0 + 1, k + 3]
            a20, a21, a22, a23 = A[r0 + 2, k], A[r0 + 2, k + 1], A[r0 + 2, k + 2], A[r0 + 2, k + 3]
            a30, a31, a32, a33 = A[r0 + 3, k], A[r0 + 3, k + 1], A[r0 + 3, k + 2], A[r0 + 3, k + 3]
            for j in range(dout):
                x0, x1, x2, x3 = w0[j], w1[j], w2[j], w3[j]
                z0[j] += (a00 * x0 + a01 * x1) + (a02 * x2 + a03 * x3)
                z1[j] += (a10 * x0 + a11 * x1) + (a12 * x2 + a13 * x3)
                z2[j] += (a20 * x0 + a21 * x1) + (a22 * x2 + a23 * x3)
                z3[j] += (a30 * x0 + a31 * x1) + (a32 * x2 + a33 * x3)
            k += 4
        for kk in range(k, din):
            w = W[kk]
            a0, a1, a2, a3 = A[r0, kk], A[r0 + 1, kk], A[r0 + 2, kk], A[r0 + 3, kk]
            for j in range(dout):
                x = w[j]
                z0[j] += a0 * x
                z1[j] += a1 * x
                z2[j] += a2 * x
                z3[j] += a3 * x
        r0 += 4
    if r0 + 2 <= b:  # two leftover rows as a half tile (b = 10: measured +10-20 % on the 2NN's first layer)
        z0, z1 = Z[r0], Z[r0 + 1]
        k = 0
        while k + 4 <= din:
            w0, w1, w2, w3 = W[k], W[k + 1], W[k + 2], W[k + 3]
            a00, a01, a02, a03 = A[r0, k], A[r0, k + 1], A[r0, k + 2], A[r0, k + 3]
            a10, a11, a12, a13 = A[r0 + 1, k], A[r0 + 1, k + 1], A[r0 + 1, k + 2], A[r0 + 1, k + 3]
            for j in range(dout):
                x0, x1, x2, x3 = w0[j], w1[j], w2[j], w3[j]
                z0[j] += (a00 * x0 + a01 * x1) + (a02 * x2 + a03 * x3)
                z1[j] += (a10 * x0 + a11 * x1) + (a12 * x2 + a13 * x3)
            k += 4
        for kk in range(k, din):
            w = W[kk]
            a0, a1 = A[r0, kk], A[r0 + 1, kk]
            for j in range(dout):
                x = w[j]
                z0[j] += a0 * x
                z1[j] += a1 * x
        r0 += 2
    for r in range(r0, b):  # the last row alone, still four rows of W per store
        z = Z[r]
        k = 0
        while k + 4 <= din:
            w0, w1, w2, w3 = W[k], W[k + 1], W[k + 2], W[k + 3]
            a0, a1, a2, a3 = A[r, k], A[r, k + 1], A[r, k + 2], A[r, k + 3]
            if a0 != 0 or a1 != 0 or a2 != 0 or a3 != 0:
                for j in range(dout):
                    z[j] += (a0 * w0[j] + a1 * w1[j]) + (a2 * w2[j] + a3 * w3[j])
            k += 4
        for kk in range(k, din):
            a = A[r, kk]
            w = W[kk]
            for j in range(dout):
                z[j] += a * w[j]


@njit(**JIT)
def accumulate_outer(A, D, G, b, din, dout):
    """G += A^T D in tiles of four rows of G by four rows of D, the transpose of accumulate_product's tiling.

    Each loaded element of D feeds four rows of G and each store of G carries four products: measured 30-40
    against 18-28 GFLOP/s for eight rows of D into one row of G at a time (the 2NN's weight gradients, b 10
    and 64), whose every row of G was loaded and stored b/8 times.
    """
    k = 0
    while k + 4 <= din:
        g0, g1, g2, g3 = G[k], G[k + 1], G[k + 2], G[k + 3]
        r = 0
        while r + 4 <= b:
            d0, d1, d2, d3 = D[r], D[r + 1], D[r + 2], D[r + 3]
            a00, a01, a02, a03 = A[r, k], A[r + 1, k], A[r + 2, k], A[r + 3, k]
            a10, a11, a12, a13 = A[r, k + 1], A[r + 1, k + 1], A[r + 2, k + 1], A[r + 3, k + 1]
            a20, a21, a22, a23 = A[r, k + 2], A[r + 1, k + 2], A[r + 2, k + 2], A[r + 3, k + 2]
            a30, a31, a32, a33 = A[r, k + 3], A[r + 1, k + 3], A[r + 2, k + 3], A[r + 3, k + 3]
            for j in range(dout):
                x0, x1, x2, x3 = d0[j], d1[j], d2[j], d3[j]
                g0[j] += (a00 * x0 + a01 * x1) + (a02 * x2 + a03 * x3)
                g1[j] += (a10 * x0 + a11 * x1) + (a12 * x2 + a13 * x3)
                g2[j] += (a20 * x0 + a21 * x1) + (a22 * x2 + a23 * x3)
                g3[j] += (a30 * x0 + a31 * x1) + (a32 * x2 + a33 * x3)
            r += 4
        for rr in range(r, b):
            d = D[rr]
            a0, a1, a2, a3 = A[rr, k], A[rr, k + 1], A[rr, k + 2], A[rr, k + 3]
            if a0 != 0 or a1 != 0 or a2 != 0 or a3 != 0:
                for j in range(dout):
                    x = d[j]
                    g0[j] += a0 * x
                    g1[j] += a1 * x
                    g2[j] += a2 * x
                    g3[j] += a3 * x
        k += 4
    for kk in range(k, din):
        g = G[kk]
        for rr in range(b):
            a = A[rr, kk]
            if a != 0:
                d = D[rr]
                for j in range(dout):
                    g[j] += a * d[j]


@njit(**JIT)
def dot8(u, v):
    """u . v with eight interleaved partial sums in a fixed order: SIMD-friendly without fastmath, and the
    same bits on every machine."""
    n = u.shape[0]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = u[0] * 0
    m = n - n % 8
    for j in range(0, m, 8):
        s0 += u[j] * v[j]
        s1 += u[j + 1] * v[j + 1]
        s2 += u[j + 2] * v[j + 2]
        s3 += u[j + 3] * v[j + 3]
        s4 += u[j + 4] * v[j + 4]
        s5 += u[j + 5] * v[j + 5]
        s6 += u[j + 6] * v[j + 6]
        s7 += u[j + 7] * v[j + 7]
    for j in range(m, n):
        s0 += u[j] * v[j]
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
