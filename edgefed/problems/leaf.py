"""`[data] kind = "leaf"`: LEAF's JSON layout (Caldas et al., 2018), one device per user in file order.

The folder holds `train/` and `test/`, each a set of `*.json` files read in name order; a file is
`{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}`. Samples are numbers
(FEMNIST's 784 pixels in [0, 1], flat: a `reshape` layer to [1, 28, 28] makes them images) and labels
integers. A user's test samples are its own (LEAF splits each user's data); a user with none has none.

JSON must be parsed whole, so a file is read once for the labels and again, by the processes that host its
users, for their samples; only those are kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edgefed.errors import ConfigError, ProblemFileError
from edgefed.problems.pool import PoolProblem, Source


def _load(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProblemFileError(f"{path} cannot be read as LEAF JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("users"), list) or not isinstance(data.get("user_data"),
                                                                                              dict):
        raise ProblemFileError(f"{path} is not a LEAF file: it needs \"users\" and \"user_data\"")
    return data


def _samples(path: Path, user: str, record) -> tuple[list, list]:
    if not isinstance(record, dict) or "x" not in record or "y" not in record:
        raise ProblemFileError(f"{path}: user {user!r} has no \"x\" and \"y\" in user_data")
    x, y = record["x"], record["y"]
    for key, value in (("x", x), ("y", y)):
        if not isinstance(value, list):
            raise ProblemFileError(f"{path}: user {user!r}'s {key} is {type(value).__name__}, not a list (one entry per "
                                   "sample)")
    if len(x) != len(y):
        raise ProblemFileError(f"{path}: user {user!r} has {len(x)} samples in x but {len(y)} labels in y")
    if x and isinstance(x[0], str):
        raise ProblemFileError(f"{path}: user {user!r}'s samples are text or file names ({x[0][:40]!r}); edgefed "
                               "reads numeric LEAF samples (FEMNIST-style): convert them to numbers, or to an arrays "
                               "file with device_train")
    return x, y


def _values(path: Path, user: str, x: list, shape: tuple | None) -> np.ndarray:
    """A user's samples as one float64 array; a sample of another shape (than the user's first, or than
    `shape`, the other users') or of values that are not numbers is refused naming the user and sample."""
    try:
        raw = np.asarray(x)
        if raw.dtype.kind in "iuf":  # (True, None, "1": no sample of numbers, though float64 would take them)
            return _shaped(raw.astype(np.float64), path, user, shape)
    except (ValueError, TypeError):
        pass
    first = None
    for i, sample in enumerate(x):
        try:
            values = np.asarray(sample)
            found = values.shape
            if values.dtype.kind not in "iuf":
                raise TypeError
        except (ValueError, TypeError):
            raise ProblemFileError(f"{path}: user {user!r}: sample {i} is not a list of numbers of one shape; give "
                                   "every sample as numbers") from None
        first = found if first is None else first
        if found != first:
            raise ProblemFileError(f"{path}: user {user!r}: sample {i} has shape {found} but sample 0 has "
                                   f"{first}; give every sample one shape")
    raise ProblemFileError(f"{path}: user {user!r}: the samples cannot be read as numbers")


def _shaped(values: np.ndarray, path: Path, user: str, shape: tuple | None) -> np.ndarray:
    if values.ndim < 1 or (shape is not None and values.shape[1:] != shape):
        raise ProblemFileError(f"{path}: user {user!r} has samples of shape {values.shape[1:]}, others {shape}; "
                               "give every sample one shape")
    return values


class LeafSource(Source):
    def __init__(self, folder: Path):
        self.folder = folder
        self.files = {part: sorted((folder / part).glob("*.json")) for part in ("train", "test")}
        if not self.files["train"]:
            raise ConfigError(f"config: data.path = {str(folder)!r} has no train/*.json; give a LEAF data folder "
                              "(with train/ and test/)")
        users, labels, devices, where, seen_test, empty = [], [], [], {}, set(), set()
        shape = None
        for part in ("train", "test"):
            part_labels, part_devices = [], []
            for i, path in enumerate(self.files[part]):
                data = _load(path)
                for user in data["users"]:
                    x, y = _samples(path, user, data["user_data"].get(user))
                    if part == "train":
                        if user in where or user in empty:
                            raise ProblemFileError(f"{path}: user {user!r} appears twice in train/")
                        if not x:  # nothing to train on: not a device (the run's first line counts them)
                            empty.add(user)
                            continue
                        where[user] = len(users)
                        users.append(user)
                    elif user not in where:
                        continue  # a user with test samples only takes no part
                    elif user in seen_test:
                        raise ProblemFileError(f"{path}: user {user!r} appears twice in test/")
                    else:
                        seen_test.add(user)
                    if x:  # parsed anyway: checked here, before a log is written
                        values = _values(path, user, x, shape)
                        shape = values.shape[1:]
                        if not np.all(np.isfinite(values)):
                            raise ConfigError(f"{path}: user {user!r} has samples with NaN or infinity; clean the "
                                              "data")
                    part_labels += y
                    part_devices += [where[user]] * len(y)
                self.files[part][i] = (path, [u for u in data["users"] if u in where])
            labels.append(np.asarray(part_labels))
            devices.append(np.asarray(part_devices, np.int64))
        if not users:
            raise ConfigError(f"config: data.path = {str(folder)!r}: train/ has no users with samples; give a LEAF "
                              "data folder with users' samples")
        self.note = (f"{len(users) + len(empty)} users, {len(empty)} without samples skipped" if empty
                     else f"{len(users)} users")
        self._first = {}  # (part, device): its first row (a user's rows are contiguous: one entry per file)
        for part, d in zip(("train", "test"), devices):
            ids, first = np.unique(d, return_index=True)
            self._first.update({(part, int(k)): int(i) for k, i in zip(ids, first)})
        super().__init__(str(folder), tuple(shape), labels[0], labels[1] if self.files["test"] else None,
                         devices[0], devices[1], tuple(users))
        self.finite_checked = True

    def read(self, part: str, rows: np.ndarray) -> np.ndarray:
        """Rows of part; a file is parsed again only if one of its users has a row asked for."""
        device = self.device_train if part == "train" else self.device_test
        # rows run user by user in file order, so each user's block is contiguous
        out = np.empty((rows.size, *self.sample_shape))
        wanted = set(int(d) for d in np.unique(device[rows])) if rows.size else set()
        order = {u: k for k, u in enumerate(self.device_names)}
        for path, users in self.files[part]:
            if not any(order[u] in wanted for u in users):
                continue
            data = _load(path)
            for user in users:
                k = order[user]
                if k not in wanted:
                    continue
                x, _ = _samples(path, user, data["user_data"][user])
                values = np.asarray(x, np.float64).reshape(len(x), *self.sample_shape)
                lo = self._first[part, k]
                mine = rows[(rows >= lo) & (rows < lo + len(x))]
                out[np.searchsorted(rows, mine)] = values[mine - lo]
        return out


def leaf_problem(cfg, seed: int, dtype, loss: str, spatial: int = 0) -> PoolProblem:
    folder = Path(cfg.path)
    if not folder.is_dir():
        raise ConfigError(f"config: data.path = {cfg.path!r} is not a folder; give a LEAF data folder (with train/ "
                          "and test/ of *.json files)")
    source = LeafSource(folder)
    return PoolProblem(cfg, seed, dtype, source, loss, f"LEAF {folder.name}, {source.note}", spatial)

