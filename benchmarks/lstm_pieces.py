"""Where a character-LSTM layer's step goes: each piece of one LSTM layer's forward and backward pass (256
inputs, 256 units, batch 10, 80 steps), timed alone in a loop around the kernels' own functions (linalg's
packed products, exponential.py's nonlinearities, the gate loops as kernels/sequence.py writes them), one
thread, medians of 7. Synthetic values; the pieces' costs do not depend on them.

    python benchmarks/lstm_pieces.py
"""

import os
import time

os.environ["NUMBA_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from edgefed.kernels import JIT  # noqa: E402
from edgefed.kernels.dense import bias_gradient  # noqa: E402
from edgefed.kernels.exponential import sigmoid64, tanh64  # noqa: E402
from edgefed.kernels.fma import fma  # noqa: E402
from edgefed.kernels.linalg import (accumulate_product, matrix, pack_columns, packed_outer, packed_product,  # noqa: E402
                                    packed_values, transpose_into, vector)

L, b, H, F = 80, 10, 256, 256
GW, n = 4*H, L*b
g = np.random.default_rng(0)
acts = (g.standard_normal(20_000_000)*0.1).astype(np.float32)
deltas = (g.standard_normal(10_000_000)*0.1).astype(np.float32)
params = (g.standard_normal(F*GW + H*GW + 2*GW)*0.05).astype(np.float32)
grad = np.zeros_like(params)
cols = np.zeros(packed_values(GW, H, 4)*2, np.float32)
wt = np.zeros(GW*max(F,H), np.float32)
X0, S0 = 0, n*F
C0 = S0 + (L+1)*b*H
G0 = C0 + (L+1)*b*H
dA0, dX0 = 0, n*H
dh0 = 2*n*max(F,H); dc0 = dh0 + b*H; pd0 = dh0 + 2*b*H

@njit(**JIT)
def fwd_bias_init(params, acts):
    G = matrix(acts, G0, n, GW); bih = vector(params, F*GW+H*GW, GW); bhh = vector(params, F*GW+H*GW+GW, GW)
    for q in range(n):
        gg = G[q]
        for j in range(GW): gg[j] = bih[j] + bhh[j]
@njit(**JIT)
def fwd_input(params, acts, cols):
    pack_columns(matrix(params, 0, F, GW), F, GW, cols)
    packed_product(matrix(acts, X0, n, F), cols, matrix(acts, G0, n, GW), n, F, GW, False)
@njit(**JIT)
def fwd_rec(params, acts, cols):
    pack_columns(matrix(params, F*GW, H, GW), H, GW, cols)
    for s in range(1, L):
        packed_product(matrix(acts, S0 + s*b*H, b, H), cols, matrix(acts, G0 + s*b*GW, b, GW), b, H, GW, False)
@njit(**JIT)
def fwd_gates(acts):
    for s in range(L):
        for r in range(b):
            q = G0 + (s * b + r) * GW
            gif, gg, go = vector(acts, q, 2 * H), vector(acts, q + 2 * H, H), vector(acts, q + 3 * H, H)
            for j in range(2 * H): gif[j] = sigmoid64(np.float64(gif[j]))
            for j in range(H): gg[j] = tanh64(np.float64(gg[j]))
            for j in range(H): go[j] = sigmoid64(np.float64(go[j]))
            gi, gf = vector(acts, q, H), vector(acts, q + H, H)
            cp, cn = vector(acts, C0 + (s * b + r) * H, H), vector(acts, C0 + ((s + 1) * b + r) * H, H)
            for j in range(H): cn[j] = fma(np.float64(gf[j]), np.float64(cp[j]), np.float64(gi[j]) * np.float64(gg[j]))
            hn = vector(acts, S0 + ((s + 1) * b + r) * H, H)
            for j in range(H): hn[j] = np.float64(go[j]) * tanh64(np.float64(cn[j]))
@njit(**JIT)
def bwd_prep(params, wt, cols):
    Whh = matrix(params, F*GW, H, GW); WhhT = matrix(wt, 0, GW, H)
    transpose_into(Whh, WhhT, H, GW); pack_columns(WhhT, GW, H, cols)
@njit(**JIT)
def bwd_gates(acts, deltas):
    dh, dc = matrix(deltas, dh0, b, H), matrix(deltas, dc0, b, H)
    tcs = vector(deltas, pd0, H)
    for s in range(L - 1, -1, -1):
        for r in range(b):
            gq = vector(acts, G0 + (s * b + r) * GW, GW)
            cp, cn = vector(acts, C0 + (s * b + r) * H, H), vector(acts, C0 + ((s + 1) * b + r) * H, H)
            above, carry, cell = vector(deltas, dA0 + (s * b + r) * H, H), dh[r], dc[r]
            for j in range(H): tcs[j] = tanh64(np.float64(cn[j]))
            for j in range(H):
                i, f, c, o = np.float64(gq[j]), np.float64(gq[H + j]), np.float64(gq[2 * H + j]), np.float64(gq[3 * H + j])
                tc = np.float64(tcs[j]); d = np.float64(above[j]) + np.float64(carry[j])
                dcell = np.float64(cell[j]) + d * o * (1.0 - tc * tc)
                gq[j] = dcell * c * i * (1.0 - i); gq[H + j] = dcell * np.float64(cp[j]) * f * (1.0 - f)
                gq[2 * H + j] = dcell * i * (1.0 - c * c); gq[3 * H + j] = d * tc * o * (1.0 - o)
                cell[j] = dcell * f
@njit(**JIT)
def bwd_rec(acts, deltas, cols):
    dh = matrix(deltas, dh0, b, H)
    for s in range(L - 1, 0, -1):
        packed_product(matrix(acts, G0 + s * b * GW, b, GW), cols, dh, b, GW, H, True)
@njit(**JIT)
def bwd_bias(acts, grad):
    bias_gradient(matrix(acts, G0, n, GW), vector(grad, F*GW+H*GW, GW), n, GW)
@njit(**JIT)
def bwd_wgrad(acts, deltas, grad):
    P = vector(deltas, pd0, n * GW)
    D = matrix(acts, G0, n, GW)
    pack_columns(D, n, GW, P)
    packed_outer(matrix(acts, X0, n, F), P, matrix(grad, 0, F, GW), n, F, GW, True)
    packed_outer(matrix(acts, S0, n, H), P, matrix(grad, F*GW, H, GW), n, H, GW, True)
@njit(**JIT)
def bwd_pack_only(acts, deltas):
    P = vector(deltas, pd0, n * GW); pack_columns(matrix(acts, G0, n, GW), n, GW, P)
@njit(**JIT)
def bwd_dx(params, acts, deltas, wt):
    WT = matrix(wt, 0, GW, F); transpose_into(matrix(params, 0, F, GW), WT, F, GW)
    accumulate_product(matrix(acts, G0, n, GW), WT, matrix(deltas, dX0, n, F), n, GW, F, True)

fns = {"fwd bias init": lambda: fwd_bias_init(params, acts), "fwd input product": lambda: fwd_input(params, acts, cols),
       "fwd recurrent products": lambda: fwd_rec(params, acts, cols), "fwd gate loops": lambda: fwd_gates(acts),
       "bwd transpose+pack Whh": lambda: bwd_prep(params, wt, cols), "bwd gate loops": lambda: bwd_gates(acts, deltas),
       "bwd recurrent products": lambda: bwd_rec(acts, deltas, cols), "bwd bias grad": lambda: bwd_bias(acts, grad),
       "bwd pack D": lambda: bwd_pack_only(acts, deltas),
       "bwd weight grads (pack+2 outer)": lambda: bwd_wgrad(acts, deltas, grad), "bwd dx product": lambda: bwd_dx(params, acts, deltas, wt)}
acts0 = acts.copy()
for f in fns.values(): f()
res = {k: [] for k in fns}
for rep in range(7):
    for k, f in fns.items():
        acts[:] = acts0  # (values stay finite)
        t = time.perf_counter(); f(); res[k].append(time.perf_counter() - t)
tot = 0
for k, v in res.items():
    m = np.median(v)*1e3; tot += m
    print(f"{k:34s} {m:7.3f} ms")
print("sum (one layer, input F=256)", round(tot, 2))
