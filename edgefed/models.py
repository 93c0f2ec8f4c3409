"""Models over flat parameter vectors, each keeping the contract of model_contract.py: `Sequential` (any layer
list of edgefed/layers/, the built-in models among them) around the one network kernel, and the quadratic oracle.

The public methods check dtypes and shapes once and own the workspaces, so the kernels below them never
allocate. `local_steps` continues the caller's generator state, so one round's work may be split into
chunks (deadline mode) without changing a single draw.
"""

from __future__ import annotations

import copy

import numpy as np
from numba import typeof

from edgefed import layers as layer_lib
from edgefed.kernels import network as net
from edgefed.kernels.ops import ROWS, SLOTS, Apart, cached, kernel_names, kernels_of, uncached
from edgefed.kernels.ops import tables as op_tables
from edgefed.kernels.program import F_FROZEN, F_NOUT, F_NPARAM, F_TYPE
from edgefed.kernels import quadratic as _quad
from edgefed.model_contract import Classifier, LocalRun, Model
from edgefed.kernels.sgd import step_terms
from edgefed.errors import ConfigError
from edgefed.memory import memory_limit
from edgefed.problems.data import ClassificationData, QuadraticData
from edgefed.problems.features import FeatureProblem
from edgefed.rng import Purpose, generator, kernel_state


class GrowingRows:
    """Workspaces of `rows` rows that grow to the largest batch asked for and hand out views of the first b.

    One set per model, so evaluation chunks and minibatches of any size share it (no buffer per size).
    """

    def __init__(self, *row_shapes):
        self.row_shapes = row_shapes  # (shape of one row, dtype) per buffer
        self.rows = 0
        self.buffers = ()
        self._views = {}  # b -> the views of b rows: a round asks for a few sizes, again and again

    def take(self, b: int):
        views = self._views.get(b)
        if views is not None:
            return views
        if b > self.rows:
            self.rows = b
            self.buffers = tuple(np.zeros((b, *shape), dtype) for shape, dtype in self.row_shapes)
            self._views.clear()
        views = self._views[b] = tuple(buf[:b] for buf in self.buffers)
        return views


BUILTIN_INITS = {"logreg": "zeros", "charlstm": "pytorch"}  # a built-in model's own (else glorot)


