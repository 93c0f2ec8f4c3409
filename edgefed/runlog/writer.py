"""Writing a run log: its skeleton, a resume point copied into a fresh file, and a round at a time with the
state a resume needs (slots alternating, per-device rows behind an undo copy, the round marker last)."""

from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import numpy as np

try:
    import resource  # POSIX: RLIMIT_FSIZE
except ImportError:  # pragma: no cover - Windows
    resource = None

from edgefed.algorithms.base import DeviceRows
from edgefed.errors import ResourceError
from edgefed.memory import size_text
import edgefed.runlog.schema as schema
from edgefed.runlog.files import _swap_in, _write_restarts
from edgefed.runlog.reader import ResumePoint
from edgefed.runlog.rows import Scattered, SparseRounds, _write_row, read_rows, write_rows, write_sparse_row
from edgefed.runlog.schema import EVALUATED, FROZEN, Header, _chunk, _root_attrs, columns

class RunLogWriter:
    """Appends one round at a time to an open log; flushes after every round."""

    def __init__(self, path: Path, f: h5py.File, header: Header):
        self.path = path
        self._f = f
        cols = columns(header.n_devices, header.dim, header.dtype) + header.extra_columns
        self._cols = {c.path: (f[c.path], np.dtype(c.dtype), tuple(c.row_shape)) for c in cols}
        self._fill = {c.path: c.fill for c in cols if schema.sparse_rows(tuple(c.row_shape))}
        self._rows = {name: ds.shape[0] for name, (ds, _, _) in self._cols.items()}
        self._state_ds = {}
        self._row_names = [name for name, _, _ in header.row_states]
        # the most one round can add to the file: a new chunk of every column, plus room for HDF5's own index
        self._round_bytes = sum(int(np.prod(ds.chunks)) * dtype.itemsize for ds, dtype, _ in self._cols.values())
        self._round_bytes += 1 << 20
        # a device's first change of a per-device state allocates its row's chunk, and the undo copy's
        self._row_bytes = 2 * sum(int(np.prod(shape[1:])) * np.dtype(dtype).itemsize for _, shape, dtype in header.row_states)

    def ensure_room(self, rows: int = 0) -> None:
        """Before a round is written: refuse, with the log intact at the last round, when the disk (or the
        process's file-size limit) cannot take what the round may add (rows: the devices whose per-device
        state it may change). HDF5 does not fail cleanly on a full disk (a wall of errors, then often a
        crash), so the round is never started there."""
        try:
            free = shutil.disk_usage(self.path.parent).free
            size = self.path.stat().st_size
        except OSError:
            return
        room = free
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0] if resource is not None else None
        if limit is not None and limit != resource.RLIM_INFINITY:
            room = min(free, limit - size)
        need = self._round_bytes + rows * self._row_bytes
        if room < need:
            raise ResourceError(f"the disk holding run log {self.path} is full ({size_text(max(room, 0))} left, a round "
                                f"may need {size_text(need)}); free space or move the log, then "
                                f"edgefed run --resume {self.path}")

    # -- creation ------------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path, header: Header, resume: ResumePoint | None = None) -> "RunLogWriter":
        """Build the log beside `path`, then swap it in: an existing file is replaced only by a whole log.

        With a resume point the new file holds its completed rounds and its resume state before the swap,
        so a resume that fails at any moment leaves a log that can still be resumed.
        """
        path = Path(path)

        def fill(f):
            _write_skeleton(f, header)
            if resume is not None:
                _write_resume_point(f, resume)

        _swap_in(path, fill)
        f = h5py.File(path, "r+", libver=schema.LIBVER)
        f.swmr_mode = True
        return cls(path, f, header)

    # -- writing -------------------------------------------------------------------------------------
    def append(self, values: dict) -> None:
        """Append one row to each named dataset.

        h5py's low-level calls: the high-level `resize` + `ds[n] = row` costs ~0.3 ms per dataset, which
        would dominate a simulated round of a small model.
        """
        for name, value in values.items():
            ds, dtype, row_shape = self._cols[name]
            n = self._rows[name]
            ds.id.set_extent((n + 1,) + row_shape)
            if name in self._fill:
                write_sparse_row(ds, n, value, dtype, self._fill[name])
            else:
                _write_row(ds, n, value.dense(dtype) if isinstance(value, Scattered) else value, dtype, row_shape)
            self._rows[name] = n + 1

    def amend(self, name: str, value) -> None:
        """Rewrite the last row appended to a dataset (before the round's commit, as the rest of it)."""
        ds, dtype, row_shape = self._cols[name]
        _write_row(ds, self._rows[name] - 1, value, dtype, row_shape)

    def fill_rows(self, name: str, ids: np.ndarray, values: np.ndarray) -> None:
        """Write these (ascending) rows of a per-device dataset, e.g. /devices/label_counts as devices are
        built."""
        write_rows(self._f[name], ids, values)

    def set_rows(self, name: str, rows: DeviceRows) -> None:
        """Write a per-device state's stored rows (at the start, before round 0's checkpoint); the others
        keep the dataset's fill, zero, and take no room in the file."""
        write_rows(self._state(name), rows.ids, rows.rows)

    def rows(self, name: str) -> np.ndarray:
        """Every device's row of a per-device state ((N, d): [log] client_controls stores it whole)."""
        return self._state(name)[()]

    def read_rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """These devices' rows of a per-device state (ascending ids)."""
        return read_rows(self._state(name), ids)

    def stage(self, round_idx: int, slots: dict, row_deltas: dict | None = None, row_sets: dict | None = None) -> None:
        """Write round_idx's resume state: slot vectors, and per-device rows behind an undo copy.

        `row_deltas` maps a row state to (ascending device ids, deltas added to those rows); `row_sets` to
        (ascending device ids, new rows), e.g. the control a device gets when it arrives. The undo copy holds
        the rows of every device any of them changes. Nothing is the resume point until `commit`.
        """
        names = sorted(set(row_deltas or {}) | set(row_sets or {}))
        if names:  # every row state is staged (unchanged ones too), so a roll back restores each consistently
            names = sorted(set(names) | set(self._row_names))
            empty = np.zeros(0, np.int64)
            ids = empty
            for name in names:
                for given in ((row_deltas or {}).get(name), (row_sets or {}).get(name)):
                    if given is not None:
                        ids = np.union1d(ids, given[0])
            ids = ids.astype(np.int64)
            changes = {}
            for name in names:
                d_ids, deltas = (row_deltas or {}).get(name, (empty, None))
                s_ids, rows = (row_sets or {}).get(name, (empty, None))
                old = read_rows(self._state(name), ids) if ids.size else None
                new = None
                if ids.size:  # a fresh row first, then the round's Delta on top (an arriving device reports too)
                    new = old.copy()
                    if s_ids.size:
                        new[np.searchsorted(ids, s_ids)] = rows
                    if d_ids.size:
                        at = np.searchsorted(ids, d_ids)
                        new[at] = new[at] + deltas
                changes[name] = (ids, old, new)
            _write_row(self._state("undo/count"), 0, ids.size, np.int64)
            if ids.size:
                self._state("undo/ids")[: ids.size] = ids
                for name, (_, old, _) in changes.items():
                    self._state(f"undo/{name}")[: ids.size] = old
            _write_row(self._state("undo/round"), 0, round_idx, np.int64)
            self._f.flush()
            for name, (ids, _, new) in changes.items():
                if ids.size:
                    write_rows(self._state(name), ids, new)
        for name, value in slots.items():
            ds = self._state(name)
            _write_row(ds, round_idx % 2, value, ds.dtype)

    def _state(self, name: str) -> h5py.Dataset:
        ds = self._state_ds.get(name)
        if ds is None:
            ds = self._state_ds[name] = self._f[f"state/{name}"]
        return ds

    def commit(self, round_idx: int) -> None:
        """Flush everything staged and appended, then mark round_idx complete: the marker goes last."""
        self._f.flush()
        _write_row(self._state("round"), 0, round_idx, np.int64)
        self._f.flush()

    def close(self, final_attrs: dict | None = None) -> None:
        if self._f.id.valid:
            self._f.close()
        if final_attrs:
            # Attributes cannot change under SWMR; reopen normally once the writer is gone.
            # without HDF5's file lock: a reader watching the log (it holds a shared lock) must not fail the run
            with h5py.File(self.path, "r+", libver=schema.LIBVER, locking=False) as f:
                for key, value in final_attrs.items():
                    f.attrs[key] = value


