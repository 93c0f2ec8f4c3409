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

    def uniform(self):
        """A float in [0, 1) from the top 53 bits."""
        return (self.next() >> 11) * (1.0 / 9007199254740992.0)

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


# ------------------------------------------------------------------------------ layers, in PyTorch's semantics
# Channels-first samples, weights in PyTorch's shapes ((out, in) dense, (out, in, k, k) conv2d, (out, in, k)
# conv1d, (4H or 3H, in) LSTM / GRU with nn.LSTM's names), one function per layer type for the forward pass and
# one for the backward pass, plain loops and einsum: the reference edgefed's layer library (channels-last inside,
# its own summation order) is held to.

def _pads(padding, k, stride):
    if padding == "same":
        return (k - 1) // 2, k - 1 - (k - 1) // 2
    p = 0 if padding == "valid" else padding
    return p, p


def conv_forward(x, w, b, stride, pads_h, pads_w):
    """x (N, C, H, W), w (O, C, kh, kw): cross-correlation, zero padding (top, bottom), (left, right)."""
    xp = np.pad(x, ((0, 0), (0, 0), pads_h, pads_w))
    kh, kw = w.shape[2:]
    sh, sw = stride
    ho, wo = (xp.shape[2] - kh) // sh + 1, (xp.shape[3] - kw) // sw + 1
    out = np.zeros((x.shape[0], w.shape[0], ho, wo)) + b[None, :, None, None]
    for ky in range(kh):
        for kx in range(kw):
            patch = xp[:, :, ky:ky + sh * (ho - 1) + 1:sh, kx:kx + sw * (wo - 1) + 1:sw]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, ky, kx])
    return out


def conv_backward(x, w, stride, pads_h, pads_w, dout):
    """(dx, dw, db) of conv_forward."""
    xp = np.pad(x, ((0, 0), (0, 0), pads_h, pads_w))
    dxp = np.zeros_like(xp)
    kh, kw = w.shape[2:]
    sh, sw = stride
    ho, wo = dout.shape[2:]
    dw = np.zeros_like(w)
    for ky in range(kh):
        for kx in range(kw):
            window = (slice(None), slice(None), slice(ky, ky + sh * (ho - 1) + 1, sh), slice(kx, kx + sw * (wo - 1) + 1, sw))
            dw[:, :, ky, kx] = np.einsum("nohw,nchw->oc", dout, xp[window])
            dxp[window] += np.einsum("nohw,oc->nchw", dout, w[:, :, ky, kx])
    dx = dxp[:, :, pads_h[0]:dxp.shape[2] - pads_h[1], pads_w[0]:dxp.shape[3] - pads_w[1]]
    return dx, dw, dout.sum(axis=(0, 2, 3))


def pool_forward(x, size, stride, kind):
    """Max or mean over (size) windows of x (N, C, H, W) at (stride), floor; the max's first winner index."""
    kh, kw = size
    sh, sw = stride
    ho, wo = (x.shape[2] - kh) // sh + 1, (x.shape[3] - kw) // sw + 1
    taps = np.stack([x[:, :, ky:ky + sh * (ho - 1) + 1:sh, kx:kx + sw * (wo - 1) + 1:sw]
                     for ky in range(kh) for kx in range(kw)])
    if kind == "avg":
        return taps.mean(axis=0), None
    return taps.max(axis=0), taps.argmax(axis=0)


def pool_backward(x, size, stride, kind, winner, dout):
    kh, kw = size
    sh, sw = stride
    ho, wo = dout.shape[2:]
    dx = np.zeros_like(x)
    for ky in range(kh):
        for kx in range(kw):
            q = ky * kw + kx
            part = dout / (kh * kw) if kind == "avg" else dout * (winner == q)
            dx[:, :, ky:ky + sh * (ho - 1) + 1:sh, kx:kx + sw * (wo - 1) + 1:sw] += part
    return dx


def groupnorm_forward(x, gamma, beta, groups, eps=1e-5):
    n, c = x.shape[:2]
    g = x.reshape(n, groups, -1)
    mean, var = g.mean(axis=2, keepdims=True), g.var(axis=2, keepdims=True)
    xh = ((g - mean) / np.sqrt(var + eps)).reshape(x.shape)
    shape = (1, c) + (1,) * (x.ndim - 2)
    return xh * gamma.reshape(shape) + beta.reshape(shape), (xh, var)


