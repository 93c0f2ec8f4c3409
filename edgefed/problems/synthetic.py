"""SYNTHETIC(alpha, beta) exactly as the FedProx generator (Li et al.), one device at a time.

For device k: u_k ~ N(0, alpha^2), B_k ~ N(0, beta^2); v_k in R^60 with entries ~ N(B_k, 1); W_k (60 x 10)
and b_k (10) with entries ~ N(u_k, 1); x ~ N(v_k, Sigma) with Sigma_jj = j^(-1.2) (j = 1..60);
y = argmax softmax(x W_k + b_k). The IID variant shares one W, b ~ N(0, 1) and uses v_k = 0.
Samples per device: FedProx's int(exp N(4, 2)) + 50, a Type-I Pareto (index 0.5, scale samples_min,
capped at samples_max, default 5000, because the index-0.5 law has an infinite mean), or a fixed count.
The first int(0.9 n) samples train (FedProx's split; `test_fraction` changes it), the rest test.
"""

from __future__ import annotations


import numpy as np

from edgefed.problems.data import PARETO_DEFAULT_MAX, PARETO_INDEX, ClassificationData
from edgefed.kernels.first_draws import LOGNORMAL, PARETO, first_draws
from edgefed.rng import Purpose, device_generators, generator, stream_words

N_FEATURES = 60
N_CLASSES = 10
EAGER_LABELS_UP_TO = 10_000  # devices whose labels are counted before round 1; beyond, as each is built
_SIGMA_SQRT = np.arange(1, N_FEATURES + 1, dtype=np.float64) ** (-1.2 / 2)


def total_samples(cfg, seed: int, n_devices: int) -> np.ndarray:
    """(N,) int64: samples (train + test) of each device, one draw from each device's own stream (the first
    draws of all streams in one kernel pass; the ~1 % the ziggurat's first try rejects drawn by NumPy)."""
    if not isinstance(cfg.samples, str):
        return np.full(n_devices, int(cfg.samples), np.int64)
    lognormal = cfg.samples == "lognormal"
    draws = np.empty(n_devices, np.float64)
    done = np.empty(n_devices, np.bool_)
    first_draws(stream_words(seed, Purpose.DATA_COUNT), np.arange(n_devices, dtype=np.int64),
                LOGNORMAL if lognormal else PARETO, 4.0, 2.0 if lognormal else PARETO_INDEX, draws, done,
                np.zeros(4, np.uint64), np.zeros(4, np.uint64))
    for k, g in device_generators(seed, Purpose.DATA_COUNT, np.flatnonzero(~done)):
        draws[k] = g.lognormal(4.0, 2.0) if lognormal else g.pareto(PARETO_INDEX)
    if lognormal:
        cap, counts = cfg.samples_max, draws.astype(np.int64) + 50
    else:
        # numpy's pareto is Lomax: shifted for Type I
        cap, counts = cfg.samples_max or PARETO_DEFAULT_MAX, (cfg.samples_min * (1.0 + draws)).astype(np.int64)
    return counts if cap is None else np.minimum(counts, cap)


def _label_counts(y: np.ndarray) -> np.ndarray:
    return np.bincount(y, minlength=N_CLASSES)


def split_train(n_total: np.ndarray, test_fraction: float) -> np.ndarray:
    """Training samples out of each n_total; at least one of each part."""
    n_train = ((1.0 - test_fraction) * n_total + 1e-9).astype(np.int64)
    return np.minimum(np.maximum(n_train, 1), n_total - 1)


class SyntheticProblem:
    n_features = N_FEATURES
    n_classes = n_outputs = N_CLASSES
    sample_shape = (N_FEATURES,)
    has_test = True

    def __init__(self, cfg, seed: int, dtype: np.dtype):
        self.cfg = cfg
        self.seed = seed
        self.dtype = dtype
        self.n_devices = cfg.clients
        self.n_total = total_samples(cfg, seed, self.n_devices)
        self.n_train = split_train(self.n_total, cfg.test_fraction)

    def _global_model(self):
        g = generator(self.seed, Purpose.DATA_GLOBAL)
        return g.normal(0.0, 1.0, (N_FEATURES, N_CLASSES)), g.normal(0.0, 1.0, N_CLASSES)

    def _device_law(self, g):
        """(v_k, W_k, b_k) of one device, drawn first from its stream."""
        cfg = self.cfg
        u = g.normal(0.0, cfg.alpha)
        big_b = g.normal(0.0, cfg.beta)
        if cfg.iid:
            W, b = self._global_model()
            return np.zeros(N_FEATURES), W, b
        v = g.normal(big_b, 1.0, N_FEATURES)
        W = g.normal(u, 1.0, (N_FEATURES, N_CLASSES))
        b = g.normal(u, 1.0, N_CLASSES)
        return v, W, b

    def device_law(self, device_id: int):
        """(v_k, W_k, b_k): the feature mean and labelling model of one device."""
        return self._device_law(generator(self.seed, Purpose.DATA_DEVICE, device_id=device_id))

    def generate(self, device_id: int):
        """(X, y) of all the device's samples in float64, before the split."""
        g = generator(self.seed, Purpose.DATA_DEVICE, device_id=device_id)
        v, W, b = self._device_law(g)
        n = int(self.n_total[device_id])
        X = v + g.standard_normal((n, N_FEATURES)) * _SIGMA_SQRT
        y = np.argmax(X @ W + b, axis=1)  # softmax is monotone: argmax of the logits is the argmax
        return X, y.astype(np.int64)

    def device(self, device_id: int) -> ClassificationData:
        X, y = self.generate(device_id)
        X = X.astype(self.dtype)
        k = int(self.n_train[device_id])
        return ClassificationData(
            np.ascontiguousarray(X[:k]), y[:k].copy(), np.ascontiguousarray(X[k:]), y[k:].copy()
        )

    n_classes = N_CLASSES

    @property
    def labels_later(self) -> bool:
        """Whether /devices/label_counts is filled as devices are built (-1 before) rather than at the start:
        counting needs every device's samples generated, about 0.8 ms a device here (80 s at 10^5 devices)."""
        return self.n_devices > EAGER_LABELS_UP_TO

    def device_bytes(self) -> np.ndarray:
        """(N,) what each device's data takes once built (features in the model dtype, int64 labels)."""
        return self.n_total.astype(np.int64) * (N_FEATURES * np.dtype(self.dtype).itemsize + 8)

    def labels_of(self, data: ClassificationData) -> np.ndarray:
        return _label_counts(data.y_train)

    def label_counts(self) -> np.ndarray:
        """(N, C) int64: each device's training labels (every device's samples generated once more)."""
        return np.stack([_label_counts(self.generate(k)[1][:int(self.n_train[k])]) for k in range(self.n_devices)])

    def describe(self) -> str:
        kind = "IID " if self.cfg.iid else ""
        return (
            f"{kind}SYNTHETIC({self.cfg.alpha:g},{self.cfg.beta:g}): {self.n_devices} devices, "
            f"{int(self.n_train.sum())} training samples (per device {int(self.n_train.min())}.."
            f"{int(self.n_train.max())})"
        )
