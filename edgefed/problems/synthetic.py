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

from edgefed.ids import find
from edgefed.problems.data import PARETO_DEFAULT_MAX, PARETO_INDEX, ClassificationData
from edgefed.kernels.first_draws import LOGNORMAL, PARETO, first_draws
from edgefed.rng import Purpose, device_generators, generator, stream_words

N_FEATURES = 60
N_CLASSES = 10
UNCAPPED = 2 ** 62  # a count no device reaches (a lognormal draw past it is a normal draw past 20)
SIZE_BLOCK = 1 << 20  # devices whose sizes are drawn at once where all are not kept
EAGER_LABELS_UP_TO = 10_000  # devices whose labels are counted before round 1; beyond, as each is built
_SIGMA_SQRT = np.arange(1, N_FEATURES + 1, dtype=np.float64) ** (-1.2 / 2)


def total_samples(cfg, seed: int, device_ids: np.ndarray) -> np.ndarray:
    """int64: samples (train + test) of each of these devices, one draw from each device's own stream (the
    first draws of all their streams in one kernel pass; the ~1 % the ziggurat's first try rejects drawn by
    NumPy)."""
    device_ids = np.asarray(device_ids, np.int64)
    if not isinstance(cfg.samples, str):
        return np.full(device_ids.size, int(cfg.samples), np.int64)
    lognormal = cfg.samples == "lognormal"
    draws = np.empty(device_ids.size, np.float64)
    done = np.empty(device_ids.size, np.bool_)
    first_draws(stream_words(seed, Purpose.DATA_COUNT), device_ids, LOGNORMAL if lognormal else PARETO, 4.0,
                2.0 if lognormal else PARETO_INDEX, draws, done, np.zeros(4, np.uint64), np.zeros(4, np.uint64))
    rejected = np.flatnonzero(~done)
    for i, (_, g) in zip(rejected, device_generators(seed, Purpose.DATA_COUNT, device_ids[rejected])):
        draws[i] = g.lognormal(4.0, 2.0) if lognormal else g.pareto(PARETO_INDEX)
    # capped while a float, since an int64 cast of a draw past 2^63 would wrap: min(int(x), c) = int(min(x, c))
    # for an integer c >= 0
    if lognormal:  # int(draw) + 50, at most samples_max
        cap = UNCAPPED if cfg.samples_max is None else cfg.samples_max - 50
        return np.minimum(draws, float(cap)).astype(np.int64) + 50
    # numpy's pareto is Lomax: shifted for Type I
    cap = cfg.samples_max or PARETO_DEFAULT_MAX
    return np.minimum(cfg.samples_min * (1.0 + draws), float(cap)).astype(np.int64)


def _label_counts(y: np.ndarray) -> np.ndarray:
    return np.bincount(y, minlength=N_CLASSES)


def split_train(n_total: np.ndarray, test_fraction: float) -> np.ndarray:
    """Training samples out of each n_total; at least one of each part."""
    n_total = np.asarray(n_total, np.int64)
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
        self._all = None  # (n_total, n_train) of every device, drawn when first asked for
        self._hosted = None  # (ids, their n_total): a process that builds some devices alone draws theirs alone
        self._largest = None  # the most training samples a device has, once found without drawing every size

    @property
    def n_total(self) -> np.ndarray:
        """(N,) each device's samples, train and test."""
        return self._sizes()[0]

    @property
    def n_train(self) -> np.ndarray:
        """(N,) each device's training samples."""
        return self._sizes()[1]

    def _sizes(self):
        if self._all is None:
            total = total_samples(self.cfg, self.seed, np.arange(self.n_devices))
            self._all = (total, split_train(total, self.cfg.test_fraction))
        return self._all

    def host(self, device_ids) -> None:
        """The devices this process builds (a device rank's): their counts alone are drawn, so that a rank of a
        large federation holds no array of every device."""
        ids = np.asarray(device_ids, np.int64)
        if ids.size > 1 and not (ids[1:] > ids[:-1]).all():  # (a rank's share is ascending already)
            ids = np.unique(ids)
        if self._all is None and (self._hosted is None or not np.array_equal(self._hosted[0], ids)):
            self._hosted = (ids, total_samples(self.cfg, self.seed, ids))

    def largest_train(self) -> int:
        """The most training samples a device has: from every size when they are drawn, else drawn a block at
        a time and let go (a device rank holds its own devices' sizes alone)."""
        if self._all is not None or self._hosted is None:
            return int(np.max(self.n_train, initial=1))
        if self._largest is None:
            self._largest = 1
            for start in range(0, self.n_devices, SIZE_BLOCK):
                block = total_samples(self.cfg, self.seed, np.arange(start, min(start + SIZE_BLOCK, self.n_devices)))
                self._largest = max(self._largest, int(split_train(block, self.cfg.test_fraction).max()))
        return self._largest

    def totals(self, device_ids) -> np.ndarray:
        """These devices' samples, train and test (from the hosted devices' where they are among them)."""
        ids = np.asarray(device_ids, np.int64)
        if self._all is not None or self._hosted is None:
            return self.n_total[ids]
        hosted, totals = self._hosted
        at, found = find(hosted, ids)
        if found.all():
            return totals[at]
        return total_samples(self.cfg, self.seed, ids)  # (a device another process hosts: drawn alone)

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
        n = int(self.totals([device_id])[0])
        X = v + g.standard_normal((n, N_FEATURES)) * _SIGMA_SQRT
        y = np.argmax(X @ W + b, axis=1)  # softmax is monotone: argmax of the logits is the argmax
        return X, y.astype(np.int64)

    def device(self, device_id: int) -> ClassificationData:
        X, y = self.generate(device_id)
        X = X.astype(self.dtype)
        k = int(split_train(X.shape[:1], self.cfg.test_fraction)[0])
        return ClassificationData(
            np.ascontiguousarray(X[:k]), y[:k].copy(), np.ascontiguousarray(X[k:]), y[k:].copy()
        )

    n_classes = N_CLASSES

    @property
    def labels_later(self) -> bool:
        """Whether /devices/label_counts is filled as devices are built (-1 before) rather than at the start:
        counting needs every device's samples generated, about 0.8 ms a device here (80 s at 10^5 devices)."""
        return self.n_devices > EAGER_LABELS_UP_TO

    def device_bytes(self, device_ids=None) -> np.ndarray:
        """What each device's data (of device_ids; None: every device) takes once built (features in the model
        dtype, int64 labels)."""
        totals = self.n_total if device_ids is None else self.totals(device_ids)
        return totals.astype(np.int64) * (N_FEATURES * np.dtype(self.dtype).itemsize + 8)

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