def groupnorm_backward(x, gamma, groups, cache, dout, eps=1e-5):
    xh, var = cache
    n, c = x.shape[:2]
    shape = (1, c) + (1,) * (x.ndim - 2)
    axes = (0,) + tuple(range(2, x.ndim))
    dgamma, dbeta = (dout * xh).sum(axis=axes), dout.sum(axis=axes)
    dxh = (dout * gamma.reshape(shape)).reshape(n, groups, -1)
    xhg = xh.reshape(n, groups, -1)
    dx = (dxh - dxh.mean(axis=2, keepdims=True) - xhg * (dxh * xhg).mean(axis=2, keepdims=True)) / np.sqrt(var + eps)
    return dx.reshape(x.shape), dgamma, dbeta


def _sigmoid(v):
    return 1 / (1 + np.exp(-v))


def lstm_step(x, h, c, w_ih, w_hh, b_ih, b_hh):
    """One nn.LSTM cell step on x (N, F), h and c (N, H): (h', c', cache), gates i, f, g, o in the 4H rows."""
    i, f, g, o = np.split(x @ w_ih.T + b_ih + h @ w_hh.T + b_hh, 4, axis=1)
    i, f, g, o = _sigmoid(i), _sigmoid(f), np.tanh(g), _sigmoid(o)
    c2 = f * c + i * g
    return o * np.tanh(c2), c2, (x, h, c, i, f, g, o, c2)


def lstm_step_backward(cache, dh, dc):
    """From the gradients of h' and c': those of the step's input-side (x W_ih^T + b_ih) and hidden-side
    (h W_hh^T + b_hh) pre-activations (the same for an LSTM), h's gradient other than through W_hh (none), c's."""
    _, _, c, i, f, g, o, c2 = cache
    tc = np.tanh(c2)
    dc = dc + dh * o * (1 - tc ** 2)
    da = np.concatenate([dc * g * i * (1 - i), dc * c * f * (1 - f), dc * i * (1 - g ** 2), dh * tc * o * (1 - o)], axis=1)
    return da, da, 0, dc * f


def gru_step(x, h, c, w_ih, w_hh, b_ih, b_hh):
    """One nn.GRU cell step (gates r, z, n in the 3H rows); c is carried through unused so both cells look alike."""
    H = h.shape[1]
    gi, gh = x @ w_ih.T + b_ih, h @ w_hh.T + b_hh
    r = _sigmoid(gi[:, :H] + gh[:, :H])
    z = _sigmoid(gi[:, H:2 * H] + gh[:, H:2 * H])
    n = np.tanh(gi[:, 2 * H:] + r * gh[:, 2 * H:])
    return (1 - z) * n + z * h, c, (x, h, r, z, n, gh[:, 2 * H:])


def gru_step_backward(cache, dh, dc):
    """As lstm_step_backward; here the two sides differ (r gates W_hn h + b_hn) and h also feeds h' directly."""
    _, h, r, z, n, ghn = cache
    dan = dh * (1 - z) * (1 - n ** 2)
    dar = dan * ghn * r * (1 - r)
    daz = dh * (h - n) * z * (1 - z)
    return np.concatenate([dar, daz, dan], axis=1), np.concatenate([dar, daz, dan * r], axis=1), dh * z, dc


def _recurrent_weights(params, i, k):
    return [params[f"{i}.{name}_l{k}"] for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]


def recurrent_forward(kind, layer, params, i, x):
    """The top layer's h at every step (N, L, H) of nn.LSTM / nn.GRU (batch_first, zero initial h and c, the
    layers stacked: each one's h sequence is the next one's input) on x (N, L, F), and the tape."""
    step = lstm_step if kind == "lstm" else gru_step
    n, steps, hidden = x.shape[0], x.shape[1], layer["hidden"]
    seq, tape = x, []
    for k in range(layer.get("layers", 1)):
        h = c = np.zeros((n, hidden))
        hs, caches = [], []
        for t in range(steps):
            h, c, cache = step(seq[:, t], h, c, *_recurrent_weights(params, i, k))
            hs.append(h)
            caches.append(cache)
        tape.append(caches)
        seq = np.stack(hs, axis=1)
    return seq, tape


