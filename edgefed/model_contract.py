"""The model contract: what the engine, the transports, the run and its log ask of every model (`Model`),
and of a model trained on samples (`Classifier`). Sequential, Quadratic (models.py) and TorchModel
(torchmodel.py) declare it; what only some models can do is a declared value with the common answer, so
nothing above asks a model what it is."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class LocalRun:
    """Workspace of one device's local work in one round: its generator state and minibatch permutation, and
    what its steps report of their losses: the sum of the squared losses of the samples trained on, and how
    many (a sample drawn twice counts twice)."""

    def __init__(self, rng_state: np.ndarray, n_samples: int):
        self.rng = rng_state
        self.perm = np.arange(n_samples, dtype=np.int64)
        self.loss_sq, self.samples = 0.0, 0


class Model(Protocol):
    """Parameters are a flat vector x of `dtype` (`n_trainable` values); `begin` opens a device's local
    work from its generator state and `local_steps` continues it chunk by chunk (the deadline runner's)."""

    kind: str  # what the config, the log and the board profiles call it
    dtype: np.dtype
    n_trainable: int
    prefix_end: int = 0  # the last program operation of a frozen prefix whose outputs are the devices' samples (0: none)
    one_lane: bool = False  # training draws from a process-wide generator: one device at a time per process
    vocabulary: int = 0  # its samples are token ids below this (0: values)
    report_losses: bool = True  # local_steps fills run.loss_sq (a model may skip the cost when told False)

    def initial_params(self) -> np.ndarray:
        """x_0: a new copy of the trainable values the run starts from."""

    @property
    def frozen_values(self) -> np.ndarray:
        """The values beside x that never train (frozen tensors, buffers), as the log keeps them (empty: none)."""

    def memory_bytes(self, rows: int | None = None) -> int:
        """What one more copy (clone) holds for minibatches of `rows` samples (None: those it was built for,
        train.batch_size or its largest device's)."""

    def clone(self) -> Model:
        """The same model with workspaces of its own (another lane's)."""

    def begin(self, data, rng_state: np.ndarray) -> LocalRun:
        ...

    def local_steps(self, params: np.ndarray, data, run: LocalRun, n_steps: int, batch_size, lr: float,
                    terms: tuple | None = None) -> int:
        """n_steps of SGD on params in place (terms: an algorithm's additions, kernels/sgd.py); returns the steps."""

    def oracle_grad(self, params: np.ndarray, data, run: LocalRun, batch_size, grad_out: np.ndarray) -> None:
        ...

    def loss_grad(self, params: np.ndarray, data, grad_out: np.ndarray) -> float:
        ...

    def train_loss(self, params: np.ndarray, data) -> float:
        ...

    def compile_kernels(self, data, on_compile=None) -> None:
        """Compile (or load) its kernels ahead of the first round; on_compile(names, dtype) is told first. A
        model whose kernels compile on first use has nothing to do."""

    def profile_key(self) -> str:
        """What a board profile's speed entry names it by."""
        return self.kind

    def log_attrs(self) -> dict:
        """What the run log's attributes say of it beyond its kind."""
        return {}


class Classifier(Model, Protocol):
    """A model trained on samples (ClassificationData): evaluated on its devices' test samples, exported, and
    started from a state_dict."""

    n_outputs: int  # classes, or a regression's target width
    n_features: int  # values a sample as the devices hold it
    has_accuracy: bool  # cross-entropy (False: a regression, its test metric the loss)

    def loss_correct(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        ...

    def outputs(self, params: np.ndarray, X: np.ndarray) -> np.ndarray:
        ...

    def state_dict(self, params: np.ndarray) -> dict[str, np.ndarray]:
        ...

    def load_weights(self, weights: dict, source: str) -> None:
        ...
