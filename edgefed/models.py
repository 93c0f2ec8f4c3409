"""Models over flat parameter vectors: one small class per kind around its Numba kernels.

The public methods check dtypes and shapes once and own the workspaces, so the kernels below them never
allocate. `local_steps` continues the caller's generator state, so one round's work may be split into
chunks (deadline mode) without changing a single draw.
"""

from __future__ import annotations

import numpy as np

from edgefed.kernels import cnn as _cnn
from edgefed.kernels import logreg as _logreg
from edgefed.kernels import mlp as _mlp
from edgefed.kernels import quadratic as _quad
from edgefed.kernels.random import draw_batch
from edgefed.kernels.sgd import step_terms
from edgefed.problems.data import ClassificationData, QuadraticData
from edgefed.rng import Purpose, generator, kernel_state


class GrowingRows:
    """Workspaces of `rows` rows that grow to the largest batch asked for and hand out views of the first b.

    One set per model, so evaluation chunks and minibatches of any size share it (no buffer per size).
    """

    def __init__(self, *row_shapes):
        self.row_shapes = row_shapes  # (shape of one row, dtype) per buffer
        self.rows = 0
        self.buffers = ()
        self._last_b, self._last = -1, ()

    def take(self, b: int):
        if b == self._last_b:  # the hot path: every local_steps call of a round asks for the same batch
            return self._last
        if b > self.rows:
            self.rows = b
            self.buffers = tuple(np.zeros((b, *shape), dtype) for shape, dtype in self.row_shapes)
        self._last_b, self._last = b, tuple(buf[:b] for buf in self.buffers)
        return self._last


class LocalRun:
    """Workspace of one device's local work in one round: its generator state and minibatch permutation."""

    def __init__(self, rng_state: np.ndarray, n_samples: int):
        self.rng = rng_state
        self.perm = np.arange(n_samples, dtype=np.int64)