def _write_resume_point(f: h5py.File, point: ResumePoint) -> None:
    """Copy a resume point (completed rounds, state, marker) into a fresh, not yet swapped-in log."""
    for name, data in point.logged.items():
        ds = f[name]
        ds.resize(data.shape[0], axis=0)
        if isinstance(data, SparseRounds):  # a large federation's: each round's written values, where they were
            for r in range(data.shape[0]):
                write_sparse_row(ds, r, Scattered(data.n, data.ids[r], data.values[r], data.fill), ds.dtype,
                                 data.fill)
        elif data.shape[0]:
            ds[...] = data

    def pad(name, obj):  # a column the resumed log's version did not write: its completed rounds hold the fill
        if isinstance(obj, h5py.Dataset) and "rows" in obj.attrs and name not in point.logged and point.limits:
            obj.resize(point.limits[obj.attrs["rows"]], axis=0)

    f.visititems(pad)
    slots = f["state"].attrs["slots"].split(",")
    for name, value in point.state.items():
        if name in slots:
            f[f"state/{name}"][point.rounds_done % 2] = value
        else:  # a per-device state: its stored rows
            write_rows(f[f"state/{name}"], value.ids, value.rows)
    f["state/round"][0] = point.rounds_done


def _write_skeleton(f: h5py.File, header: Header) -> None:
    attrs = {
        **_root_attrs(header.config_toml, "running"),
        "seed": header.seed,
        "rounds": header.rounds,
        "n_devices": header.n_devices,
        "dim": header.dim,
        "dtype": str(np.dtype(header.dtype)),
        "round_base": 1,
        "device_id_base": 0,
    }
    attrs.update(header.attrs)
    for key, value in attrs.items():
        f.attrs[key] = value
    for col in columns(header.n_devices, header.dim, header.dtype) + header.extra_columns:
        # a large federation's per-device rows are mostly the same few values: deflated, as HDF5 1.10's tools
        # (and every reader through HDF5) read them
        squeeze = ({"compression": "gzip", "compression_opts": 1, "shuffle": True}
                   if header.n_devices >= schema.COMPRESS_FROM and tuple(col.row_shape) == (header.n_devices,) else {})
        # a large federation's row is indexed by a B-tree of the chunks written (HDF5 picks one for two unlimited
        # dimensions), not an array of every chunk of every row: the index grows with the rounds' devices, not N
        maxshape = (None,) + ((None,) if schema.sparse_rows(tuple(col.row_shape)) else tuple(col.row_shape))
        ds = f.create_dataset(
            col.path, shape=(0,) + col.row_shape, maxshape=maxshape, dtype=col.dtype,
            chunks=_chunk(col.row_shape), fillvalue=col.fill, **squeeze,
        )
        ds.attrs["rows"] = col.rows
        ds.attrs["meaning"] = col.meaning
        if col.path in EVALUATED and "eval_devices" in header.attrs:
            ds.attrs["evaluated_on"] = (f"a fixed sample of {header.attrs['eval_devices']} of the {header.n_devices} "
                                        "devices ([log] eval_devices: drawn uniformly once from the stream "
                                        "(seed, evaluation-sample)), weighted as the objective weighs them")
    _write_restarts(f, header.restarts)
    f.create_dataset("devices/n_train", data=np.asarray(header.n_train, dtype=np.int64))
    f["devices/n_train"].attrs["meaning"] = "training samples n_k of each device (device_id = index)"
    if header.label_counts is not None:
        counts = np.asarray(header.label_counts, dtype=np.int64)
        if counts.size and counts.strides == (0, 0) and counts.flat[0] == -1:  # filled as devices are built
            f.create_dataset("devices/label_counts", shape=counts.shape, dtype=np.int64, fillvalue=-1,
                             chunks=(min(counts.shape[0], 64), counts.shape[1]))  # (rows scattered over N)
        else:
            f.create_dataset("devices/label_counts", data=counts)
        f["devices/label_counts"].attrs["meaning"] = ("training samples of each label on each device "
                                                      "(device_id, label)")
    if header.frozen is not None and header.frozen.size:
        f.create_dataset(FROZEN, data=header.frozen)
        f[FROZEN].attrs["meaning"] = ("the model's frozen tensors (trainable = false; a torch module's "
                                              "frozen parameters and buffers), the whole parameter vector after x: "
                                              "they never change, so they are stored once")
    state = f.create_group("state")
    state.attrs["meaning"] = "what --resume needs after the last completed round"
    state.create_dataset("round", data=np.array([-1], dtype=np.int64))
    state.attrs["slots"] = ",".join(["x"] + [name for name, _, _ in header.slots])
    for name, shape, dtype in (("x", (header.dim,), header.dtype),) + header.slots:
        state.create_dataset(name, shape=(2,) + tuple(shape), dtype=dtype)
    undo = state.create_group("undo")
    undo.create_dataset("round", data=np.array([-1], dtype=np.int64))
    undo.create_dataset("count", data=np.array([0], dtype=np.int64))
    # chunked: a round writes only its first rows (a contiguous (N,) list is 8 MB at 10^6 devices, all allocated)
    undo.create_dataset("ids", shape=(header.n_devices,), dtype=np.int64, chunks=(max(1, min(header.n_devices, 4096)),))
    for name, shape, dtype in header.row_states:
        chunks = (1,) + tuple(shape[1:])
        state.create_dataset(name, shape=shape, dtype=dtype, chunks=chunks)
        undo.create_dataset(name, shape=shape, dtype=dtype, chunks=chunks)

