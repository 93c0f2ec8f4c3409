"""A labelled pool of samples from a dataset file, spread over N devices: what the `arrays`, `leaf` and `cifar`
readers share.

A reader (a `Source`) says how many samples there are, their shape, their labels (or float targets) and,
for a natural partition, each sample's device; it reads the rows asked for. The problem partitions the
training pool by labels only (partition.py, or the source's own devices), gives each device a share of the
test pool (IID, or the source's own per-device test samples), and reads a device's samples only when the
device is built, in one pass for every device this process hosts: a rank holds only its own devices'
samples. Samples reach the models flat, in PyTorch's (C, H, W) order, normalized in the model dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgefed.errors import ConfigError, ProblemFileError, reading
from edgefed.problems.data import ClassificationData
from edgefed.problems.partition import MIN_SAMPLES, PARTITIONS, describe_partition, partition
from edgefed.rng import Purpose, generator

NORMALIZE = ("none", "standard", "unit")
# round keys of the (seed, DATA_DEVICE) streams this module draws from (partition.py uses 1, 2, 3, and 4 for
# an IID split of held-out images, as here; the dirichlet partition's redraws have a purpose of their own)
TEST_SPLIT, HOLDOUT = 4, 5
BLOCK_BYTES = 1 << 26  # rows read at a time when the whole training set is scanned (64 MB)


@dataclass
class Source:
    """What a dataset file holds: labels in memory, samples read on demand."""

    name: str  # for messages: the file or folder
    sample_shape: tuple
    y_train: np.ndarray  # int64 labels, or float64 targets (n, width)
    y_test: np.ndarray | None  # None: no test samples in the file
    device_train: np.ndarray | None = None  # natural partition: each training sample's device
    device_test: np.ndarray | None = None  # ... and each test sample's (LEAF's per-user test sets)
    device_names: tuple = ()  # natural partition: the devices' names (LEAF's users)
    finite_checked = False  # the reader itself refuses NaN and infinity (or its samples are integers)
    integer = False  # its samples are integers (token ids, when the model's first layer is an embedding)
    text = None  # (task, vocabulary size) when the reader itself turns text into token ids (LEAF's text)
    n_classes = None  # fixed by the dataset (CIFAR); None: data.classes, else the largest label + 1
    ranges = {}  # part -> (N, 2) each device's rows [start, stop) (a compact file's natural partition)
    random_access = False  # a device's rows are read alone at little cost (else every hosted device at once)
    stats = None  # (shift, scale) per channel of normalize = "standard", when the source holds them (a shard)
    shard_of = None  # a shard's (shard.py): the identity of the whole it is of

    def __post_init__(self):
        if not all(self.sample_shape):  # (a shape with a 0 in it: nothing for a model to read)
            raise ProblemFileError(f"{self.name}: its samples have shape {tuple(self.sample_shape)}, no values; give "
                                   "samples of at least one value each")

    def read(self, part: str, rows: np.ndarray) -> np.ndarray:
        """Samples rows (ascending, unique) of part ("train" or "test"), shaped (len(rows), *sample_shape)."""
        raise NotImplementedError

    def blocks(self, part: str = "train"):
        """A part's samples in order, a block of rows at a time (for statistics and checks)."""
        y = self.y_train if part == "train" else self.y_test
        n = 0 if y is None else y.shape[0]
        step = max(1, BLOCK_BYTES // (8 * max(1, int(np.prod(self.sample_shape)))))
        for start in range(0, n, step):
            yield start, self.read(part, np.arange(start, min(start + step, n)))


class RowRanges(Sequence):
    """Each device's rows, [start, stop) of a table (N, 2), made arrays only when asked: a compact file's
    natural partition holds 3.5 million rows as 1,150 pairs."""

    def __init__(self, table: np.ndarray):
        self.table = np.asarray(table, np.int64)

    def __len__(self) -> int:
        return self.table.shape[0]

    def __getitem__(self, k) -> np.ndarray:
        lo, hi = self.table[k]
        return np.arange(lo, hi)

    @property
    def sizes(self) -> np.ndarray:
        return self.table[:, 1] - self.table[:, 0]


def check_labels(y: np.ndarray, n_classes: int | None, where: str, classes_key: str = "data.classes") -> np.ndarray:
    """Integer labels in [0, C) as int32 (what a device's are cast to int64 from: millions of labels are held
    by every process); C from data.classes when given."""
    if y.ndim != 1:
        raise ConfigError(f"{where} has shape {y.shape}; give one integer label per sample, shape (n,) (float "
                          'targets of any width go with model.loss = "mse")')
    if y.dtype.kind == "f":
        if not np.all(np.isfinite(y)) or not np.all(y == np.round(y)):
            raise ConfigError(f"{where} holds labels that are not integers; give int labels for cross-entropy, or "
                              'set model.loss = "mse" for float targets')
    elif y.dtype.kind not in "iub":
        raise ConfigError(f"{where} has labels of type {y.dtype}; give integer labels")
    if y.size and y.min() < 0:
        raise ConfigError(f"{where} has the label {int(y.min())}; labels run from 0 to the classes - 1")
    if n_classes is not None and y.size and y.max() >= n_classes:
        raise ConfigError(f"{where} has the label {int(y.max())}, outside [0, {n_classes}) ({classes_key} = "
                          f"{n_classes}); raise {classes_key} or fix the labels")
    if y.size and y.max() >= 2 ** 31:
        raise ConfigError(f"{where} has the label {int(y.max())}; labels run from 0 to the classes - 1")
    return y.astype(np.int32)


class PoolProblem:
    """A dataset file's samples over N devices (N = data.clients, or the source's natural devices)."""

    has_test = True
    classes_note = ""  # why the classes are as many as they are, when the test set decides it

    def __init__(self, cfg, seed: int, dtype: np.dtype, source: Source, loss: str, title: str, spatial: int = 0,
                 tokens: int | None = None, builtin: str | None = None):
        """spatial: the dimensions of the model's first spatial layer (2, 1, or 0 for none), which says whether
        a 2-D sample is one channel (H, W) or C channels (C, L) for the statistics of normalize = "standard";
        tokens: the vocabulary of the model's first layer when it is an embedding (its samples are then token
        ids, read as they are and checked to lie in [0, tokens)); builtin: the built-in model whose embedding
        that is (its vocabulary is not a key), None for a layer list."""
        self.cfg, self.seed, self.dtype, self.source, self.title = cfg, seed, np.dtype(dtype), source, title
        self.sample_shape = tuple(source.sample_shape)
        self.n_features = int(np.prod(self.sample_shape))
        self.regression = loss == "mse"
        y_train, y_test = source.y_train, source.y_test
        if self.regression:
            if y_train.dtype.kind not in "fiu":
                raise ConfigError(f"{source.name}: model.loss = \"mse\" needs numeric targets, found {y_train.dtype}")
            y_train = _as_targets(y_train)
            y_test = None if y_test is None else _as_targets(y_test)
            if y_test is not None and y_test.shape[1] != y_train.shape[1]:
                raise ConfigError(f"{source.name}: y_test has {y_test.shape[1]} target values per sample but y_train "
                                  f"{y_train.shape[1]}; give both the same width")
            self.n_classes, self.n_outputs = None, y_train.shape[1]
        else:
            classes = cfg.classes or source.n_classes
            y_train = check_labels(y_train, classes, f"{source.name}: y_train")
            y_test = None if y_test is None else check_labels(y_test, classes, f"{source.name}: y_test")
            found = int(y_train.max(initial=-1)) + 1
            if classes is None and y_test is not None and y_test.size and int(y_test.max()) >= found:
                # a class only the test set has: valid (a LEAF user's), or a wrong test label; said, not refused
                self.classes_note = (f"the largest label, {int(y_test.max())}, is y_test's; y_train's run 0.."
                                     f"{found - 1}: fix y_test if it is wrong")
                found = int(y_test.max()) + 1
            self.n_classes = self.n_outputs = classes or found
        self.y_train, self.y_test = y_train, y_test
        train_parts, test_parts = self._partition()
        self.n_devices = len(train_parts)
        self.train_rows, self.test_rows = train_parts, test_parts
        self.n_train = (train_parts.sizes if isinstance(train_parts, RowRanges) else
                        np.array([p.size for p in train_parts], dtype=np.int64))
        self.channels = channels_of(self.sample_shape, spatial)
        self.text = source.text
        if tokens is not None:
            self._check_tokens(tokens, builtin)
        self._shift, self._scale = self._normalization()
        self._cache, self._read, self._hosted = {}, set(), None

    # -- the partition -----------------------------------------------------------------------------------
    def _partition(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        cfg, src = self.cfg, self.source
        kind = cfg.partition
        self.partition_draws = None  # the dirichlet partition's draws (1: the first fitted)
        if kind == "natural":
            if src.device_train is None and "train" not in src.ranges:
                raise ConfigError(f'config: data.partition = "natural" needs each training sample\'s device: '
                                  f"{src.name} has no device_train; add it or choose one of {', '.join(PARTITIONS)}")
            if "train" in src.ranges:  # each device's rows stored: no pass over every sample's device
                ids = np.arange(src.ranges["train"].shape[0])
            else:
                ids, device = np.unique(src.device_train, return_inverse=True)  # the distinct ids, ascending: 0..
            found = ids.size
            n = cfg.clients or found
            if n > found:
                raise ConfigError(f"config: data.clients = {n} but {src.name} has {found} devices (natural "
                                  f"partition); use at most {found}")
            if "train" in src.ranges:
                parts = RowRanges(src.ranges["train"][:n])
            else:
                order = np.argsort(device, kind="stable")
                cuts = np.searchsorted(device[order], np.arange(1, n + 1))
                parts = [np.sort(p) for p in np.split(order, cuts)[:n]]
            small = [k for k, p in enumerate(parts) if p.size < (1 if self.y_test is not None else 2)]
            if small:
                k = small[0]
                named = f"user {src.device_names[ids[k]]!r}" if src.device_names else f"device_train id {ids[k]}"
                raise ConfigError(f"{src.name}: device {k} ({named}) has {parts[k].size} training "
                                  "samples (natural partition); every device needs at least one to train"
                                  + ("" if self.y_test is not None else " and one to test"))
        else:
            if self.regression and kind != "iid":
                raise ConfigError(f'config: data.partition = {kind!r} splits by label; with model.loss = "mse" use '
                                  '"iid" or "natural"')
            n = cfg.clients
            labels = self.y_train if not self.regression else np.zeros(self.y_train.shape[0], np.int64)
            if labels.size < MIN_SAMPLES * n:  # not the partition's fault: too few samples for any partition
                fix = (f"use at most {labels.size // MIN_SAMPLES} devices (data.clients) or give more samples"
                       if labels.size >= MIN_SAMPLES else "give more samples")
                need = "a device needs" if n == 1 else f"{n} devices need"
                raise ConfigError(f"{src.name}: x_train holds {labels.size} samples, but {need} at least {MIN_SAMPLES} "
                                  f"each; {fix}")
            parts, self.partition_draws = partition(kind, labels, n, self.seed, self.n_classes or 1,
                                                    cfg.dirichlet_alpha, min_size=cfg.min_partition_size)
        if self.y_test is None:  # no test samples in the file: each device holds out a share of its own
            return self._holdout(parts)
        if "test" in src.ranges and kind == "natural":
            tests = RowRanges(src.ranges["test"][:len(parts)])
        elif src.device_test is not None and kind == "natural":  # the test rows of each device's id
            tests = [np.flatnonzero(src.device_test == ids[k]) for k in range(len(parts))]
        else:
            order = generator(self.seed, Purpose.DATA_DEVICE, TEST_SPLIT).permutation(self.y_test.shape[0])
            tests = [np.sort(p) for p in np.array_split(order, len(parts))]
        return parts, tests

    def _holdout(self, parts):
        """data.test_fraction of each device's samples (a seeded draw, at least one) held out for testing."""
        trains, tests = [], []
        for k, rows in enumerate(parts):
            if rows.size < 2:
                raise ConfigError(f"{self.source.name}: device {k} has {rows.size} sample; with no test set in the "
                                  "file each device needs two (one to train, one to test)")
            shuffled = rows[generator(self.seed, Purpose.DATA_DEVICE, HOLDOUT, k).permutation(rows.size)]
            n_test = min(max(int(math.ceil(self.cfg.test_fraction * rows.size)), 1), rows.size - 1)
            trains.append(np.sort(shuffled[n_test:]))
            tests.append(np.sort(shuffled[:n_test]))
        self.y_test = self.y_train  # the held-out rows are training rows
        return trains, tests

    def _check_tokens(self, num: int, builtin: str | None) -> None:
        """Token ids: integers, read as they are, each in [0, num); the first that is not is named by its
        device and sample, before anything is written (the kernels index by them unchecked)."""
        if builtin is None:
            takes, more = "the embedding's num", "raise the embedding's num"
        else:  # no key sets a built-in model's vocabulary
            takes = f'the ids model.kind = "{builtin}" takes'
            more = 'use a layer list (model.kind = "sequential") whose embedding\'s num covers them'

        src = self.source
        if not src.integer:
            raise ConfigError(f"{src.name}: the samples are not integers, but the model's first layer is an "
                              "embedding, which takes token ids; store x_train (and x_test) as integers")
        if self.cfg.normalize != "none":
            raise ConfigError(f"config: data.normalize = {self.cfg.normalize!r} would change the token ids an "
                              'embedding takes; set data.normalize = "none"')
        if src.text is not None:  # ids the reader made: in [0, its vocabulary), no need to read them again
            task, vocabulary = src.text
            if vocabulary > num:
                fix = (f"give the embedding num = {vocabulary}" if builtin is None else
                       f'model.kind = "{builtin}" takes {num} ids; use a layer list (model.kind = "sequential") '
                       f"whose embedding has num = {vocabulary}")
                raise ConfigError(f"{src.name}: {task}'s ids run to {vocabulary - 1}, beyond the model's {num}; {fix}")
            return
        parts = ("train", "test") if src.y_test is not None else ("train",)
        for part in parts:
            for start, block in src.blocks(part):
                values = block.reshape(block.shape[0], -1)
                bad = (values < 0) | (values >= num)
                if bad.any():
                    row = start + int(np.flatnonzero(bad.any(axis=1))[0])
                    value = int(values[row - start][bad[row - start]][0])
                    raise ConfigError(f"{src.name}: {self._sample_name(part, row)} holds the token id {value}, "
                                      f"outside [0, {num}) ({takes}); fix the ids, or {more}")

    def _sample_name(self, part: str, row: int) -> str:
        """A row of x_train or x_test in words: whose sample it is, and which."""
        held_out = part == "train" and self.source.y_test is None  # test samples held out of x_train
        for what, owners in (("training", self.train_rows if part == "train" else ()),
                             ("test", self.test_rows if part == "test" or held_out else ())):
            for k, rows in enumerate(owners):
                at = int(np.searchsorted(rows, row))
                if at < rows.size and rows[at] == row:
                    name = f" (user {self.source.device_names[k]!r})" if self.source.device_names else ""
                    return f"device {k}{name}'s {what} sample {at} (row {row} of x_{part})"
        return f"row {row} of x_{part}"

    # -- normalization -----------------------------------------------------------------------------------
    def _normalization(self):
        """(shift, scale) per channel (or feature) broadcast over a sample, or None: x' = (x - shift) / scale.
        "standard" takes them from one pass over the whole training set (per block NumPy sums in float64,
        the blocks merged in row order by Chan et al.'s update, which does not cancel as E[x^2] - mean^2
        would). The same pass refuses NaN or infinity in x_train and x_test before anything is written."""
        how = self.cfg.normalize
        scan = not self.source.finite_checked
        if how != "standard" and not scan:
            return (None, 255.0) if how == "unit" else (None, None)
        if how == "standard" and self.source.shard_of is not None:  # (a shard cannot scan the training set)
            if self.source.stats is None or self.source.stats[0].size != self.channels:
                raise ProblemFileError(f"{self.source.path} is a shard made for another normalization (or model "
                                       "input); make the boards' shards again: launch/pi-cluster.sh data BOARDS CONFIG")
            return tuple(v.reshape(self.channels, 1) for v in self.source.stats)
        channels, per = self.channels, self.n_features // self.channels
        count, mean, m2 = 0, np.zeros(channels), np.zeros(channels)
        for part in ("train", "test") if scan else ("train",):
            for start, block in self.source.blocks(part):
                values = block.reshape(block.shape[0], channels, per).astype(np.float64)
                bad = ~np.isfinite(values)
                if bad.any():
                    row = start + int(np.flatnonzero(bad.any(axis=(1, 2)))[0])
                    raise ConfigError(f"{self.source.name}: x_{part} row {row} holds NaN or infinity; clean the "
                                      "data (edgefed trains on finite values only)")
                if how == "standard" and part == "train":
                    n_b = values.shape[0] * per
                    mean_b = values.mean(axis=(0, 2))
                    m2_b = np.square(values - mean_b[None, :, None]).sum(axis=(0, 2))
                    delta, total = mean_b - mean, count + n_b
                    mean, m2 = mean + delta * (n_b / total), m2 + m2_b + delta * delta * (count * n_b / total)
                    count = total
        if how != "standard":
            return (None, 255.0) if how == "unit" else (None, None)
        std = np.sqrt(m2 / max(count, 1))
        std[std == 0] = 1.0
        shape = (channels, 1)
        return mean.reshape(shape), std.reshape(shape)

    def _normalized(self, raw: np.ndarray) -> np.ndarray:
        """Flat rows in the model dtype, normalized."""
        n, per = raw.shape[0], self.n_features // self.channels  # (no -1: a device may read 0 rows)
        if self._shift is None and self._scale is None:
            return np.ascontiguousarray(raw.reshape(n, self.n_features), dtype=self.dtype)
        if self._shift is None:  # "unit": as the MNIST reader, in the model dtype
            flat = np.ascontiguousarray(raw.reshape(n, self.n_features), dtype=self.dtype)
            return flat / self.dtype.type(self._scale)
        x = (raw.reshape(n, self.channels, per).astype(np.float64) - self._shift) / self._scale
        return np.ascontiguousarray(x.reshape(n, self.n_features), dtype=self.dtype)

    # -- devices -----------------------------------------------------------------------------------------
    def host(self, device_ids) -> None:
        """The devices this process will build: their samples are read in one pass."""
        self._hosted = np.asarray(device_ids, dtype=np.int64)

    def _labels(self, y, rows):
        return y[rows].astype(self.dtype if self.regression else np.int64)

    def _load(self, device_ids) -> None:
        want = {"train": np.unique(np.concatenate([self.train_rows[k] for k in device_ids] + [np.zeros(0, np.int64)])),
                "test": np.unique(np.concatenate([self.test_rows[k] for k in device_ids] + [np.zeros(0, np.int64)]))}
        part_test = "train" if self.source.y_test is None else "test"  # held-out rows come from the training set
        read = {"train": (want["train"], self._normalized(self.source.read("train", want["train"])))}
        if part_test == "test":
            read["test"] = (want["test"], self._normalized(self.source.read("test", want["test"])))
        else:
            rows = np.union1d(want["train"], want["test"])
            read["train"] = read["test"] = (rows, self._normalized(self.source.read("train", rows)))
        for k in device_ids:
            arrays = []
            for part, rows_k in (("train", self.train_rows[k]), ("test", self.test_rows[k])):
                rows, values = read[part]  # (one device read alone: its rows are all that was read, as they are)
                arrays.append(values if rows.size == rows_k.size else
                              np.ascontiguousarray(values[np.searchsorted(rows, rows_k)]))
            self._cache[int(k)] = ClassificationData(arrays[0], self._labels(self.y_train, self.train_rows[k]),
                                                     arrays[1], self._labels(self.y_test, self.test_rows[k]))

    def device(self, device_id: int) -> ClassificationData:
        """One device's data; from a source read whole at a time, the first call reads every hosted device's
        samples in one pass."""
        k = int(device_id)
        if k not in self._cache:
            hosted = self._hosted if self._hosted is not None else np.arange(self.n_devices)
            todo = [] if self.source.random_access else [int(j) for j in hosted if int(j) not in self._read]
            batch = todo if k in todo else [k]
            with reading(self.source.name):
                self._load(batch)
            self._read.update(batch)
        return self._cache.pop(k)

    def device_bytes(self, device_ids=None) -> np.ndarray:
        """What each device's data (of device_ids; None: every device) takes once built: its samples in the
        model dtype, its labels."""
        n_test = self.test_rows.sizes if isinstance(self.test_rows, RowRanges) else np.array(
            [r.size for r in self.test_rows], np.int64)
        label = self.n_outputs * self.dtype.itemsize if self.regression else 8
        sizes = (self.n_train + n_test) * (self.n_features * self.dtype.itemsize + label)
        return sizes if device_ids is None else sizes[np.asarray(device_ids, np.int64)]

    def input_normalization(self) -> tuple | None:
        """(shift, scale) per channel the samples were normalized by, x' = (x - shift) / scale (None: as read)."""
        if self._shift is None and self._scale is None:
            return None
        if self._shift is None:
            return np.zeros(1), np.full(1, self._scale)
        return self._shift.reshape(-1), self._scale.reshape(-1)

    def label_counts(self) -> np.ndarray | None:
        """(N, C) int64: each device's training labels (None for float targets)."""
        if self.regression:
            return None
        return np.stack([np.bincount(self.y_train[rows], minlength=self.n_classes) for rows in self.train_rows])

    def describe(self) -> str:
        n_test = int(self.test_rows.sizes.sum()) if isinstance(self.test_rows, RowRanges) else sum(
            r.size for r in self.test_rows)
        shape = "x".join(map(str, self.sample_shape))
        what = f"{self.n_outputs}-value targets" if self.regression else f"{self.n_classes} classes"
        what += f" ({self.classes_note})" if self.classes_note else ""
        how = describe_partition(self.cfg.partition, self.cfg.dirichlet_alpha, self.partition_draws,
                                 self.cfg.min_partition_size)
        return (f"{self.title} ({how}): {self.n_devices} devices, {int(self.n_train.sum())} training "
                f"samples of {shape} (per device {int(self.n_train.min())}..{int(self.n_train.max())}), {what}, "
                f"{n_test} for testing")


def channels_of(sample_shape: tuple, spatial: int) -> int:
    """The channels normalization takes statistics over: the first axis of a (C, H, W) sample, of a 2-D one
    read as (C, L) by a 1-D layer (else it is one channel, (H, W)), every feature of a vector."""
    if len(sample_shape) == 1:
        return int(sample_shape[0])
    if len(sample_shape) == 2 and spatial != 1:
        return 1
    return int(sample_shape[0])


def _as_targets(y: np.ndarray) -> np.ndarray:
    y = np.asarray(y, np.float64)
    y = y.reshape(y.shape[0], -1)
    if not np.all(np.isfinite(y)):
        raise ConfigError("the targets hold NaN or infinity; clean the data")
    return y
