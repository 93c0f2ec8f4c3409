"""The compact arrays file: what `edgefed data convert` writes and what a LEAF folder is read through.

It is an arrays `.h5` (arrays.py reads it like any other, `[data] kind = "arrays"`) with what a run needs to
read only its own devices and to run as a run on the source would:

- `x_train`, `x_test`: samples in the smallest type that holds them exactly (token ids and pixels as uint8
  where they fit; numbers k/255 as uint8 with the root attribute `x_scale` = 255), chunked by rows (about
  64 KB a chunk), so a rank reads the chunks of its devices' rows and no others;
- `y_train`, `y_test`: labels in the smallest integer type;
- `device_train`, `device_test`: each sample's device (a natural partition: LEAF's users), and
  `device_rows_train`, `device_rows_test` (N, 2): each device's rows [start, stop), when they are contiguous;
- `users`: the devices' names; `vocabulary`: Sent140's words, ids 2.. in order;
- root attributes: `format` = "edgefed-arrays", `format_version`, `source` (what it was converted from),
  `title` (how a run describes it), and the defaults of its kind: `partition`, `normalize`, `classes`,
  `text_task` and `token_ids` (the ids an embedding over the samples needs: no scan of them at start-up).

The file is written beside its path and swapped in whole: a conversion that fails leaves nothing, one that is
killed a copy named after its process, which the next conversion beside it removes.
"""

from __future__ import annotations

import functools
import os
import uuid
from pathlib import Path

import h5py
import numpy as np

from edgefed.errors import ProblemFileError

FORMAT = "edgefed-arrays"
FORMAT_VERSION = 1
CHUNK_BYTES = 64 * 1024
PARTS = ("train", "test")


def smallest_int(low: int, high: int) -> np.dtype:
    """The smallest integer type holding [low, high]."""
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64) if low >= 0 else ():
        if high <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        if np.iinfo(dtype).min <= low and high <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


# how numbers are stored, narrowest first (not nested: uint8/255 holds k/255, uint8 and float32 do not)
NUMBERS = ("uint8", "uint8/255", "float32", "float64")


def exact(values: np.ndarray, kind: str) -> bool:
    """Whether NUMBERS kind gives every one of these float64 values back to the bit."""
    if not values.size or kind == "float64":
        return True
    with np.errstate(invalid="ignore", over="ignore"):
        if kind == "uint8":
            return bool(values.min() >= 0 and values.max() <= 255 and np.array_equal(np.round(values), values))
        if kind == "uint8/255":
            return bool(values.min() >= 0 and values.max() <= 1 and np.array_equal(np.round(values * 255) / 255, values))
        return bool(np.array_equal(values.astype(np.float32).astype(np.float64), values))


def numbers_kind(values: np.ndarray) -> str:
    """The narrowest of NUMBERS that holds these float64 values exactly."""
    return next(kind for kind in NUMBERS if exact(values, kind))


# which kinds hold everything a kind holds, given the largest value stored so far
def _holds(old: str, new: str, high: float) -> bool:
    if old == new or new == "float64":
        return True
    return {("uint8", "float32"): True, ("uint8", "uint8/255"): high <= 1}.get((old, new), False)


def stored(values: np.ndarray, kind: str) -> np.ndarray:
    """float64 values as NUMBERS kind stores them."""
    if kind == "uint8":
        return values.astype(np.uint8)
    if kind == "uint8/255":
        return np.round(values * 255).astype(np.uint8)
    return values.astype(np.float32 if kind == "float32" else np.float64)


def _as_float64(block: np.ndarray, kind: str) -> np.ndarray:
    return block.astype(np.float64) / 255 if kind == "uint8/255" else block.astype(np.float64)