class Sequential(Classifier):
    """A layer list (edgefed/layers/) trained by the network kernel: every classifier and regressor.

    The built-in models are named layer lists (`builtin`): logistic regression ("logreg", initialized at
    zero, as FedProx), McMahan et al.'s 2NN ("mlp") and CNN ("cnn"), both Glorot-uniform as in the
    TensorFlow layers the FedAvg experiments used, and their character LSTM ("charlstm") and a "sequential"
    model, PyTorch's initialisation by default. Samples arrive flat, (n, values) in PyTorch's (C, H, W) order
    (token ids as exact values in the model dtype); labels are int64 (cross-entropy) or targets float
    (n, width) in the model dtype (mse).
    """

    def __init__(self, network: layer_lib.Network, dtype, init: np.random.Generator, scheme: str = "pytorch",
                 loss: str = "cross_entropy", kind: str = "sequential", cache_features: bool = True, rows: int = 1,
                 start: np.ndarray | None = None):
        """init: the stream the whole vector a run starts from (x_0, then the frozen tensors) is drawn from by
        the init scheme, drawn anew from the stream's state as given whenever it is asked for, and never held
        unless the frozen tensors need it; start: that vector given instead (load_weights; a clone's); rows:
        the most samples a step holds (minibatch_rows), what its workspaces grow to."""
        self.network, self.dtype, self.loss, self.kind, self.rows = network, np.dtype(dtype), loss, kind, rows
        self.cache_features = cache_features
        self.n_trainable = network.trainable  # x: the trainable parameters, the whole vector's first
        self.n_outputs = network.out_width
        self._loss_kind = net.CROSS_ENTROPY if loss == "cross_entropy" else net.MSE
        dt = self.dtype
        self._init, self.scheme = copy.deepcopy(init), scheme  # (its state as given: every draw the same)
        self._start = self._drawn() if start is None and network.frozen else start
        self._whole = None if not network.frozen else self._start.copy()  # x, then the frozen tensors the program reads
        self.prefix_end = layer_lib.feature_prefix(network.prog) if cache_features else 0
        self.vocabulary = 0 if self.prefix_end else int(layer_lib.first_vocabulary(network.layers) or 0)
        self._prog, self._slopes, first = network.prog, network.slopes, 0
        self.n_inputs = self.n_features = int(np.prod(network.input_shape))
        if self.prefix_end:  # the samples are the prefix's outputs: the program starts after it
            self._prog, self._slopes, first = layer_lib.rest_program(network.prog, network.slopes, self.prefix_end)
            self.n_features = int(network.prog[self.prefix_end, F_NOUT])
        # x goes into the whole vector around a call only while the program still has frozen parameters
        self._copies_x = bool(((self._prog[1:, F_NPARAM] > 0) & (self._prog[1:, F_FROZEN] == 1)).any())
        self._prefix_acts = None  # the whole network's activations, for features (made when first asked)
        self._grad = np.zeros(network.n_params, dt)
        per_sample = self._per_sample = network.per_sample - first
        self._acts = GrowingRows(((per_sample,), dt), ((network.aux_per_sample,), np.int32))
        transposed = network.workspace.transposed_per_sample
        self._deltas = GrowingRows(((per_sample,), dt), ((transposed,), dt))
        self._no_deltas = (np.zeros((0, per_sample), dt), np.zeros((0, transposed), dt))
        self._scratch = tuple(np.zeros(n, dt) for n in network.workspace.scratch)
        self._no_labels = np.zeros(0, np.int64)
        self._no_targets = np.zeros((0, 0), dt)
        self._no_terms = step_terms(dt)
        self._no_rng = np.zeros(4, np.uint64)
        self._ops = None  # (ROWS, SLOTS) addresses of the kernels the program calls (kernels/ops.py)

    @classmethod
    def builtin(cls, kind: str, sample_shape: tuple, n_classes: int, dtype, seed: int = 0, hidden=(200, 200),
                memory=None, rows: int = 1):
        """A built-in model ("logreg", "mlp" with these hidden widths, "cnn", "charlstm") for samples of this
        shape, its values drawn from seed's INIT stream (memory, rows: as layers.build takes them)."""
        layers = layer_lib.builtin_layers(kind, tuple(sample_shape), n_classes, hidden)
        network = layer_lib.build(layers, tuple(sample_shape), n_classes, dtype, name=f'model.kind = "{kind}", layers',
                                  memory=memory, rows=rows)
        return cls.seeded(network, dtype, seed, BUILTIN_INITS.get(kind, "glorot"), kind=kind)

    @classmethod
    def seeded(cls, network: layer_lib.Network, dtype, seed: int, scheme: str = "pytorch", **settings) -> Sequential:
        """A model of this network starting from an init scheme's draw from the (seed, INIT) stream (settings:
        the constructor's loss, kind, cache_features)."""
        return cls(network, dtype, generator(seed, Purpose.INIT), scheme, **settings)

    @property
    def n_classes(self) -> int:
        return self.n_outputs

    @property
    def has_accuracy(self) -> bool:
        return self._loss_kind == net.CROSS_ENTROPY

    def memory_bytes(self, rows: int | None = None) -> int:
        """What a model of this network holds for minibatches of `rows` samples (None: the rows it was built
        for; a clone: one more lane)."""
        return self.network.workspace_bytes(self.rows if rows is None else rows, self._per_sample)

    def profile_key(self) -> str:
        """What a board profile's speed entry names this model by: a built-in's name, else its layer list."""
        return self.kind if self.kind != "sequential" else f"sequential: {self.network.signature()}"

    def log_attrs(self) -> dict:
        if not self.prefix_end:
            return {}
        return {"features_cached": f"the frozen prefix's outputs ({self.n_features} values a sample: program "
                                   f"operations 1..{self.prefix_end}), computed once per device"}

    def _drawn(self) -> np.ndarray:
        return layer_lib.initial_params(self.network, self.scheme, copy.deepcopy(self._init), self.dtype)

    def initial_params(self) -> np.ndarray:
        """x_0: the trainable parameters, loaded (load_weights) or drawn."""
        return (self._drawn() if self._start is None else self._start)[:self.n_trainable].copy()

    def load_weights(self, weights: dict, source: str) -> None:
        """Start from a state_dict (the printed module's names and shapes: what `edgefed export --weights`
        writes), not the seeded draw; a missing, unexpected or mis-shaped tensor is a ConfigError naming it."""
        self._start = layer_lib.whole_from_state(self.network, weights, source, self.dtype)
        if self._whole is not None:
            self._whole[self.n_trainable:] = self._start[self.n_trainable:]

    @property
    def frozen_values(self) -> np.ndarray:
        """The frozen tensors, as the whole vector holds them after x (empty: none)."""
        return self._whole[self.n_trainable:] if self._whole is not None else np.zeros(0, self.dtype)

    def whole(self, params: np.ndarray) -> np.ndarray:
        """The whole parameter vector of x = params: params, then the frozen tensors."""
        return params if self._whole is None else np.concatenate([params, self.frozen_values])

    def clone(self) -> "Sequential":
        """The same model with its own workspaces (for a second thread)."""
        return Sequential(self.network, self.dtype, self._init, self.scheme, self.loss, self.kind, self.cache_features,
                          self.rows, self._start)

    def state_dict(self, params: np.ndarray) -> dict[str, np.ndarray]:
        return layer_lib.state_dict(self.network, self.whole(params))

    def features(self, X: np.ndarray) -> np.ndarray:
        """The samples X (n, values) through the frozen prefix: what this model trains and evaluates on."""
        if X.dtype != self.dtype or X.ndim != 2 or X.shape[1] != self.n_inputs:
            raise ValueError(f"X must be {self.dtype} (n, {self.n_inputs}), got {X.dtype} {X.shape}")
        out = np.zeros((X.shape[0], self.n_features), self.dtype)
        if X.shape[0]:
            nw = self.network
            if self._prefix_acts is None:
                self._prefix_acts = GrowingRows(((nw.per_sample,), self.dtype), ((nw.aux_per_sample,), np.int32))
            acts, aux = self._prefix_acts.take(min(nw.eval_chunk, X.shape[0]) + 1)
            net.network(self._operations(), nw.prog[:self.prefix_end + 1], nw.slopes[:self.prefix_end + 1], nw.perms,
                        self._loss_kind, self._whole, np.ascontiguousarray(X), self._no_labels, self._no_targets,
                        self._no_labels, X.shape[0], 0, 0, self.dtype.type(0), self.dtype.type(1), self._no_terms,
                        self._no_rng, net.FEATURES, self._grad, acts, self._no_deltas[0], aux, self._no_deltas[1],
                        *self._scratch, out)
        return out

    # -- checks ------------------------------------------------------------------------------------------
    def _check(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> None:
        if params.dtype != self.dtype or params.shape != (self.n_trainable,) or not params.flags.c_contiguous:
            raise ValueError(f"params must be a contiguous {self.dtype} vector of {self.n_trainable}, got {params.dtype} {params.shape}")
        if X.dtype != self.dtype or X.ndim != 2 or X.shape[1] != self.n_features or not X.flags.c_contiguous:
            raise ValueError(f"X must be contiguous {self.dtype} (n, {self.n_features}), got {X.dtype} {X.shape}")
        if self._loss_kind == net.CROSS_ENTROPY:
            if y.dtype != np.int64 or y.shape != (X.shape[0],):
                raise ValueError(f"y must be int64 of shape ({X.shape[0]},), got {y.dtype} {y.shape}")
        elif y.dtype != self.dtype or y.shape != (X.shape[0], self.n_outputs) or not y.flags.c_contiguous:
            raise ValueError(f"y must be contiguous {self.dtype} ({X.shape[0]}, {self.n_outputs}), got {y.dtype} {y.shape}")

    def _targets(self, y):
        """(labels, targets) as the kernel takes them: the one the loss reads, and an empty other."""
        return (y, self._no_targets) if self._loss_kind == net.CROSS_ENTROPY else (self._no_labels, y)

    def compile_kernels(self, data: ClassificationData, on_compile=None) -> None:
        """Compile (or load from the cache) the network kernel and the kernels the program calls: when the
        network must compile, the others in a process of their own meanwhile. on_compile(what) is told first
        what will compile, if anything will."""
        if self._ops is not None:
            return
        codes = self.network.prog[:, F_TYPE]
        args = self._network_args(np.zeros((ROWS, SLOTS), np.int64), self._grad[:self.n_trainable], data.X_train[:0],
                                  data.y_train[:0], self._no_labels, 0, 0, 0, self.dtype.type(0), self.dtype.type(1),
                                  self._no_terms, self._no_rng, net.EVAL, self._grad, 1)
        network_cold = not cached(net.network, [typeof(a) for a in args])
        todo = uncached(kernels_of(codes), self.dtype)
        if on_compile is not None and (network_cold or todo):
            on_compile((["network"] if network_cold else []) + kernel_names(todo), self.dtype)
        apart = None
        if network_cold:
            apart = Apart(todo, self.dtype) if todo else None  # the other kernels, in a process of their own
            net.network(*args)  # (no rows: no kernel is called) compiled here meanwhile
        self._ops = op_tables(codes, self.dtype, apart)  # (then those the helper has not reached)

    def _network_args(self, ops, params, X, y, idx, n, b, n_steps, lr, scale, terms, rng, mode, grad, rows,
                      outputs=None) -> tuple:
        acts, aux = self._acts.take(rows)
        deltas, tr = self._deltas.take(b) if mode < net.EVAL else self._no_deltas
        labels, targets = self._targets(y)
        return (ops, self._prog, self._slopes, self.network.perms, self._loss_kind, params, X, labels, targets, idx, n, b,
                n_steps, lr,
                scale, terms, rng, mode, grad, acts, deltas, aux, tr, *self._scratch,
                self._no_targets if outputs is None else outputs)

    def _operations(self):
        if self._ops is None:  # the model's operations, compiled (or loaded) when first run: at the warm-up
            self._ops = op_tables(self.network.prog[:, F_TYPE], self.dtype)
        return self._ops

    def _call(self, params, X, y, idx, n, b, n_steps, lr, scale, terms, rng, mode, grad, rows, outputs=None):
        whole = params
        if self._copies_x:  # x into the whole vector, beside the frozen tensors the program reads
            whole = self._whole
            whole[:self.n_trainable] = params
        loss, count = net.network(*self._network_args(self._operations(), whole, X, y, idx, n, b, n_steps, lr, scale,
                                                      terms, rng, mode, grad, rows, outputs))
        if whole is not params and mode == net.STEPS:
            params[:] = whole[:self.n_trainable]
        if count < 0:  # the kernel found a label outside the classes (its row: -1 - count) and stopped there
            raise ValueError(f"labels must lie in [0, {self.n_outputs}); row {-1 - count} has {int(y[-1 - count])}")
        return loss, count

    # -- training ----------------------------------------------------------------------------------------
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
        The deadline runner calls it in chunks sized by the measured step time (runtime/deadline.py).
        """
        X, y, b, inv_b = self._checked(params, data, batch_size)
        terms = self._no_terms if terms is None else terms
        squares, steps = self._call(params, X, y, run.perm, X.shape[0], b, int(n_steps), self.dtype.type(lr), inv_b,
                                    terms, run.rng, net.STEPS, self._grad, b)
        run.loss_sq += squares
        run.samples += int(steps) * b
        return int(steps)

    def oracle_grad(self, params, data: ClassificationData, run: LocalRun, batch_size, grad_out) -> None:
        """grad_out <- one stochastic gradient g_k(params): a minibatch drawn from run (None: the full batch)."""
        if batch_size is None:  # in chunks: a full batch of a CNN's activations would not fit a Pi
            self.loss_grad(params, data, grad_out)
            return
        X, y, b, inv_b = self._checked(params, data, batch_size)
        grad = self._grad if self._copies_x else grad_out  # (the kernel writes the frozen tensors' too)
        self._call(params, X, y, run.perm, X.shape[0], b, 1, inv_b, inv_b, self._no_terms, run.rng, net.MINIBATCH,
                   grad, b)
        if grad is not grad_out:
            grad_out[:] = grad[:self.n_trainable]

    def loss_grad(self, params, data: ClassificationData, grad_out: np.ndarray) -> float:
        """Mean training loss F_k(params) and its full gradient (dropout off), summed over chunks (bounded
        memory): each chunk's gradient scaled by 1/n, the chunks added in order."""
        X, y, _, _ = self._checked(params, data, None)
        n = X.shape[0]
        grad_out[:] = 0
        loss = 0.0
        scale = self.dtype.type(1.0) / self.dtype.type(n)
        for start in range(0, n, self.network.eval_chunk):
            idx = np.arange(start, min(start + self.network.eval_chunk, n), dtype=np.int64)
            part, _ = self._call(params, X, y, idx, n, idx.size, 1, scale, scale, self._no_terms, self._no_rng,
                                 net.ROWS, self._grad, idx.size)
            loss += part
            grad_out += self._grad[:self.n_trainable]
        return loss / n

    # -- evaluation --------------------------------------------------------------------------------------
    def loss_correct(self, params, X: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        """(sum of losses, correct predictions) over the given samples (mse: correct is 0), dropout off."""
        self._check(params, X, y)
        if X.shape[0] == 0:
            return 0.0, 0
        rows = min(self.network.eval_chunk, X.shape[0]) + 1  # and one row of scratch
        loss, correct = self._call(params, X, y, self._no_labels, X.shape[0], 0, 0, self.dtype.type(0), self.dtype.type(1),
                                   self._no_terms, self._no_rng, net.EVAL, self._grad, rows)
        return float(loss), int(correct)

    def outputs(self, params, X: np.ndarray) -> np.ndarray:
        """The last layer's outputs (logits, or a regression's values) for each row of X, dropout off."""
        if params.dtype != self.dtype or X.dtype != self.dtype or X.ndim != 2 or X.shape[1] != self.n_features:
            raise ValueError(f"params and X must be {self.dtype}, X (n, {self.n_features})")
        out = np.zeros((X.shape[0], self.n_outputs), self.dtype)
        if X.shape[0]:
            y = (np.zeros(X.shape[0], np.int64) if self.has_accuracy
                 else np.zeros((X.shape[0], self.n_outputs), self.dtype))
            self._call(params, np.ascontiguousarray(X), y, self._no_labels, X.shape[0], 0, 0, self.dtype.type(0),
                       self.dtype.type(1), self._no_terms, self._no_rng, net.EVAL, self._grad,
                       min(self.network.eval_chunk, X.shape[0]) + 1, out)
        return out

    def train_loss(self, params, data: ClassificationData) -> float:
        return self.loss_correct(params, data.X_train, data.y_train)[0] / data.n_train


class Quadratic(Model):
    """The quadratic oracle; the model is x itself (d = the problem's dimension)."""

    kind = "quadratic"

    def __init__(self, dim: int, x0: np.ndarray, dtype: np.dtype):
        self.n_trainable, self.dtype = dim, np.dtype(dtype)
        self._x0 = x0

    def initial_params(self) -> np.ndarray:
        return self._x0.astype(self.dtype)

    @property
    def frozen_values(self) -> np.ndarray:
        return np.zeros(0, self.dtype)

    def memory_bytes(self, rows: int | None = None) -> int:
        return 0  # its oracle works in place, on the problem's arrays

    def clone(self) -> "Quadratic":
        return Quadratic(self.n_trainable, self._x0, self.dtype)

    def begin(self, data: QuadraticData, rng_state: np.ndarray) -> LocalRun:
        return LocalRun(rng_state, 0)

    def local_steps(self, params, data: QuadraticData, run: LocalRun, n_steps: int, batch_size, lr: float,
                    terms: tuple | None = None) -> int:
        terms = step_terms(self.dtype) if terms is None else terms
        run.loss_sq += _quad._sgd_steps(params, data.a, data.b, int(n_steps), self.dtype.type(lr),
                                        float(data.noise_std), run.rng, terms)
        run.samples += int(n_steps)
        return int(n_steps)

    def oracle_grad(self, params, data: QuadraticData, run: LocalRun, batch_size, grad_out) -> None:
        """grad_out <- g_k(params), with the oracle's noise if the problem has any."""
        _quad._oracle_grad(params, data.a, data.b, float(data.noise_std), run.rng, grad_out)

    def loss_grad(self, params, data: QuadraticData, grad_out: np.ndarray) -> float:
        """f_k(params) and its exact gradient (no noise)."""
        return float(_quad._loss_grad(params, data.a, data.b, grad_out))

    def train_loss(self, params, data: QuadraticData) -> float:
        return self.loss_grad(params, data, np.empty_like(params))


def minibatch_rows(batch_size, largest: int) -> int:
    """The most samples one local step holds at once: the minibatch, or the largest device's (a full batch)."""
    largest = max(int(largest), 1)
    return largest if batch_size == "full" else min(int(batch_size), largest)


def largest_train(problem) -> int:
    """The most training samples a device of the federation has (the same on every rank, so every rank's model
    has the same workspaces: a generated problem on a device rank finds it without holding every size)."""
    if hasattr(problem, "largest_train"):
        return problem.largest_train()
    return int(np.max(problem.n_train, initial=1))


def build_model(model, problem, init: np.random.Generator, memory: tuple[int, str] | None = None,
                batch_size="full"):
    """The model a validated [model] table names (kind, layers, loss, init, dtype), sized by the problem, its
    initial values drawn from `init` (the run's (seed, INIT) stream). A bad layer list is a ConfigError naming
    the layer; one that would not fit in memory (bytes, what sets them) for minibatches of train.batch_size a
    ResourceError, before its buffers are allocated."""
    dtype = np.dtype(model.dtype)
    if model.kind not in ("quadratic", "torch"):
        return _sequential(model, problem, init, dtype, memory, minibatch_rows(batch_size, largest_train(problem)))
    if model.kind == "quadratic":
        return Quadratic(problem.dim, problem.x0, dtype)
    from edgefed.torchmodel import TorchModel

    return TorchModel(model.module, model.factory, problem.sample_shape, problem.n_outputs, dtype, init, model.loss)


def _sequential(model, problem, init: np.random.Generator, dtype, memory, rows: int) -> Sequential:
    layers = layer_lib.model_layers(model, problem.sample_shape, problem.n_outputs)  # (the one entry)
    text = getattr(problem, "text", None)  # (task, vocabulary) of samples the reader made token ids
    if text is not None and layer_lib.first_vocabulary(layers) is None:
        raise ConfigError(f"config: {text[0]} samples are token ids; a layer list must start with an embedding "
                          f'(model.kind = "charlstm", or layers starting with {{type = "embedding", num = {text[1]}, '
                          'dim = 8}), or give a torch module that takes them')
    what = "classes" if model.loss == "cross_entropy" else "target values"
    note = getattr(problem, "classes_note", "")
    name = "model.layers" if model.kind == "sequential" else f'model.kind = "{model.kind}", layers'
    network = layer_lib.build(layers, problem.sample_shape, problem.n_outputs, dtype,
                              f"{what} ({note})" if note else what, name=name, memory=memory, rows=rows)
    scheme = model.init or ("pytorch" if model.kind == "sequential" else BUILTIN_INITS.get(model.kind, "glorot"))
    return Sequential(network, dtype, init, scheme, model.loss, model.kind, model.cache_features, rows)


def model_for(cfg, problem, start: dict | None = None):
    """(the problem as the model sees it, the model a config names for it): its samples through a frozen
    prefix when it has one; start: the state_dict it starts from (None: the seed's draw); sized for this
    process's memory."""
    model = build_model(cfg.model, problem, generator(cfg.seed, Purpose.INIT), memory_limit(), cfg.train.batch_size)
    if start is not None:
        model.load_weights(start, f"config: model.weights = {cfg.model.weights!r}")
    if model.prefix_end:  # the samples pass the frozen prefix once, when a device's data is built
        problem = FeatureProblem(problem, model)
    threads = cfg.mpi.threads_per_rank or 1
    if threads > 1 and model.one_lane:
        raise ConfigError(f"config: mpi.threads_per_rank = {threads}, but model.module draws random numbers in "
                          "training (dropout) from PyTorch's one generator per process, so its devices run one at a "
                          "time per process; remove threads_per_rank and use more ranks")
    return problem, model


MODEL_CALLS = ("oracle_grad", "loss_grad")  # what an algorithm may call beyond local_steps and evaluation


def warm_model(model, data, batch_size, calls=MODEL_CALLS, on_compile=None) -> None:
    """Call every kernel a round can reach, compiling (or loading from the cache) each for this model's
    dtype: local steps, evaluation, and of MODEL_CALLS those named in calls (an algorithm's model_calls).
    on_compile(names, dtype): told what is about to compile, before it does (a layer list's kernels)."""
    if isinstance(data, ClassificationData):  # a few rows reach every kernel: a device of 50,000 would cost seconds
        few = 2 * (batch_size or 16)
        data = ClassificationData(data.X_train[:few], data.y_train[:few], data.X_test[:few], data.y_test[:few])
    model.compile_kernels(data, on_compile)
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
