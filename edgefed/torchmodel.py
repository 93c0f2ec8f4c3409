"""A PyTorch module as it is (`[model] kind = "torch"`): the user's `factory(input_shape, n_classes)` builds it,
and edgefed trains its parameters held as one flat vector, the run's own.

Every model's interface (models.Sequential's), so every algorithm, rule, deadline, compression, FedBuff and
secure aggregation run it unchanged. A device's local step is plain SGD: the module's parameters are views
into the flat vector the round hands over (no copies per step), their gradients views into one preallocated
flat gradient, and the step adds the algorithm's terms as kernels/sgd.py does: g = grad + mu (y - anchor) +
correction, y = y - lr g. Minibatches come from the device's stream as for every model; the module's own
randomness (dropout) from a torch generator state seeded by that stream and carried across the chunks a
deadline cuts the work into, so a replay reproduces it. PyTorch runs deterministic algorithms, one thread per
lane (each lane its own module); a module that draws random numbers in training runs its devices one at a time
per process, since torch's generator is the process's.

Bits: a run repeats to the byte on one machine and torch build; across CPUs they are not promised (PyTorch's
kernels choose their own order): the Numba layer library is the path that keeps that promise.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import itertools
import random
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from edgefed.errors import ConfigError
from edgefed.kernels.random import draw_batch
from edgefed.layers import check_state
from edgefed.model_contract import Classifier

EVAL_CHUNK = 64
_MODULES = {}  # path -> the loaded module file (clones and ranks' second models reuse it)


def import_torch():
    """torch, configured for edgefed once: one thread, deterministic algorithms."""
    try:
        import torch
    except ImportError:
        raise ConfigError('config: model.kind = "torch" needs PyTorch: install the extra, pip install '
                          '"edgefed[torch]" (or pip install torch)') from None
    if not getattr(torch, "_edgefed_configured", False):
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        torch._edgefed_configured = True
    return torch


def _load(path: str):
    if path not in _MODULES:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"config: model.module = {path!r} is not a file; give the Python file of your module "
                              "(relative to the config file, or absolute)")
        name = "edgefed_user_module_" + hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        folder = str(file.resolve().parent)
        if folder not in sys.path:  # its own imports of files beside it, as `python file.py` would find them
            sys.path.append(folder)
        sys.modules[name] = module  # what dataclasses and pickling inside it look up
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's file: its error, in one line
            del sys.modules[name]
            raise ConfigError(f"config: model.module {path} cannot be imported: {type(exc).__name__}: "
                              f"{_first_line(exc)}") from None
        _MODULES[path] = module
    return _MODULES[path]


class TorchRun:
    """One device's local work in one round: its minibatch generator and permutation (as every model's), and
    the torch generator state of the module's own randomness."""

    def __init__(self, rng_state: np.ndarray, n_samples: int, torch_state):
        self.rng = rng_state
        self.perm = np.arange(n_samples, dtype=np.int64)
        self.torch_state = torch_state
        self.loss_sq, self.samples = 0.0, 0  # what the steps report of their losses, as models.LocalRun


def _global_generators() -> tuple:
    """The states of NumPy's global generator (np.random.*) and Python's (random.*), which nothing seeds per
    device: a module that draws from either makes two identical runs differ, so it is refused."""
    numpy_state = np.random.get_state(legacy=False)
    return (numpy_state["state"]["key"].tobytes(), numpy_state["state"]["pos"], numpy_state["has_gauss"],
            numpy_state["gauss"], random.getstate())


def _drew_from(before: tuple) -> str | None:
    """Which global generator a module drew from since `before` (None: neither)."""
    after = _global_generators()
    if after[:4] != before[:4]:
        return "NumPy's global random generator (np.random)"
    if after[4] != before[4]:
        return "Python's random module"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