class CompactWriter:
    """Appends samples part by part (a device's block at a time, or any block) and writes the file whole at
    `finish`. Samples are ids (their dtype given: ids_dtype) or numbers, whose storage widens as needed (the rows
    written so far are rewritten once in the wider type)."""

    def __init__(self, path: Path, sample_shape: tuple, ids_dtype=None):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.sample_shape = tuple(int(s) for s in sample_shape)
        self.kind = None if ids_dtype is None else "ids"
        self.x_dtype = None if ids_dtype is None else np.dtype(ids_dtype)
        self._f = h5py.File(self.tmp, "w")
        self._x = {}
        self.rows = {part: 0 for part in PARTS}
        self._y = {part: [] for part in PARTS}
        self._ranges = {part: {} for part in PARTS}  # key -> [start, stop)
        self._high = 0.0  # the largest number stored so far

    def _dataset(self, part: str, dtype: np.dtype):
        name = f"x_{part}"
        if name not in self._x:
            per_row = max(1, int(np.prod(self.sample_shape)) * dtype.itemsize)
            rows = max(1, CHUNK_BYTES // per_row)
            self._x[name] = self._f.create_dataset(name, (0, *self.sample_shape), dtype=dtype,
                                                   maxshape=(None, *self.sample_shape), chunks=(rows, *self.sample_shape))
        return self._x[name]

    def add(self, part: str, x: np.ndarray, y: np.ndarray, key=None) -> None:
        """Rows x (n, *sample_shape) with labels y; key: whose rows they are (a LEAF user), for the devices'
        row ranges."""
        n = int(x.shape[0])
        if self.kind == "ids":
            block = x.astype(self.x_dtype)
        else:  # the narrowest kind that holds this block and what is stored already
            kind = next(k for k in NUMBERS if exact(x, k) and (self.kind is None or _holds(self.kind, k, self._high)))
            if self.kind is not None and kind != self.kind:
                self._widen(kind)
            self.kind = kind
            self._high = max(self._high, float(x.max(initial=0.0)))
            block = stored(x, self.kind)
        ds = self._dataset(part, block.dtype)
        start = self.rows[part]
        ds.resize(start + n, axis=0)
        if n:
            ds[start:start + n] = block
        self.rows[part] = start + n
        self._y[part].append(np.asarray(y))
        if key is not None:
            ranges = self._ranges[part]
            if key in ranges and ranges[key][1] != start:
                raise RuntimeError(f"rows of {key!r} added apart")  # (a device's rows are one run: callers add them so)
            ranges.setdefault(key, [start, start])[1] = start + n

    def _widen(self, kind: str) -> None:
        """Numbers stored so far rewritten in the wider kind."""
        old = self.kind
        self._rewrite(stored(np.zeros(1), kind).dtype, lambda block: stored(_as_float64(block, old), kind))

    def remap(self, table: np.ndarray) -> None:
        """Ids rewritten through table (id -> new id), in the smallest type that holds the new ids: Sent140's
        words, counted while written, given their ids once the vocabulary is known."""
        self.x_dtype = smallest_int(0, int(table.max(initial=0)))
        self._rewrite(self.x_dtype, lambda block: table[block])

    def _rewrite(self, dtype, convert) -> None:
        """Every sample written so far as convert(block) in dtype, a few chunks at a time."""
        for name in list(self._x):
            ds = self._x.pop(name)
            data = self._f.create_dataset(f"{name}.new", ds.shape, dtype=dtype, maxshape=(None, *self.sample_shape),
                                          chunks=ds.chunks)
            step = ds.chunks[0] * 16
            for first in range(0, ds.shape[0], step):
                data[first:first + step] = convert(ds[first:first + step])
            del self._f[name]
            self._f.move(f"{name}.new", name)
            self._x[name] = self._f[name]

    def labels(self, part: str) -> np.ndarray:
        blocks = self._y[part]
        return np.concatenate(blocks) if blocks else np.zeros(0, np.int64)

    def finish(self, attrs: dict, keys=None, devices: dict | None = None, vocabulary=None,
               has_test: bool = False) -> None:
        """Write labels, devices and attributes, then swap the file into place. keys: the keys of add(), in
        device order (device k's rows are those added with keys[k]; stored as `users`); devices: part -> (n,)
        device ids instead (an arrays file's own device_train); has_test: write the test part even if empty."""
        f = self._f
        numbers = stored(np.zeros(1), self.kind or NUMBERS[0]).dtype
        for part in PARTS if has_test or self.rows["test"] else ("train",):
            self._dataset(part, self.x_dtype if self.kind == "ids" else numbers)
            y = self.labels(part)
            if y.dtype.kind in "iu" and y.size:
                y = y.astype(smallest_int(int(y.min()), int(y.max())))
            f.create_dataset(f"y_{part}", data=y)
            if keys is not None:
                ranges = np.zeros((len(keys), 2), np.int64)
                device = np.full(self.rows[part], -1, np.int32)
                for k, key in enumerate(keys):
                    lo, hi = self._ranges[part].get(key, (0, 0))
                    ranges[k] = (lo, hi)
                    device[lo:hi] = k
                f.create_dataset(f"device_{part}", data=device, chunks=True)
                f.create_dataset(f"device_rows_{part}", data=ranges)
        ids = np.unique(devices["train"]) if devices and "train" in devices else None
        for part, values in (devices or {}).items():  # an arrays file's own: ranges where each device's rows run
            values = np.asarray(values)
            f.create_dataset(f"device_{part}", data=values.astype(smallest_int(0, int(values.max(initial=0)))),
                             chunks=True)
            table = None if ids is None else _runs(values, ids)
            if table is not None:
                f.create_dataset(f"device_rows_{part}", data=table)
        if keys is not None:
            f.create_dataset("users", data=np.asarray([str(k) for k in keys], dtype=h5py.string_dtype()))
        if vocabulary is not None:
            f.create_dataset("vocabulary", data=np.asarray(list(vocabulary), dtype=h5py.string_dtype()))
        f.attrs["format"], f.attrs["format_version"] = FORMAT, FORMAT_VERSION
        f.attrs["made"] = uuid.uuid4().hex  # which making of the file (its shards must be of the same)
        if self.kind == "uint8/255":
            f.attrs["x_scale"] = 255.0
        if self.kind not in (None, "ids"):
            f.attrs["x_numbers"] = True  # (numbers stored as integers: not token ids)
        for key, value in attrs.items():
            if value is not None:
                f.attrs[key] = value
        f.close()
        try:
            os.replace(self.tmp, self.path)
        except OSError as exc:
            self.discard()
            raise ProblemFileError(f"cannot write {self.path} ({exc}); choose another OUT") from None

    def discard(self) -> None:
        if self._f.id.valid:
            self._f.close()
        self.tmp.unlink(missing_ok=True)


def _runs(values: np.ndarray, ids: np.ndarray) -> np.ndarray | None:
    """(len(ids), 2): the rows [start, stop) of each id when each id's rows are one run (no rows: (0, 0));
    None when some id's rows are not."""
    table = np.zeros((ids.size, 2), np.int64)
    if not values.size:
        return table
    cuts = np.flatnonzero(np.diff(values)) + 1
    starts, stops = np.concatenate([[0], cuts]), np.concatenate([cuts, [values.size]])
    runs = values[starts]
    if np.unique(runs).size != runs.size or not np.isin(runs, ids).all():
        return None
    at = np.searchsorted(ids, runs)
    table[at, 0], table[at, 1] = starts, stops
    return table


@functools.lru_cache(maxsize=16)
def _stamped_defaults(path: str, stamp: tuple) -> dict:
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                return {}
            return {key: f.attrs[key].item() if hasattr(f.attrs[key], "item") else f.attrs[key]
                    for key in ("partition", "normalize", "model", "text_task", "title") if key in f.attrs}
    except (OSError, KeyError):
        return {}


def defaults(path) -> dict:
    """A compact file's own defaults (partition, normalize, model, text_task, title), read from its attributes
    ({} for any other file): what a config that leaves those keys unset gets."""
    p = Path(path)
    if p.suffix not in (".h5", ".hdf5") or not p.is_file():
        return {}
    st = p.stat()
    return _stamped_defaults(str(p.resolve()), (st.st_size, st.st_mtime_ns))
