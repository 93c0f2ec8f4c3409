"""Per-device rows of a run log's datasets at HDF5's low level: one row, runs of rows, the stored rows of a
sparse state (the rows that are not zero, read where HDF5 allocated chunks)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import h5py
import numpy as np

from edgefed.algorithms.base import DeviceRows, nonzero_rows
from edgefed.ids import find

@functools.lru_cache(maxsize=None)
def _memory_layout(dtype: np.dtype, row_shape: tuple):
    """(memory space, memory type) of one row: made once, since h5py would otherwise derive both on every
    write (~25 of its ~60 us)."""
    return h5py.h5s.create_simple((1,) + row_shape), h5py.h5t.py_create(dtype)


def _write_row(ds: h5py.Dataset, index: int, value, dtype, row_shape: tuple | None = None) -> None:
    """ds[index] = value through h5py's low-level API (the high-level path costs ~0.3 ms per call)."""
    row_shape = tuple(ds.shape[1:]) if row_shape is None else tuple(row_shape)
    dtype = np.dtype(dtype)
    row = np.ascontiguousarray(value, dtype=dtype).reshape((1,) + row_shape)
    file_space = ds.id.get_space()
    file_space.select_hyperslab((index,) + (0,) * len(row_shape), (1,) + row_shape)
    mem_space, mem_type = _memory_layout(dtype, row_shape)
    ds.id.write(mem_space, file_space, row, mtype=mem_type)


@dataclass(frozen=True)
class Scattered:
    """A per-device row given at some devices only (a round's): `values` at the ascending `ids`, `rest`
    everywhere else; a large federation's log writes the ids alone where `rest` is the dataset's fill."""

    n: int
    ids: np.ndarray
    values: object
    rest: object

    def dense(self, dtype) -> np.ndarray:
        row = np.full(self.n, self.rest, dtype=dtype)
        row[self.ids] = self.values
        return row


@dataclass(frozen=True)
class SparseRounds:
    """A large federation's (R, N) per-device dataset as a resume reads it: each round's devices whose value is
    not the dataset's fill, and their values (what the round wrote), never R x N values."""

    n: int
    ids: tuple  # each round's device ids, ascending
    values: tuple  # their values, in that order
    fill: object

    @property
    def shape(self) -> tuple:
        return (len(self.ids), self.n)

    def at(self, r: int, device_ids) -> np.ndarray:
        """Round r's values of these devices (the fill where the round wrote none)."""
        ids, values = self.ids[r], self.values[r]
        device_ids = np.asarray(device_ids, np.int64)
        out = np.full(device_ids.size, self.fill, values.dtype)
        at, hit = find(ids, device_ids)
        out[hit] = values[at[hit]]
        return out


def round_ids(data, r: int) -> np.ndarray:
    """The devices whose value in round r is not the fill (a bool dataset: those true), of an (R, N) dataset as
    read whole or as SparseRounds."""
    return data.ids[r] if isinstance(data, SparseRounds) else np.flatnonzero(data[r])


def round_values(data, r: int, device_ids) -> np.ndarray:
    """Round r's values of these devices, of an (R, N) dataset as read whole or as SparseRounds."""
    return data.at(r, device_ids) if isinstance(data, SparseRounds) else data[r, device_ids]


def read_sparse_rounds(ds: h5py.Dataset, rows: int, fill) -> SparseRounds:
    """The first `rows` rows of a large federation's (R, N) dataset, their values other than the fill: each row's
    written chunks read in one selection (chunks found in HDF5's index; a build without chunk_iter reads each
    row whole)."""
    n, width = ds.shape[1], ds.chunks[1]
    rows = min(rows, ds.shape[0])
    columns = [[] for _ in range(rows)]
    if hasattr(ds.id, "chunk_iter"):
        if ds.id.get_num_chunks():
            ds.id.chunk_iter(lambda info: columns[info.chunk_offset[0]].append(info.chunk_offset[1])
                             if info.chunk_offset[0] < rows else None)
    else:
        columns = [list(range(0, n, width)) for _ in range(rows)]
    ids, values = [], []
    for r, starts in enumerate(columns):
        starts = sorted(starts)
        spans = [(a, min(width, n - a)) for a in starts]
        buf = np.empty(sum(c for _, c in spans), ds.dtype)
        if spans:
            file_space = ds.id.get_space()
            file_space.select_none()
            for a, c in spans:
                file_space.select_hyperslab((r, a), (1, c), op=h5py.h5s.SELECT_OR)
            ds.id.read(h5py.h5s.create_simple((buf.size,)), file_space, buf)
        where = np.concatenate([np.arange(a, a + c) for a, c in spans]) if spans else np.zeros(0, np.int64)
        differ = ~np.isnan(buf) if isinstance(fill, float) and np.isnan(fill) else buf != fill
        ids.append(where[differ].astype(np.int64))
        values.append(buf[differ])
    return SparseRounds(n, tuple(ids), tuple(values), fill)