class TorchModel(Classifier):
    """A user's torch.nn.Module behind edgefed's model contract (model_contract.Classifier; see the module's docstring).
    init: the run's (seed, INIT) stream, whose first draw seeds torch while the factory builds the module."""

    kind = "torch"
    EVAL_CHUNK = EVAL_CHUNK
    report_losses = False  # fill run.loss_sq (a selection policy reads them): off, a step costs nothing more

    def __init__(self, path: str, factory: str, sample_shape: tuple, n_outputs: int, dtype,
                 init: np.random.Generator, loss: str = "cross_entropy"):
        torch = self.torch = import_torch()
        self.path, self.factory, self.loss = path, factory, loss
        self._init_stream = copy.deepcopy(init)  # (a clone's module is built from the same draw)
        self.sample_shape, self.n_outputs = tuple(int(s) for s in sample_shape), int(n_outputs)
        self.n_features = int(np.prod(self.sample_shape))
        self.dtype = np.dtype(dtype)
        self.tdtype = torch.float64 if self.dtype == np.float64 else torch.float32
        self.has_accuracy = loss == "cross_entropy"
        build = getattr(_load(path), factory, None)
        if not callable(build):
            raise ConfigError(f"config: model.factory = {factory!r} is not a function in {path}; name the function "
                              "that returns your nn.Module, called as factory(input_shape, n_classes)")
        with torch.random.fork_rng(devices=[]):  # its initialization from the run's (seed, INIT) stream
            torch.manual_seed(int(init.integers(2**62)))
            try:
                module = build(self.sample_shape, self.n_outputs)
            except Exception as exc:  # noqa: BLE001 - the user's factory: its error, in one line
                raise ConfigError(f"config: model.factory {factory}(input_shape={self.sample_shape}, n_classes="
                                  f"{self.n_outputs}) in {path} raised {type(exc).__name__}: {_first_line(exc)}") from None
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(f"config: model.factory {factory} returned {type(module).__name__}, not a "
                              "torch.nn.Module")
        self.module = module.to(self.tdtype)
        for name, p in self.module.named_parameters():
            if not p.dtype.is_floating_point:
                raise ConfigError(f"config: model.module's parameter {name} is {p.dtype}; edgefed trains floating "
                                  "point parameters only")
        # x: the trainable parameters in order; frozen ones (requires_grad False) stay the factory's, alike
        # on every device since the factory's draws are the run's
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.names = [name for name, p in self.module.named_parameters() if p.requires_grad]
        self.shapes = [tuple(p.shape) for p in self.params]
        self.offsets = list(itertools.accumulate((p.numel() for p in self.params[:-1]), initial=0))
        self.n_trainable = sum(p.numel() for p in self.params)
        if self.n_trainable == 0:
            raise ConfigError("config: model.module has no parameters to train")
        self._flat_grad = torch.zeros(self.n_trainable, dtype=self.tdtype)
        self._g = torch.zeros(self.n_trainable, dtype=self.tdtype)  # the step's gradient with the algorithm's terms
        self._bound = None
        self._init = self._flat_params()
        self._check_module()
        self._bind_grads()

    def _check_module(self) -> None:
        """One training step's forward and backward on a batch of 2, and one evaluation: the output's type and
        columns, buffers a training step would change (batch-norm statistics), randomness in evaluation
        (refused), and whether training draws from torch's generator (dropout): `draws`, then its devices
        run one at a time per process, since that generator is the process's."""
        torch = self.torch
        x = torch.ones((2, *self.sample_shape), dtype=self.tdtype)
        before = {k: v.clone() for k, v in self.module.named_buffers()}
        with torch.random.fork_rng(devices=[]):
            state, outside = torch.get_rng_state(), _global_generators()
            self.module.train()
            out = self._forward(x, "config: model.module's forward on a batch of 2")
            self.draws = not torch.equal(state, torch.get_rng_state())
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (2, self.n_outputs):
                target = (torch.zeros(2, dtype=torch.int64) if self.has_accuracy
                          else torch.zeros((2, self.n_outputs), dtype=self.tdtype))
                self._backward(self._loss(out, target), "config: model.module's backward on a batch of 2")
            self._refuse_global_draws(outside, "training", "config: ")
            self.module.eval()
            state, outside = torch.get_rng_state(), _global_generators()
            with torch.no_grad():
                self._forward(x, "config: model.module's forward in evaluation mode")
            eval_draws = not torch.equal(state, torch.get_rng_state())
            self._refuse_global_draws(outside, "evaluation", "config: ")
        self.module.zero_grad(set_to_none=True)
        changed = [k for k, v in self.module.named_buffers() if not torch.equal(v, before[k])]
        with torch.no_grad():
            for k, v in self.module.named_buffers():
                v.copy_(before[k])
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"config: model.module's forward returned {type(out).__name__}; it must return one "
                              f"tensor of shape (batch, {self.n_outputs})")
        if changed:
            raise ConfigError(f"config: model.module's buffers change in training ({', '.join(changed[:3])}): "
                              "edgefed federates parameters only; use GroupNorm instead of batch norm, BatchNorm "
                              "with track_running_stats=False, or keep the batch norm in eval mode (frozen "
                              "statistics) in your module's train()")
        if tuple(out.shape) != (2, self.n_outputs):
            what = "class" if self.has_accuracy else "target value"
            raise ConfigError(f"config: model.module's output has shape {tuple(out.shape)} for a batch of 2; it "
                              f"must be (batch, {self.n_outputs}): one column per {what} of the data's "
                              f"{self.n_outputs}")
        if eval_draws:
            raise ConfigError("config: model.module draws random numbers in evaluation mode; edgefed evaluates "
                              "the deterministic model: make its randomness depend on self.training")

    @staticmethod
    def _refuse_global_draws(before: tuple, when: str, prefix: str = "") -> None:
        drew = _drew_from(before)
        if drew is not None:
            raise ConfigError(f"{prefix}model.module draws from {drew} in {when}: nothing seeds it per device, so "
                              "two identical runs would differ; draw with torch (torch.rand, nn.Dropout), whose "
                              "generator edgefed seeds from the device's stream, and only in training")

    @contextmanager
    def _deterministic(self, when: str):
        """Around a call of the module's own code: refused if it drew from a global generator meanwhile."""
        before = _global_generators()
        yield
        self._refuse_global_draws(before, when)

    def _forward(self, x, what: str = "model.module's forward"):
        try:
            return self.module(x)
        except Exception as exc:  # noqa: BLE001 - the user's forward: its error, in one line
            raise ConfigError(f"{what} raised {type(exc).__name__}: {_first_line(exc)}") from None

    def _backward(self, loss, what: str = "model.module's backward") -> None:
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - the user's module: its error, in one line
            raise ConfigError(f"{what} raised {type(exc).__name__}: {_first_line(exc)}") from None

    @property
    def input_shape(self) -> tuple:
        return self.sample_shape

    @property
    def one_lane(self) -> bool:
        """Its devices run one at a time per process: its training draws from torch's process-wide generator."""
        return self.draws

    # -- edgefed's model interface ------------------------------------------------------------------------
    def log_attrs(self) -> dict:
        return {"torch_version": str(self.torch.__version__),  # its bits repeat on this machine and torch build only
                "bits": "repeat on the same machine and torch build; not promised across CPUs (PyTorch's kernels "
                        "choose their own summation order)"}

    def profile_key(self) -> str:
        """A board profile's key: the module file, its factory and the input shape."""
        shape = "x".join(map(str, self.sample_shape))
        return f"torch: {Path(self.path).name}:{self.factory} {shape} -> {self.n_outputs}"

    def initial_params(self) -> np.ndarray:
        return self._init.copy()

    def load_weights(self, weights: dict, source: str) -> None:
        """Start from a state_dict with the module's own names and shapes (its parameters and buffers); the
        first missing, unexpected or mis-shaped tensor is a ConfigError naming it (layers.check_state)."""
        own = self.module.state_dict()
        check_state(weights, {name: (tuple(t.shape), "model.module's state_dict", t.dtype.is_floating_point)
                              for name, t in own.items()}, source, "give the weights of the same module")
        with self.torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(self.torch.from_numpy(np.ascontiguousarray(weights[name])).to(tensor.dtype))
        self._init = self._flat_params()

    def _flat_params(self) -> np.ndarray:
        """The trainable parameters as one vector of the model dtype."""
        return self.torch.cat([p.detach().reshape(-1) for p in self.params]).numpy().astype(self.dtype)

    def _frozen(self) -> list:
        """The module's state beside x: frozen parameters (requires_grad False) and floating-point buffers."""
        trainable = set(self.names)
        return [v for k, v in self.module.state_dict().items() if k not in trainable and v.dtype.is_floating_point]

    @property
    def frozen_values(self) -> np.ndarray:
        parts = [v.detach().reshape(-1).numpy().astype(self.dtype) for v in self._frozen()]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def set_frozen(self, values: np.ndarray) -> None:
        at = 0
        with self.torch.no_grad():
            for v in self._frozen():
                n = v.numel()
                v.copy_(self.torch.from_numpy(np.ascontiguousarray(values[at:at + n])).view(v.shape).to(v.dtype))
                at += n

    def memory_bytes(self, rows: int | None = None) -> int:
        """A clone's module and flat vectors (its parameters, their gradient, two flat copies); what its
        forward passes hold is torch's, and not counted."""
        return 4 * self.n_trainable * self.dtype.itemsize

    def clone(self) -> "TorchModel":
        """Its own module (and workspaces), for a second thread: evaluation while a late worker computes."""
        twin = TorchModel(self.path, self.factory, self.sample_shape, self.n_outputs, self.dtype,
                          copy.deepcopy(self._init_stream), self.loss)
        twin.set_frozen(self.frozen_values)
        twin._init = self._init
        return twin

    def state_dict(self, params: np.ndarray) -> dict[str, np.ndarray]:
        """The module's own state_dict (names and shapes) with these parameters."""
        self._bind(params)
        return {k: v.detach().numpy().copy() for k, v in self.module.state_dict().items()}

    def begin(self, data, rng_state: np.ndarray) -> TorchRun:
        seed = int(rng_state[0] & np.uint64(2**62 - 1))  # the device's stream for this round seeds it
        state = self.torch.Generator().manual_seed(seed).get_state() if self.draws else None
        return TorchRun(rng_state, data.n_train, state)

    def _bind(self, params: np.ndarray) -> None:
        """The module's parameters become views into params (the round's array, updated in place)."""
        if self._bound is params:
            return
        if params.dtype != self.dtype or params.shape != (self.n_trainable,) or not params.flags.c_contiguous:
            raise ValueError(f"params must be a contiguous {self.dtype} vector of {self.n_trainable}")
        flat = self.torch.from_numpy(params)
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            p.data = flat[off:off + int(np.prod(shape))].view(shape)
        self._bound, self._flat = params, flat
        self._addresses = [p.data_ptr() for p in self.params] + [p.grad.data_ptr() for p in self.params]

    def _bind_grads(self) -> None:
        for p, off, shape in zip(self.params, self.offsets, self.shapes):
            p.grad = self._flat_grad[off:off + int(np.prod(shape))].view(shape)

    def _still_bound(self) -> None:
        """After the module ran: its parameters and gradients are still the views edgefed gave them. A forward
        that assigns p.data (or sets gradients to None) would silently train a copy."""
        now = [p.data_ptr() for p in self.params] + [p.grad.data_ptr() if p.grad is not None else 0
                                                     for p in self.params]
        if now != self._addresses:
            i = next(i for i, (a, b) in enumerate(zip(now, self._addresses)) if a != b) % len(self.params)
            raise ConfigError(f"model.module replaced parameter {self.names[i]} (or its gradient) while it ran: "
                              "edgefed holds the parameters as views of one vector; change them in place "
                              "(p.data.clamp_(...)), never assign p.data or zero_grad() in forward")

    def _mode(self, training: bool) -> None:
        """Training or evaluation mode, switched only when it changes (train() walks every submodule)."""
        if self.module.training != training:
            self.module.train(training)

    def _inputs(self, data_x: np.ndarray):
        return self.torch.from_numpy(data_x).view((data_x.shape[0], *self.sample_shape))

    def _targets(self, y: np.ndarray):
        t = self.torch.from_numpy(y)
        return t if self.has_accuracy else t.view((y.shape[0], self.n_outputs))

    def _loss(self, out, target):
        """The batch's mean loss: nn.CrossEntropyLoss's, or nn.MSELoss's (over samples and outputs)."""
        F = self.torch.nn.functional
        return F.cross_entropy(out, target) if self.has_accuracy else F.mse_loss(out, target)

    def _sample_losses(self, out, target):
        """Each sample's loss (mse: the mean over its outputs), whose mean is _loss."""
        if self.has_accuracy:
            return self.torch.nn.functional.cross_entropy(out, target, reduction="none")
        return ((out - target) ** 2).mean(dim=1)

    def _training_loss(self, out, target):
        """Backward through the batch's mean loss; returns each sample's loss, detached (the report's
        squared losses). Cross-entropy's per-sample losses averaged give nn.CrossEntropyLoss's gradient to
        the bit; mse keeps nn.MSELoss for its gradient (averaging per-sample means rounds otherwise)."""
        if self.has_accuracy:
            losses = self._sample_losses(out, target)
            self._backward(losses.mean())
            return losses.detach()
        self._backward(self._loss(out, target))
        return self._sample_losses(out.detach(), target)

    def _rng_bytes(self) -> bytes:
        return self.torch.get_rng_state().numpy().tobytes()

    def _train_on(self, run: TorchRun, work) -> None:
        """work() in training mode: the module's randomness from the device's torch state (carried on), or,
        for a module that drew nothing when checked, a check that it still draws nothing."""
        torch = self.torch
        self._mode(True)
        if self.draws:
            torch.set_rng_state(run.torch_state)
        else:
            before = self._rng_bytes()
        with self._deterministic("training"):
            work()
        if self.draws:
            run.torch_state = torch.get_rng_state()
        elif self._rng_bytes() != before:
            raise ConfigError("model.module drew random numbers in training although its first forward drew none: "
                              "edgefed seeds a module's randomness only when every training forward draws")
        self._still_bound()

    def _gradient(self, xb, yb) -> None:
        """flat_grad += d(mean loss)/d(params) of one batch."""
        self._backward(self._loss(self._forward(xb), yb))

    def local_steps(self, params, data, run: TorchRun, n_steps: int, batch_size, lr: float, terms=None) -> int:
        """n_steps of minibatch SGD on params in place (batch_size None: the full batch), each step's gradient
        plus the algorithm's terms (kernels/sgd.py's step_terms: correction, anchor, mu)."""
        torch = self.torch
        self._bind(params)
        X, y = self._inputs(data.X_train), self._targets(data.y_train)
        n = X.shape[0]
        b = n if batch_size is None else min(int(batch_size), n)
        correction = anchor = None
        mu = 0.0
        if terms is not None:
            correction = torch.from_numpy(terms[0]) if terms[0].shape[0] else None
            anchor = torch.from_numpy(terms[1]) if terms[1].shape[0] else None
            mu = float(terms[2][0])
        index = torch.from_numpy(run.perm)
        y_flat, g, grad = self._flat, self._g, self._flat_grad
        squares = torch.zeros((), dtype=torch.float64)
        report = self.report_losses

        def steps():
            for _ in range(int(n_steps)):
                if b < n:
                    draw_batch(run.rng, run.perm, n, b)
                rows = index[:b]
                grad.zero_()
                xb, yb = X.index_select(0, rows), y.index_select(0, rows)
                if report:
                    losses = self._training_loss(self._forward(xb), yb)
                else:
                    self._gradient(xb, yb)
                with torch.no_grad():
                    step = grad
                    if anchor is not None:  # as apply_step: g = grad + mu (y - anchor), then + correction
                        torch.sub(y_flat, anchor, out=g)
                        g.mul_(mu).add_(grad)
                        step = g
                    if correction is not None:
                        torch.add(step, correction, out=g)
                        step = g
                    y_flat.add_(step, alpha=-lr)
                    if report:
                        squares.add_(torch.dot(losses, losses))

        self._train_on(run, steps)
        if report:
            run.loss_sq += float(squares)
            run.samples += int(n_steps) * b
        return int(n_steps)

    def oracle_grad(self, params, data, run: TorchRun, batch_size, grad_out) -> None:
        """grad_out <- one stochastic gradient: a minibatch drawn from run (None: the full gradient)."""
        if batch_size is None:
            self.loss_grad(params, data, grad_out)
            return
        torch = self.torch
        self._bind(params)
        X, y = self._inputs(data.X_train), self._targets(data.y_train)
        n = X.shape[0]
        b = min(int(batch_size), n)
        if b < n:
            draw_batch(run.rng, run.perm, n, b)
        rows = torch.from_numpy(run.perm[:b])
        self._flat_grad.zero_()
        self._train_on(run, lambda: self._gradient(X.index_select(0, rows), y.index_select(0, rows)))
        grad_out[:] = self._flat_grad.numpy()

    def loss_grad(self, params, data, grad_out: np.ndarray) -> float:
        """Mean training loss and its full gradient, in chunks, the module in evaluation mode (dropout off:
        the model's deterministic objective)."""
        self._bind(params)
        X, y = self._inputs(data.X_train), self._targets(data.y_train)
        n = X.shape[0]
        self._mode(False)
        self._flat_grad.zero_()
        total = 0.0
        with self._deterministic("evaluation"):
            for start in range(0, n, EVAL_CHUNK):
                xb, yb = X[start:start + EVAL_CHUNK], y[start:start + EVAL_CHUNK]
                losses = self._sample_losses(self._forward(xb), yb)
                self._backward(losses.sum() / n)
                total += float(losses.detach().double().sum())
        self._still_bound()
        grad_out[:] = self._flat_grad.numpy()
        return total / n

    def loss_correct(self, params, X: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        """(sum of per-sample losses, correct predictions; mse: 0), the module in evaluation mode."""
        torch = self.torch
        if X.shape[0] == 0:
            return 0.0, 0
        self._bind(params)
        Xt, yt = self._inputs(np.ascontiguousarray(X)), self._targets(np.ascontiguousarray(y))
        self._mode(False)
        total, correct = 0.0, 0
        with torch.no_grad(), self._deterministic("evaluation"):
            for start in range(0, Xt.shape[0], EVAL_CHUNK):
                out = self._forward(Xt[start:start + EVAL_CHUNK]).double()
                target = yt[start:start + EVAL_CHUNK]
                if self.has_accuracy:
                    if int(target.min()) < 0 or int(target.max()) >= self.n_outputs:
                        raise ValueError(f"labels must lie in [0, {self.n_outputs})")
                    correct += int((out.argmax(dim=1) == target).sum())
                else:
                    target = target.double()
                total += float(self._sample_losses(out, target).sum())
        self._still_bound()
        return total, correct

    def train_loss(self, params, data) -> float:
        return self.loss_correct(params, data.X_train, data.y_train)[0] / data.n_train

    def outputs(self, params, X: np.ndarray) -> np.ndarray:
        torch = self.torch
        self._bind(params)
        self._mode(False)
        with torch.no_grad(), self._deterministic("evaluation"):
            return self._forward(self._inputs(np.ascontiguousarray(X))).numpy().astype(self.dtype)
