"""MNIST / EMNIST over N devices: a partition of the training pool, and an IID share of the test pool each.

With the standard training files in `data.path` the pool is the training set and the test files are held
out; with only the test files (the 10,000-image t10k set) the last `data.holdout` images are held out and
the rest are the training pool. Pixels are scaled to [0, 1] in the model dtype.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgefed.errors import ConfigError
from edgefed.problems.data import PARETO_DEFAULT_MAX, PARETO_INDEX, ClassificationData
import edgefed.problems.idx as idx
from edgefed.problems.partition import describe_partition, partition
from edgefed.rng import Purpose, generator


class ImageProblem:
    has_test = True

    def __init__(self, cfg, seed: int, dtype: np.dtype):
        self.cfg, self.seed, self.dtype = cfg, seed, dtype
        self.n_devices = cfg.clients
        files = idx.dataset_files(cfg.kind, cfg.path, cfg.split)
        self.transpose = cfg.kind == "emnist"
        self.n_classes = 10 if cfg.kind == "mnist" else idx.EMNIST_SPLITS[cfg.split]
        shift = 1 if cfg.kind == "emnist" and cfg.split == "letters" else 0
        if files["train"] is not None:
            self.train_file = files["train"][0]
            train_labels = idx.read_labels(files["train"][1]) - shift
            train_rows = np.arange(train_labels.size)
            if files["test"] is not None:
                self.test_file = files["test"][0]
                test_labels = idx.read_labels(files["test"][1]) - shift
                test_rows = np.arange(test_labels.size)
            else:  # no test files: hold out the end of the training set
                self.test_file, test_rows, test_labels = self._holdout(self.train_file, train_labels)
                train_rows, train_labels = train_rows[: -test_rows.size], train_labels[: -test_rows.size]
        else:
            self.train_file = self.test_file = files["test"][0]
            labels = idx.read_labels(files["test"][1]) - shift
            _, test_rows, test_labels = self._holdout(self.test_file, labels)
            train_rows, train_labels = np.arange(labels.size - test_rows.size), labels[: labels.size - test_rows.size]
        count, height, width = idx.image_count(self.train_file)
        self.n_features = height * width
        self.sample_shape = (1, height, width)
        self.n_outputs = self.n_classes
        if train_labels.min() < 0 or train_labels.max() >= self.n_classes:
            raise ConfigError(f"config: data.split = {cfg.split!r} has {self.n_classes} classes but the labels in "
                              f"{cfg.path} run {train_labels.min()}..{train_labels.max()}; pick the split of the files")
        sizes = self._pareto_sizes(train_rows.size) if cfg.samples == "pareto" else None
        parts, self.partition_draws = partition(cfg.partition, train_labels, self.n_devices, seed, self.n_classes,
                                                cfg.dirichlet_alpha, sizes, cfg.min_partition_size)
        self.train_rows = [train_rows[p] for p in parts]
        self.train_labels = [train_labels[p] for p in parts]
        order = generator(seed, Purpose.DATA_DEVICE, 4).permutation(test_rows.size)
        test_parts = [np.sort(p) for p in np.array_split(order, self.n_devices)]
        self.test_rows = [test_rows[p] for p in test_parts]
        self.test_labels = [test_labels[p] for p in test_parts]
        self.n_train = np.array([r.size for r in self.train_rows], dtype=np.int64)
        self._cache = {}  # devices read in the last pass and not handed out yet
        self._read = set()
        self._hosted = None

    def _holdout(self, path: Path, labels: np.ndarray):
        hold = self.cfg.holdout
        if not 0 < hold < labels.size - 2 * self.n_devices:
            raise ConfigError(f"config: data.holdout = {hold} must leave training data for {self.n_devices} devices "
                              f"out of the {labels.size} images in {path.name}")
        rows = np.arange(labels.size - hold, labels.size)
        return path, rows, labels[rows]

    def _pareto_sizes(self, pool: int) -> np.ndarray:
        cap = self.cfg.samples_max or PARETO_DEFAULT_MAX
        draws = np.array([min(self.cfg.samples_min * (1.0 + generator(self.seed, Purpose.DATA_COUNT, device_id=k)
                                                      .pareto(PARETO_INDEX)), cap) for k in range(self.n_devices)])
        sizes = np.maximum(np.floor(draws / draws.sum() * pool), 2).astype(np.int64)
        return sizes if sizes.sum() <= pool else np.maximum(np.floor(sizes * pool / sizes.sum()), 2).astype(np.int64)

    def host(self, device_ids) -> None:
        """The devices this process will build: their images are read in one pass over each file."""
        self._hosted = np.asarray(device_ids, dtype=np.int64)

    def _load(self, device_ids) -> None:
        want = {}
        for k in device_ids:
            want.setdefault(self.train_file, []).append(self.train_rows[k])
            want.setdefault(self.test_file, []).append(self.test_rows[k])
        images = {}
        for path, parts in want.items():
            rows = np.unique(np.concatenate(parts))
            images[path] = (rows, idx.read_image_rows(path, rows, self.transpose))
        for k in device_ids:
            arrays = []
            for path, rows_k in ((self.train_file, self.train_rows[k]), (self.test_file, self.test_rows[k])):
                rows, pixels = images[path]
                arrays.append(np.ascontiguousarray(pixels[np.searchsorted(rows, rows_k)], dtype=self.dtype) / 255)
            self._cache[int(k)] = ClassificationData(arrays[0].astype(self.dtype), self.train_labels[k].copy(),
                                                     arrays[1].astype(self.dtype), self.test_labels[k].copy())

    def device(self, device_id: int) -> ClassificationData:
        """One device's data; the first call reads every hosted device's images in one pass."""
        k = int(device_id)
        if k not in self._cache:
            hosted = self._hosted if self._hosted is not None else np.arange(self.n_devices)
            todo = [int(j) for j in hosted if int(j) not in self._read]
            self._load(todo if k in todo else [k])
            self._read.update(todo if k in todo else [k])
        return self._cache.pop(k)

    def device_bytes(self, device_ids=None) -> np.ndarray:
        """What each device's data (of device_ids; None: every device) takes once built: its images in the
        model dtype, int64 labels."""
        n_test = np.array([r.size for r in self.test_rows], np.int64)
        sizes = (self.n_train + n_test) * (self.n_features * np.dtype(self.dtype).itemsize + 8)
        return sizes if device_ids is None else sizes[np.asarray(device_ids, np.int64)]

    def input_normalization(self) -> tuple:
        """Pixels scaled to [0, 1]: x' = (x - 0) / 255."""
        return np.zeros(1), np.full(1, 255.0)

    def label_counts(self) -> np.ndarray:
        """(N, C) int64: each device's training labels."""
        return np.stack([np.bincount(labels, minlength=self.n_classes) for labels in self.train_labels])

    def describe(self) -> str:
        name = "MNIST" if self.cfg.kind == "mnist" else f"EMNIST-{self.cfg.split}"
        how = describe_partition(self.cfg.partition, self.cfg.dirichlet_alpha, self.partition_draws,
                                 self.cfg.min_partition_size)
        return (f"{name} ({how}): {self.n_devices} devices, {int(self.n_train.sum())} training images "
                f"(per device {int(self.n_train.min())}..{int(self.n_train.max())}), "
                f"{sum(r.size for r in self.test_rows)} held out")