def _is_fill(value, fill) -> bool:
    return (isinstance(fill, float) and np.isnan(fill) and np.isnan(value)) or value == fill


def write_sparse_row(ds: h5py.Dataset, index: int, value, dtype, fill) -> None:
    """Row `index` of a large federation's (R, N) dataset, its values other than the fill alone (a fresh row
    reads as the fill: HDF5 allocates only the chunks written to); a row mostly not the fill goes whole. A
    Scattered row whose rest is the fill writes its ids alone, without an N-wide array."""
    dtype = np.dtype(dtype)
    if isinstance(value, Scattered):
        if _is_fill(value.rest, fill):
            _write_points(ds, index, value.ids, np.broadcast_to(np.asarray(value.values, dtype), value.ids.shape))
            return
        value = value.dense(dtype)
    row = np.ascontiguousarray(value, dtype=dtype).reshape(-1)
    differ = ~np.isnan(row) if isinstance(fill, float) and np.isnan(fill) else row != fill
    ids = np.flatnonzero(differ)
    if ids.size > row.size // 16:
        _write_row(ds, index, row, dtype, row.shape)
        return
    _write_points(ds, index, ids, row[ids])


def _write_points(ds: h5py.Dataset, index: int, ids: np.ndarray, values: np.ndarray) -> None:
    """Row `index` at these devices only."""
    if not ids.size:
        return
    file_space = ds.id.get_space()
    file_space.select_elements(np.column_stack([np.full(ids.size, index, np.uint64), ids.astype(np.uint64)]))
    mem_type = _memory_layout(values.dtype, ())[1]
    ds.id.write(h5py.h5s.create_simple((ids.size,)), file_space, np.ascontiguousarray(values), mtype=mem_type)


def _runs(ids: np.ndarray):
    """(first id, count, position) of each run of consecutive ids (ascending)."""
    if ids.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(ids) != 1) + 1
    starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [ids.size]])
    return [(int(ids[a]), int(b - a), int(a)) for a, b in zip(starts, ends)]


def _row_runs(ds: h5py.Dataset, ids: np.ndarray):
    """(memory space, file space, positions) of each run of consecutive ids (ascending), the file space
    selecting that run's rows: h5py's fancy indexing builds its selection in time quadratic in the ids (2 s
    for 1,000 rows of a million-row dataset, against 0.1 s a run at a time)."""
    rest = tuple(ds.shape[1:])
    file_space = ds.id.get_space()
    for first, count, at in _runs(np.asarray(ids, np.int64)):
        file_space.select_hyperslab((first,) + (0,) * len(rest), (count,) + rest)
        yield h5py.h5s.create_simple((count,) + rest), file_space, slice(at, at + count)


def read_rows(ds: h5py.Dataset, ids: np.ndarray) -> np.ndarray:
    """ds[ids] (ascending ids)."""
    out = np.empty((len(ids),) + tuple(ds.shape[1:]), ds.dtype)
    for mem_space, file_space, at in _row_runs(ds, ids):
        ds.id.read(mem_space, file_space, out[at])
    return out


def write_rows(ds: h5py.Dataset, ids: np.ndarray, rows: np.ndarray) -> None:
    """ds[ids] = rows (ascending ids)."""
    rows = np.ascontiguousarray(rows, ds.dtype)
    for mem_space, file_space, at in _row_runs(ds, ids):
        ds.id.write(mem_space, file_space, rows[at])


def stored_rows(ds: h5py.Dataset) -> DeviceRows:
    """A per-device state's rows that are not zero: only the rows ever written have a chunk in the file
    (a chunk a row), so a million-device state with a few thousand touched is read in that many rows."""
    if not hasattr(ds.id, "chunk_iter"):  # an HDF5 before 1.12.3 (a Pi's system build): read it all, in blocks
        return _nonzero_blocks(ds)
    written = []
    if ds.id.get_num_chunks():
        ds.id.chunk_iter(lambda info: written.append(info.chunk_offset[0]))
    ids = np.unique(np.asarray(written, np.int64))
    return DeviceRows(ids, read_rows(ds, ids), ds.shape[0]).nonzero()


def _nonzero_blocks(ds: h5py.Dataset, block: int = 4096) -> DeviceRows:
    ids, rows = [], []
    for first in range(0, ds.shape[0], block):
        values = ds[first:first + block]
        keep = np.flatnonzero(nonzero_rows(values))
        ids.append(first + keep)
        rows.append(values[keep])
    return DeviceRows(np.concatenate(ids or [np.zeros(0, np.int64)]).astype(np.int64),
                      np.concatenate(rows) if rows else np.zeros((0,) + ds.shape[1:], ds.dtype), ds.shape[0])

