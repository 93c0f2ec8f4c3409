"""Softmax cross-entropy of one row of logits, shared by every classifier kernel.

Sums run in float64 from the logits (log-sum-exp), so the loss stays finite when a probability underflows
and float32 models lose nothing in the normalization.
"""

import numpy as np
from numba import njit

from edgefed.kernels import JIT


@njit(inline="always", **JIT)
def softmax_xent(z, label, scale, out):
    """out <- scale * (softmax(z) - onehot(label)); returns -log softmax(z)[label]. `out` may be `z`."""
    n = z.shape[0]
    zmax = np.float64(z[0])
    for c in range(1, n):
        if z[c] > zmax:
            zmax = np.float64(z[c])
    z_label = np.float64(z[label])
    total = 0.0
    for c in range(n):  # one exp per class: out holds exp(z - max) until it is normalized
        e = np.exp(np.float64(z[c]) - zmax)
        out[c] = e
        total += e
    for c in range(n):
        out[c] = out[c] / total * scale
    out[label] -= scale
    return np.log(total) + zmax - z_label


@njit(inline="always", **JIT)
def cross_entropy(z, label):
    """(-log softmax(z)[label], argmax z) without writing anything: evaluation."""
    best = 0
    for c in range(1, z.shape[0]):
        if z[c] > z[best]:
            best = c
    zmax = np.float64(z[best])
    total = 0.0
    for c in range(z.shape[0]):
        total += np.exp(np.float64(z[c]) - zmax)
    return np.log(total) + zmax - np.float64(z[label]), best
