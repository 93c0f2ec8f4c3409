"""`[data] kind = "arrays"`: a user's dataset as one `.npz` or `.h5` file.

Keys: `x_train` (n, ...) and `y_train` (n,) (int labels; float targets for `model.loss = "mse"`, (n,) or
(n, width)), optionally `x_test` and `y_test` (held-out samples of the same shape) and `device_train` (n,)
(the device each training sample belongs to, for `partition = "natural"`). Samples are channels-first:
(C, H, W) images, (C, L) maps, or vectors; (L, F) float sequences for a recurrent first layer; integer
token ids (n, L) for an embedding first.

Only labels are read whole. Samples are read by rows: from `.h5` through h5py (a rank reads only its devices'
rows), from an `.npz` written by `numpy.savez` by mapping the uncompressed member into memory; a compressed
`.npz` (`savez_compressed`) is read whole, once per process.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from edgefed.errors import ConfigError, ProblemFileError
from edgefed.problems.compact import FORMAT
from edgefed.problems.pool import PoolProblem, Source

KEYS = ("x_train", "y_train", "x_test", "y_test", "device_train", "device_test", "users")
SUFFIXES = (".npz", ".h5", ".hdf5")


class ArraysSource(Source):
    """The arrays of one file: labels in memory, samples by rows (memory-mapped or from HDF5). A compact file
    (compact.py, what `edgefed data convert` writes) adds its devices' test samples, names and row ranges,
    and its kind's defaults; name: what messages call it (a LEAF folder read through its converted copy)."""

    def __init__(self, path: Path, name: str | None = None):
        self.path = path
        self._h5 = None
        self.x_scale = None
        self.note, self.title, self.made = "", None, ""
        self.ranges = {}
        self.shard_of, self.shard_rows = None, {}  # a shard (shard.py): the whole's identity, the rows it holds
        if path.suffix in (".h5", ".hdf5"):
            arrays = self._open_h5(path)
        else:
            arrays = self._open_npz(path)
        self.format = self._h5.attrs.get("format") if self._h5 is not None else None
        if self.format == FORMAT and "rows_train" in self._h5:
            self.shard_of = str(self._h5.attrs.get("shard_of", ""))
            self.shard_rows = {part: self._h5[f"rows_{part}"][()] for part in ("train", "test")
                               if f"rows_{part}" in self._h5}
        missing = [k for k in ("x_train", "y_train") if arrays.get(k) is None]
        if missing:
            raise ConfigError(f"{path} has no {missing[0]!r}; an arrays file holds x_train and y_train (and optionally "
                              "x_test, y_test, device_train)")
        self._x = {"train": arrays["x_train"], "test": arrays.get("x_test")}
        if (arrays.get("x_test") is None) != (arrays.get("y_test") is None):
            have, lack = ("x_test", "y_test") if arrays.get("x_test") is not None else ("y_test", "x_test")
            raise ConfigError(f"{path} has {have} but no {lack}; give both or neither")
        x_train, x_test = self._x["train"], self._x["test"]
        if len(x_train.shape) < 2:
            raise ConfigError(f"{path}: x_train has shape {tuple(x_train.shape)}; give one sample per row, "
                              "(n, features) or (n, C, H, W)")
        for key in ("x_train", "x_test"):
            x = arrays.get(key)
            if x is not None and x.dtype.kind not in "fiub":
                raise ConfigError(f"{path}: {key} has values of type {x.dtype}; give numbers")
        y_train = np.asarray(arrays["y_train"][()])
        y_test = None if arrays.get("y_test") is None else np.asarray(arrays["y_test"][()])
        # a compact file's devices' row ranges say whose each row is: its per-row devices are not read
        self.ranges = {part: np.asarray(self._h5[f"device_rows_{part}"][()], np.int64) for part in ("train", "test")
                       if self._h5 is not None and self._h5.attrs.get("format") == FORMAT
                       and f"device_rows_{part}" in self._h5}
        device = None if arrays.get("device_train") is None or "train" in self.ranges else np.asarray(
            arrays["device_train"][()])
        n = x_train.shape[0] if self.shard_of is None else y_train.shape[0]  # (a shard: some rows' samples)
        for key, value in (("y_train", y_train), ("device_train", device)):
            if value is not None and value.shape[:1] != (n,):
                raise ConfigError(f"{path}: {key} has {value.shape[0] if value.ndim else 0} entries but x_train has "
                                  f"{n} samples; give one per sample")
        if x_test is not None:
            if tuple(x_test.shape[1:]) != tuple(x_train.shape[1:]):
                raise ConfigError(f"{path}: x_test samples are {tuple(x_test.shape[1:])} but x_train's are "
                                  f"{tuple(x_train.shape[1:])}; give both the same shape")
            if self.shard_of is None and y_test.shape[:1] != (x_test.shape[0],):
                raise ConfigError(f"{path}: y_test has {y_test.shape[0] if y_test.ndim else 0} entries but x_test has "
                                  f"{x_test.shape[0]} samples; give one per sample")
        if device is not None:
            if device.dtype.kind not in "iu" or (device.size and device.min() < 0):
                raise ConfigError(f"{path}: device_train must hold device ids (integers >= 0)")
            device = device.astype(np.int64)
        device_test = None if arrays.get("device_test") is None or "test" in self.ranges else np.asarray(
            arrays["device_test"][()])
        if device_test is not None:
            if (device is None and "train" not in self.ranges) or device_test.dtype.kind not in "iu" or (device_test.size and device_test.min() < 0) \
                    or device_test.shape[:1] != (0 if y_test is None else y_test.shape[0],):
                raise ConfigError(f"{path}: device_test must hold, beside device_train, each test sample's device id "
                                  "(integers >= 0, one per x_test row)")
            device_test = device_test.astype(np.int64)
        names = () if arrays.get("users") is None else tuple(u.decode() if isinstance(u, bytes) else str(u)
                                                             for u in arrays["users"][()])
        super().__init__(name or str(path), tuple(int(s) for s in x_train.shape[1:]), y_train, y_test, device,
                         device_test, names)
        self.x_dtype = x_train.dtype
        self.finite_checked = all(x is None or x.dtype.kind in "iub" for x in (x_train, x_test))  # no NaN in ints
        self.integer = all(x is None or x.dtype.kind in "iu" for x in (x_train, x_test))
        self.random_access = self._h5 is not None or isinstance(x_train, np.memmap)
        if self._h5 is not None and self._h5.attrs.get("format") == FORMAT:
            self._compact(self._h5.attrs)

    def _compact(self, attrs) -> None:
        """What a compact file says of itself (compact.py): its scale, its kind's classes and text."""
        if "x_scale" in attrs:
            self.x_scale = float(attrs["x_scale"])
        if attrs.get("x_numbers"):
            self.integer = False
        self.finite_checked = True  # (the conversion refused NaN and infinity)
        self.note = str(attrs.get("note", ""))
        self.made = str(attrs.get("made", ""))
        self.title = str(attrs["title"]) if "title" in attrs else None
        if "classes" in attrs:
            self.n_classes = int(attrs["classes"])
        task = attrs.get("text_task")
        if "token_ids" in attrs:  # ids the conversion (or the shard's maker) found: in [0, token_ids)
            self.text = (f"LEAF {str(task).capitalize()}" if task is not None else "x_train", int(attrs["token_ids"]))
        if "standard_shift" in attrs:  # a shard: the whole training set's statistics, which it cannot scan
            self.stats = (np.asarray(attrs["standard_shift"], np.float64), np.asarray(attrs["standard_scale"], np.float64))

    def _open_h5(self, path: Path) -> dict:
        import h5py

        try:
            self._h5 = h5py.File(path, "r")
        except OSError as exc:
            raise ProblemFileError(f"{path} cannot be read as HDF5 ({exc}); give an .h5 file with x_train and "
                                   "y_train") from None
        arrays = {}
        for key in KEYS:
            try:
                if key in self._h5:
                    arrays[key] = self._h5[key]
            except (KeyError, OSError) as exc:  # e.g. an external link to a file that is not there
                raise ProblemFileError(f"{path}: {key} cannot be opened ({exc}); store it in the file itself") from None
        for key, value in arrays.items():
            if not isinstance(value, h5py.Dataset):
                raise ProblemFileError(f"{path}: {key} is a {type(value).__name__.lower()}, not a dataset; store "
                                       f"{key} as one array (f[{key!r}] = array)")
        return arrays

    @staticmethod
    def _open_npz(path: Path) -> dict:
        if not zipfile.is_zipfile(path):  # (np.load would try it as a pickle, and advise allow_pickle)
            try:
                with open(path, "rb") as f:
                    head = f.read(16)
            except OSError as exc:
                raise ProblemFileError(f"{path} cannot be read ({exc})") from None
            raise ProblemFileError(f"{path} is not an .npz file (a zip of arrays, as numpy.savez writes it): it starts "
                                   f"with {head!r}; write x_train and y_train with numpy.savez")
        try:
            archive = np.load(path, allow_pickle=False)
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise ProblemFileError(f"{path} cannot be read as .npz ({exc}); write it with numpy.savez") from None
        out = {}
        with archive:
            for key in KEYS:
                if key not in archive.files:
                    continue
                mapped = _map_member(path, key + ".npy")
                try:
                    out[key] = mapped if mapped is not None else archive[key]
                except ValueError as exc:
                    raise ProblemFileError(f"{path}: {key} cannot be read ({exc}); write plain arrays with "
                                           "numpy.savez") from None
        return out

    def read(self, part: str, rows: np.ndarray) -> np.ndarray:
        x = self._x[part]
        if self._h5 is None:
            return np.asarray(x[rows])
        if self.shard_of is not None:  # the shard's own rows of these rows of the whole
            held = self.shard_rows[part]  # (searched in its own type: no copy of it the size of the shard)
            beyond = rows.size and (not held.size or rows[-1] > held[-1])  # (before the cast could wrap it)
            at = np.minimum(np.searchsorted(held, rows.astype(held.dtype)), max(held.size - 1, 0))
            if rows.size and (beyond or not np.array_equal(held[at], rows)):
                raise ProblemFileError(f"{self.path} holds no x_{part} row {int(rows[~np.isin(rows, held)][0])}: a "
                                       "device this shard was not made for; make the boards' shards again")
            rows = at
        out = np.empty((rows.size, *x.shape[1:]), x.dtype)
        if self.x_scale is not None:  # numbers stored as k / x_scale: their float64 values, to the bit
            return self._read_into(x, rows, out).astype(np.float64) / self.x_scale
        return self._read_into(x, rows, out)

    @staticmethod
    def _read_into(x, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        # HDF5 reads a contiguous run of rows at once; the runs of the asked rows, one read each
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1
        at = 0
        for run in np.split(rows, cuts):
            if run.size:
                x.read_direct(out, np.s_[int(run[0]):int(run[-1]) + 1], np.s_[at:at + run.size])
                at += run.size
        return out


def _map_member(path: Path, member: str):
    """An uncompressed .npz member as a read-only memory map (None: compressed, or not mappable)."""
    try:
        with zipfile.ZipFile(path) as zf:
            info = zf.getinfo(member)
            if info.compress_type != zipfile.ZIP_STORED:
                return None
            with open(path, "rb") as raw:
                raw.seek(info.header_offset)
                header = raw.read(30)
                name_len, extra_len = int.from_bytes(header[26:28], "little"), int.from_bytes(header[28:30], "little")
                start = info.header_offset + 30 + name_len + extra_len
                raw.seek(start)
                version = np.lib.format.read_magic(raw)
                if version not in ((1, 0), (2, 0)):
                    return None
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, fortran, dtype = read_header(raw)
                offset = raw.tell()
        if fortran or dtype.hasobject:
            return None
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
    except (KeyError, ValueError, OSError):
        return None


def arrays_problem(cfg, seed: int, dtype, loss: str, spatial: int = 0, tokens: int | None = None,
                   builtin: str | None = None, shard=None) -> PoolProblem:
    if shard is not None:  # a device rank's shard of data.path (shard.py)
        source = ArraysSource(shard_file(shard, cfg.path), name=str(cfg.path))
        return PoolProblem(cfg, seed, dtype, source, loss, source.title or Path(cfg.path).name, spatial, tokens,
                           builtin)
    path = Path(cfg.path)
    if not path.is_file():
        raise ConfigError(f"config: data.path = {cfg.path!r} is not a file; give the .npz or .h5 file of your "
                          "arrays (x_train, y_train, optionally x_test, y_test, device_train)")
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"config: data.path = {cfg.path!r}: an arrays file ends in .npz or .h5")
    source = ArraysSource(path)
    return PoolProblem(cfg, seed, dtype, source, loss, source.title or path.name, spatial, tokens, builtin)


def shard_file(shard, path) -> Path:
    shard = Path(shard)
    if not shard.is_file():
        raise ConfigError(f"config: data.shards: this board has no shard {shard} of {path}; make and copy the boards' "
                          "shards with launch/pi-cluster.sh data BOARDS CONFIG")
    return shard