def recurrent_backward(kind, layer, params, i, tape, dseq, grads):
    """Backpropagation through time: fills grads with the four tensors of every layer, returns x's gradient."""
    step_backward = lstm_step_backward if kind == "lstm" else gru_step_backward
    for k in range(len(tape) - 1, -1, -1):
        w_ih, w_hh, _, _ = _recurrent_weights(params, i, k)
        gw_ih, gw_hh, gb_ih, gb_hh = (np.zeros_like(w) for w in _recurrent_weights(params, i, k))
        dx = np.zeros((dseq.shape[0], dseq.shape[1], w_ih.shape[1]))
        dh = dc = np.zeros((dseq.shape[0], w_hh.shape[1]))
        for t in range(dseq.shape[1] - 1, -1, -1):
            x, h = tape[k][t][:2]
            dgi, dgh, dh_direct, dc = step_backward(tape[k][t], dh + dseq[:, t], dc)
            gw_ih += dgi.T @ x
            gw_hh += dgh.T @ h
            gb_ih += dgi.sum(axis=0)
            gb_hh += dgh.sum(axis=0)
            dx[:, t] = dgi @ w_ih
            dh = dh_direct + dgh @ w_hh
        for name, g in zip(("weight_ih", "weight_hh", "bias_ih", "bias_hh"), (gw_ih, gw_hh, gb_ih, gb_hh)):
            grads[f"{i}.{name}_l{k}"] = g
        dseq = dx
    return dseq


def network_forward(layers, params, x, masks=None):
    """Outputs of the layer list on x (N, *sample shape as the first layer takes it); params: the
    state_dict ("<i>.weight", "<i>.bias"; "<i>.weight_ih_l<k>", ... for LSTM / GRU); masks[i]: layer i's dropout
    keep-mask (None: evaluation). An embedding takes (N, L) ids, a recurrent layer (N, L, F) and outputs the top
    layer's h at the last step (N, H) or at every step (N, L, H). Returns (outputs, tape) for network_backward."""
    tape = []
    h = x
    for i, layer in enumerate(layers):
        kind = layer["type"]
        w, b = params.get(f"{i}.weight"), params.get(f"{i}.bias")
        inp = h
        extra = None
        if kind == "dense":
            h = h @ w.T + b
        elif kind == "embedding":
            # ids may come as floats holding integers (one input array for the whole batch)
            extra = np.asarray(h).astype(np.int64)
            h = w[extra]
        elif kind in ("lstm", "gru"):
            seq, extra = recurrent_forward(kind, layer, params, i, h)
            h = seq[:, -1] if layer.get("output", "last") == "last" else seq
        elif kind in ("conv2d", "conv1d"):
            one_d = kind == "conv1d"
            k, s = layer["kernel"], layer.get("stride", 1)
            xh = h[:, :, None, :] if one_d else h
            wh = w[:, :, None, :] if one_d else w
            pads = _pads(layer.get("padding", "same"), k, s)
            extra = (xh, wh, (1, s) if one_d else (s, s), (0, 0) if one_d else pads, pads)
            out = conv_forward(xh, wh, b, extra[2], extra[3], extra[4])
            h = out[:, :, 0, :] if one_d else out
        elif kind.endswith(("pool2d", "pool1d")):
            one_d = kind.endswith("1d")
            size, stride = layer["size"], layer.get("stride", layer["size"])
            xh = h[:, :, None, :] if one_d else h
            dims = ((1, size), (1, stride)) if one_d else ((size, size), (stride, stride))
            out, winner = pool_forward(xh, *dims, kind[:3])
            extra = (xh, dims, winner)
            h = out[:, :, 0, :] if one_d else out
        elif kind == "global_avgpool":
            h = h.reshape(h.shape[0], h.shape[1], -1).mean(axis=2)
        elif kind == "flatten":
            h = h.reshape(h.shape[0], -1)
        elif kind == "reshape":
            h = h.reshape(h.shape[0], *layer["shape"])
        elif kind == "relu":
            h = np.maximum(h, 0)
        elif kind == "leaky_relu":
            h = np.where(h >= 0, h, h * layer.get("slope", 0.01))
        elif kind == "tanh":
            h = np.tanh(h)
        elif kind == "sigmoid":
            h = 1 / (1 + np.exp(-h))
        elif kind == "dropout":
            if masks is not None:
                h = h * masks[i] / (1 - layer.get("rate", 0.5))
        elif kind == "groupnorm":
            h, extra = groupnorm_forward(h, w, b, layer["groups"])
        else:
            raise ValueError(kind)
        tape.append((inp, h, extra))
    return h, tape