class Classifier:
    """What the classification models share: input checks, batch sizes, chunked full gradients, evaluation.

    A subclass provides its kernels through `_sgd`, `_minibatch`, `_chunk_grad` and `loss_correct`.
    """

    EVAL_CHUNK = 256

    def _check(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> None:
        if params.dtype != self.dtype or params.shape != (self.dim,) or not params.flags.c_contiguous:
            raise ValueError(f"params must be a contiguous {self.dtype} vector of {self.dim}, got {params.dtype} {params.shape}")
        if X.dtype != self.dtype or X.ndim != 2 or X.shape[1] != self.n_features or not X.flags.c_contiguous:
            raise ValueError(f"X must be contiguous {self.dtype} (n, {self.n_features}), got {X.dtype} {X.shape}")
        if y.dtype != np.int64 or y.shape != (X.shape[0],):
            raise ValueError(f"y must be int64 of shape ({X.shape[0]},), got {y.dtype} {y.shape}")

    def begin(self, data: ClassificationData, rng_state: np.ndarray) -> LocalRun:
        return LocalRun(rng_state, data.n_train)

    def _checked(self, params, data: ClassificationData, batch_size):
        """(X, y, b, 1/b in the model dtype) after checking the inputs once."""
        X, y = data.X_train, data.y_train
        self._check(params, X, y)
        b = X.shape[0] if batch_size is None else min(int(batch_size), X.shape[0])
        t = self.dtype.type
        return X, y, b, t(1.0) / t(b)

    def local_steps(self, params, data: ClassificationData, run: LocalRun, n_steps: int, batch_size, lr: float,
                    terms: tuple | None = None) -> int:
        """n_steps of minibatch SGD on params in place; batch_size None means the full local gradient.

        terms: what the algorithm adds to each step's gradient (kernels/sgd.py's step_terms), none by default.
        """
        X, y, b, inv_b = self._checked(params, data, batch_size)
        terms = step_terms(self.dtype) if terms is None else terms
        return self._sgd(params, X, y, int(n_steps), b, self.dtype.type(lr), inv_b, run, terms)

    def oracle_grad(self, params, data: ClassificationData, run: LocalRun, batch_size, grad_out) -> None:
        """grad_out <- one stochastic gradient g_k(params): a minibatch drawn from run (None: the full batch)."""
        if batch_size is None:  # in chunks: a full batch of CNN activations would not fit a Pi
            self.loss_grad(params, data, grad_out)
            return
        X, y, b, inv_b = self._checked(params, data, batch_size)
        self._minibatch(params, X, y, b, inv_b, run, grad_out)

    def loss_grad(self, params, data: ClassificationData, grad_out: np.ndarray) -> float:
        """Mean training loss F_k(params) and its full gradient, summed over chunks (bounded memory)."""
        X, y, _, _ = self._checked(params, data, None)
        n = X.shape[0]
        grad_out[:] = 0
        part = np.zeros(self.dim, self.dtype)
        loss = 0.0
        scale = self.dtype.type(1.0) / self.dtype.type(n)
        for start in range(0, n, self.EVAL_CHUNK):
            idx = np.arange(start, min(start + self.EVAL_CHUNK, n), dtype=np.int64)
            loss += self._chunk_grad(params, X, y, idx, scale, part)
            grad_out += part
        return loss / n

    def train_loss(self, params, data: ClassificationData) -> float:
        return self.loss_correct(params, data.X_train, data.y_train)[0] / data.n_train


class LogReg(Classifier):
    """Multinomial logistic regression, d = f*C + C, initialized at zero (as FedProx)."""

    kind = "logreg"

    def __init__(self, n_features: int, n_classes: int, dtype: np.dtype):
        self.n_features, self.n_classes, self.dtype = n_features, n_classes, np.dtype(dtype)
        self.dim = n_features * n_classes + n_classes
        self._grad = np.zeros(self.dim, self.dtype)
        self._prob = np.zeros(n_classes, self.dtype)
        self._work = GrowingRows(((n_classes,), self.dtype), ((n_features,), self.dtype))  # logits, gathered rows
        self._grad_t = np.zeros((n_classes, n_features), self.dtype)
        self._eval_z = np.zeros((64, n_classes), self.dtype)

    def initial_params(self) -> np.ndarray:
        return np.zeros(self.dim, self.dtype)

    def clone(self) -> "LogReg":
        """The same model with its own workspaces (for a second thread)."""
        return LogReg(self.n_features, self.n_classes, self.dtype)

    def _sgd(self, params, X, y, n_steps, b, lr, inv_b, run, terms):
        Z, Xb = self._work.take(b)
        return _logreg._sgd_steps(params, X, y, self.n_classes, n_steps, b, lr, inv_b, run.rng, run.perm, terms,
                                  self._grad, Z, Xb, self._grad_t)

    def _minibatch(self, params, X, y, b, inv_b, run, grad_out):
        Z, Xb = self._work.take(b)
        _logreg._minibatch_grad(params, X, y, self.n_classes, b, inv_b, run.rng, run.perm, grad_out, Z, Xb,
                                self._grad_t)

    def loss_grad(self, params, data: ClassificationData, grad_out: np.ndarray) -> float:
        """Mean training loss F_k(params); grad_out <- its full gradient (one pass, float64 loss sum)."""
        self._check(params, data.X_train, data.y_train)
        return _logreg._loss_grad(params, data.X_train, data.y_train, self.n_classes, grad_out, self._prob)

    def loss_correct(self, params, X: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        """(sum of losses, correct predictions) over the given samples."""
        self._check(params, X, y)
        if X.shape[0] == 0:
            return 0.0, 0
        loss, correct = _logreg._loss_correct(params, X, y, self.n_classes, self._eval_z)
        return float(loss), int(correct)


class MLP(Classifier):
    """Fully connected ReLU network with a softmax output; McMahan et al.'s 2NN is sizes (784, 200, 200, 10).

    Initialization: Glorot-uniform weights, U(+-sqrt(6 / (fan_in + fan_out))), the default of the
    TensorFlow layers the FedAvg experiments used; zero biases; drawn from the (seed, INIT) stream.
    """

    kind = "mlp"

    def __init__(self, sizes, dtype: np.dtype, seed: int):
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.dtype, self.seed = np.dtype(dtype), seed
        widths = self.sizes[:-1] * self.sizes[1:] + self.sizes[1:]
        self.offsets = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
        self.dim = int(widths.sum())
        self.n_features, self.n_classes = int(self.sizes[0]), int(self.sizes[-1])
        self._grad = np.zeros(self.dim, self.dtype)
        total = int(self.sizes.sum())
        self._work = GrowingRows(((total,), self.dtype), ((total,), self.dtype))  # activations, deltas
        self._starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        hidden_w = self.sizes[1:-1] * self.sizes[2:]
        self._wt = np.zeros(int(hidden_w.max()) if hidden_w.size else 0, self.dtype)  # transposed-weight scratch

    def workspace(self, b: int):
        """(activations, deltas, where each layer starts) for a batch of b; buffers are flat b x sum(d_l)."""
        acts, deltas = self._work.take(b)
        return acts.reshape(-1), deltas.reshape(-1), b * self._starts

    def initial_params(self) -> np.ndarray:
        g = generator(self.seed, Purpose.INIT)
        params = np.zeros(self.dim)
        for layer, off in enumerate(self.offsets):
            din, dout = int(self.sizes[layer]), int(self.sizes[layer + 1])
            limit = np.sqrt(6.0 / (din + dout))
            params[off:off + din * dout] = g.uniform(-limit, limit, din * dout)
        return params.astype(self.dtype)

    def clone(self) -> "MLP":
        return MLP(self.sizes, self.dtype, self.seed)

    def _sgd(self, params, X, y, n_steps, b, lr, inv_b, run, terms):
        acts, deltas, a_offs = self.workspace(b)
        return _mlp._sgd_steps(params, self.sizes, self.offsets, a_offs, X, y, n_steps, b, lr, inv_b, run.rng,
                               run.perm, terms, self._grad, acts, deltas, self._wt)

    def _minibatch(self, params, X, y, b, inv_b, run, grad_out):
        acts, deltas, a_offs = self.workspace(b)
        _mlp._minibatch_grad(params, self.sizes, self.offsets, a_offs, X, y, b, inv_b, run.rng, run.perm, grad_out,
                             acts, deltas, self._wt)

    def _chunk_grad(self, params, X, y, idx, scale, out) -> float:
        acts, deltas, a_offs = self.workspace(idx.size)
        return _mlp._batch_grad(params, self.sizes, self.offsets, a_offs, X, y, idx, idx.size, scale, out, acts,
                                deltas, self._wt)

    def loss_correct(self, params, X: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        self._check(params, X, y)
        if X.shape[0] == 0:
            return 0.0, 0
        acts, _, _ = self.workspace(self.EVAL_CHUNK)
        loss, correct = _mlp._loss_correct(params, self.sizes, self.offsets, X, y, self.EVAL_CHUNK, acts)
        return float(loss), int(correct)


class CNN(Classifier):
    """McMahan et al.'s CNN (kernels/cnn.py) for square single-channel images whose side divides by 4.

    Initialization as the MLP's: Glorot-uniform weights (fan-in and fan-out over the 5x5 window for the
    convolutions), zero biases, from the (seed, INIT) stream.
    """

    kind = "cnn"
    EVAL_CHUNK = 64

    def __init__(self, n_features: int, n_classes: int, dtype: np.dtype, seed: int):
        side = int(round(np.sqrt(n_features)))
        if side * side != n_features or side % 4:
            raise ValueError(f"the CNN needs square images with a side divisible by 4, not {n_features} pixels")
        self.side, self.n_features, self.n_classes = side, n_features, n_classes
        self.dtype, self.seed = np.dtype(dtype), seed
        self.offsets, self.dim, sizes = _cnn.layout(side, n_classes)
        self.per_sample = int(sizes.sum())
        s2, s4 = side // 2, side // 4
        self.n_args = s2 * s2 * 32 + s4 * s4 * 64
        self._grad = np.zeros(self.dim, self.dtype)
        # activations, deltas, pooling winners, fc1's transposed deltas and input gradient
        self._work = GrowingRows(((self.per_sample,), self.dtype), ((self.per_sample,), self.dtype),
                                 ((self.n_args,), np.int8), ((_cnn.transposed_size(side),), self.dtype))
        self._scratch = np.zeros(_cnn.scratch_size(side), self.dtype)  # unrolled windows, conv2 W^T
        self._w4t = np.zeros((n_classes, 512), self.dtype)  # fc2 W^T
        self._no_terms = step_terms(self.dtype)  # the gradient-only calls' (unused) terms
        self._eval = None

    def initial_params(self) -> np.ndarray:
        g = generator(self.seed, Purpose.INIT)
        s4 = self.side // 4
        fans = [(25 * 1, 25 * 32, 25 * 32), (25 * 32, 25 * 64, 25 * 32 * 64),
                (s4 * s4 * 64, 512, s4 * s4 * 64 * 512), (512, self.n_classes, 512 * self.n_classes)]
        params = np.zeros(self.dim)
        for off, (fan_in, fan_out, n) in zip(self.offsets, fans):
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            params[off:off + n] = g.uniform(-limit, limit, n)
        return params.astype(self.dtype)

    def clone(self) -> "CNN":
        return CNN(self.n_features, self.n_classes, self.dtype, self.seed)

    def _sgd(self, params, X, y, n_steps, b, lr, inv_b, run, terms):
        """The steps one by one from Python: a step is milliseconds, so the loop costs nothing, and a kernel
        that looped would be one more compilation of the whole network (tens of seconds cold on a Pi)."""
        acts, deltas, args, tr = self._work.take(b)
        for _ in range(n_steps):
            self._draw(X, b, run)
            _cnn._batch_grad(params, self.offsets, self.side, self.n_classes, X, y, run.perm, b, inv_b, self._grad,
                             acts, deltas, args, tr, self._scratch, self._w4t, True, lr, terms)
        return n_steps

    def _minibatch(self, params, X, y, b, inv_b, run, grad_out):
        acts, deltas, args, tr = self._work.take(b)
        self._draw(X, b, run)
        _cnn._batch_grad(params, self.offsets, self.side, self.n_classes, X, y, run.perm, b, inv_b, grad_out, acts,
                         deltas, args, tr, self._scratch, self._w4t, False, inv_b, self._no_terms)

    @staticmethod
    def _draw(X, b, run) -> None:
        """The minibatch of one step into run.perm[:b], as the other models' kernels draw it."""
        if b < X.shape[0]:
            draw_batch(run.rng, run.perm, X.shape[0], b)

    def _chunk_grad(self, params, X, y, idx, scale, out) -> float:
        acts, deltas, args, tr = self._work.take(idx.size)
        return _cnn._batch_grad(params, self.offsets, self.side, self.n_classes, X, y, idx, idx.size, scale, out,
                                acts, deltas, args, tr, self._scratch, self._w4t, False, scale, self._no_terms)

    def loss_correct(self, params, X: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        self._check(params, X, y)
        if X.shape[0] == 0:
            return 0.0, 0
        acts, _, args, _ = self._work.take(1)
        if self._eval is None:  # the dense layers' inputs and outputs of EVAL_CHUNK samples
            self._eval = tuple(np.zeros((self.EVAL_CHUNK, n), self.dtype)
                               for n in ((self.side // 4) ** 2 * 64, 512, self.n_classes))
        loss, correct = _cnn._loss_correct(params, self.offsets, self.side, self.n_classes, X, y, acts[0], args[0],
                                           self._scratch, *self._eval)
        return float(loss), int(correct)


class Quadratic:
    """The quadratic oracle; the model is x itself (d = the problem's dimension)."""

    kind = "quadratic"

    def __init__(self, dim: int, x0: np.ndarray, dtype: np.dtype):
        self.dim, self.dtype = dim, np.dtype(dtype)
        self._x0 = x0

    def initial_params(self) -> np.ndarray:
        return self._x0.astype(self.dtype)

    def clone(self) -> "Quadratic":
        return Quadratic(self.dim, self._x0, self.dtype)

    def begin(self, data: QuadraticData, rng_state: np.ndarray) -> LocalRun:
        return LocalRun(rng_state, 0)

    def local_steps(self, params, data: QuadraticData, run: LocalRun, n_steps: int, batch_size, lr: float,
                    terms: tuple | None = None) -> int:
        terms = step_terms(self.dtype) if terms is None else terms
        return _quad._sgd_steps(params, data.a, data.b, int(n_steps), self.dtype.type(lr), float(data.noise_std),
                                run.rng, terms)

    def oracle_grad(self, params, data: QuadraticData, run: LocalRun, batch_size, grad_out) -> None:
        """grad_out <- g_k(params), with the oracle's noise if the problem has any."""
        _quad._oracle_grad(params, data.a, data.b, float(data.noise_std), run.rng, grad_out)

    def loss_grad(self, params, data: QuadraticData, grad_out: np.ndarray) -> float:
        """f_k(params) and its exact gradient (no noise)."""
        return float(_quad._loss_grad(params, data.a, data.b, grad_out))

    def train_loss(self, params, data: QuadraticData) -> float:
        return self.loss_grad(params, data, np.empty_like(params))


def build_model(model, problem, seed: int = 0):
    """The model a validated [model] table names (kind, dtype, hidden widths), sized by the problem."""
    dtype = np.dtype(model.dtype)
    if model.kind == "logreg":
        return LogReg(problem.n_features, problem.n_classes, dtype)
    if model.kind == "mlp":
        return MLP((problem.n_features, *model.hidden, problem.n_classes), dtype, seed)
    if model.kind == "cnn":
        return CNN(problem.n_features, problem.n_classes, dtype, seed)
    if model.kind == "quadratic":
        return Quadratic(problem.dim, problem.x0, dtype)
    raise ValueError(f"unknown model kind {model.kind!r}")


MODEL_CALLS = ("oracle_grad", "loss_grad")  # what an algorithm may call beyond local_steps and evaluation


def warm_model(model, data, batch_size, calls=MODEL_CALLS) -> None:
    """Call every kernel a round can reach, compiling (or loading from the cache) each for this model's
    dtype: local steps, evaluation, and of MODEL_CALLS those named in calls (an algorithm's model_calls)."""
    x = model.initial_params()
    y, grad = x.copy(), np.zeros_like(x)
    run = model.begin(data, kernel_state(0, Purpose.LOCAL, 0, 0))
    model.local_steps(y, data, run, 1, batch_size, 0.0)
    model.local_steps(y, data, run, 1, batch_size, 0.0, step_terms(model.dtype, np.zeros_like(x)))
    if "oracle_grad" in calls:
        model.oracle_grad(x, data, run, batch_size, grad)
    if "loss_grad" in calls:
        model.loss_grad(x, data, grad)
    model.train_loss(x, data)  # the classifiers' evaluation kernel (loss_correct) as well
