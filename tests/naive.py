"""Slow, obviously-correct references the fast code is checked against (no Numba, no edgefed math)."""

import numpy as np

M64 = (1 << 64) - 1


class Xoshiro:
    """xoshiro256** in pure Python integers, from its published definition."""

    def __init__(self, state):
        self.s = [int(v) for v in state]

    @staticmethod
    def _rotl(x, k):
        return ((x << k) | (x >> (64 - k))) & M64

    def next(self):
        s = self.s
        result = (self._rotl((s[1] * 5) & M64, 7) * 9) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = self._rotl(s[3], 45)
        return result

    def bounded(self, m):
        while True:
            prod = (self.next() >> 32) * m
            if (prod & 0xFFFFFFFF) >= ((1 << 32) - m) % m:
                return prod >> 32

    def batch(self, perm, b):
        n = len(perm)
        for i in range(b):
            j = i + self.bounded(n - i)
            perm[i], perm[j] = perm[j], perm[i]
        return perm[:b]


def softmax_ce(W, b, X, y):
    """Mean loss and gradients (dW, db) of softmax cross-entropy, straight from the formulas."""
    z = X @ W + b
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    loss = -np.mean(np.log(p[np.arange(len(y)), y]))
    p[np.arange(len(y)), y] -= 1
    return loss, X.T @ p / len(y), p.mean(axis=0)


def logreg_sgd(params, X, y, n_classes, n_steps, batch, lr, rng_state, correction=None, mu=0.0, anchor=None):
    """Minibatch SGD on flat params (W row-major, then b) with the same minibatch draws as the kernel; each
    step adds `correction` and FedProx's mu (params - anchor) to the gradient where given."""
    f = X.shape[1]
    params = params.astype(np.float64).copy()
    rng = Xoshiro(rng_state)
    perm = list(range(X.shape[0]))
    b = min(batch, X.shape[0])
    for _ in range(n_steps):
        idx = rng.batch(perm, b) if b < X.shape[0] else perm
        W = params[: f * n_classes].reshape(f, n_classes)
        _, gW, gb = softmax_ce(W, params[f * n_classes:], X[idx], y[idx])
        g = np.concatenate([gW.ravel(), gb])
        params -= lr * (g + (0 if correction is None else correction) + (0 if anchor is None else mu * (params - anchor)))
    return params


def fedavg_quadratic(A, b, x0, rounds, K, S, lr_l, lr_g, weighting, n, selections):
    """docs/design.md section 2 (FedAvg) on f_k = 1/2 sum A_k (x - b_k)^2 with exact gradients, in float64.

    `selections[r]` is the selected set of round r+1 (taken from the run, since sampling is tested apart).
    """
    x = x0.astype(np.float64).copy()
    traj = [x.copy()]
    for r in range(rounds):
        sel = sorted(selections[r])
        total = np.zeros_like(x)
        for k in sel:
            y = x.copy()
            for _ in range(K):
                y = y - lr_l * (A[k] * (y - b[k]))
            if weighting == "uniform":
                w = 1.0 / len(sel)
            elif weighting == "count_global":
                w = n[k] / n.sum()
            else:
                w = n[k] / sum(n[j] for j in sel)
            total = total + w * (y - x)
        x = x + lr_g * total
        traj.append(x.copy())
    return np.array(traj)


def scaffold_quadratic(A, b, x0, rounds, K, lr_l, lr_g, option, selections, c_clients0):
    """Seed 002 verbatim on f_k = 1/2 sum A_k (x - b_k)^2 with exact gradients, in float64.

    Returns the trajectories of x, c and the client controls. `selections[r]` is round r+1's sample.
    """
    N = A.shape[0]
    grad = lambda k, v: A[k] * (v - b[k])
    x = x0.astype(np.float64).copy()
    ck = np.array(c_clients0, dtype=np.float64)
    c = ck.mean(axis=0)
    xs, cs, cks = [x.copy()], [c.copy()], [ck.copy()]
    for r in range(rounds):
        sel = sorted(selections[r])
        S = len(sel)
        dxs, dcs, new_ck = [], [], ck.copy()
        for i in sel:
            y = x.copy()
            for _ in range(K):
                y = y - lr_l * (grad(i, y) - ck[i] + c)
            cplus = grad(i, x) if option == "I" else ck[i] - c + (x - y) / (K * lr_l)
            dxs.append(y - x)
            dcs.append(cplus - ck[i])
            new_ck[i] = cplus
        x = x + lr_g * (sum(dxs) / S)
        c = c + (S / N) * (sum(dcs) / S)
        ck = new_ck
        xs.append(x.copy())
        cs.append(c.copy())
        cks.append(ck.copy())
    return np.array(xs), np.array(cs), np.array(cks)