def network_backward(layers, params, tape, dout, masks=None):
    """The state_dict's gradients from the outputs' gradient dout."""
    grads = {}
    d = dout
    for i in range(len(layers) - 1, -1, -1):
        layer, (inp, out, extra) = layers[i], tape[i]
        kind = layer["type"]
        w = params.get(f"{i}.weight")
        if kind == "dense":
            grads[f"{i}.weight"], grads[f"{i}.bias"] = d.T @ inp, d.sum(axis=0)
            d = d @ w
        elif kind == "embedding":
            grads[f"{i}.weight"] = np.zeros_like(w)
            np.add.at(grads[f"{i}.weight"], extra, d)  # repeated ids add up
            if layer.get("padding_idx") is not None:
                grads[f"{i}.weight"][layer["padding_idx"]] = 0  # nn.Embedding never updates the padding row
            d = None  # ids have no gradient
        elif kind in ("lstm", "gru"):
            if layer.get("output", "last") == "last":  # only the last step's h was output
                d, last = np.zeros(inp.shape[:2] + (layer["hidden"],)), d
                d[:, -1] = last
            d = recurrent_backward(kind, layer, params, i, extra, d, grads)
        elif kind in ("conv2d", "conv1d"):
            xh, wh, stride, ph, pw = extra
            dh = d[:, :, None, :] if kind == "conv1d" else d
            dx, dw, db = conv_backward(xh, wh, stride, ph, pw, dh)
            grads[f"{i}.weight"] = dw[:, :, 0, :] if kind == "conv1d" else dw
            grads[f"{i}.bias"] = db
            d = dx[:, :, 0, :] if kind == "conv1d" else dx
        elif kind.endswith(("pool2d", "pool1d")):
            xh, dims, winner = extra
            dh = d[:, :, None, :] if kind.endswith("1d") else d
            dx = pool_backward(xh, *dims, kind[:3], winner, dh)
            d = dx[:, :, 0, :] if kind.endswith("1d") else dx
        elif kind == "global_avgpool":
            spatial = inp.shape[2:]
            d = np.broadcast_to(d.reshape(d.shape + (1,) * len(spatial)), inp.shape) / np.prod(spatial)
        elif kind in ("flatten", "reshape"):
            d = d.reshape(inp.shape)
        elif kind == "relu":
            d = d * (inp > 0)
        elif kind == "leaky_relu":
            d = np.where(inp > 0, d, d * layer.get("slope", 0.01))
        elif kind == "tanh":
            d = d * (1 - out ** 2)
        elif kind == "sigmoid":
            d = d * out * (1 - out)
        elif kind == "dropout":
            if masks is not None:
                d = d * masks[i] / (1 - layer.get("rate", 0.5))
        elif kind == "groupnorm":
            d, grads[f"{i}.weight"], grads[f"{i}.bias"] = groupnorm_backward(inp, w, layer["groups"], extra, d)
    return grads


def network_loss_grad(layers, params, x, y, loss="cross_entropy", masks=None):
    """Mean loss over the batch and the state_dict's gradients (PyTorch's CrossEntropyLoss / MSELoss)."""
    z, tape = network_forward(layers, params, x, masks)
    n = z.shape[0]
    if loss == "cross_entropy":
        zs = z - z.max(axis=1, keepdims=True)
        p = np.exp(zs) / np.exp(zs).sum(axis=1, keepdims=True)
        value = -np.mean(np.log(p[np.arange(n), y]))
        dz = p.copy()
        dz[np.arange(n), y] -= 1
        dz /= n
    else:
        value = np.mean((z - y) ** 2)
        dz = 2 * (z - y) / z.size
    return value, network_backward(layers, params, tape, dz, masks)
