"""The HDF5 run log of docs/design.md 3.4: writer, reader and resume.

Written only by the coordinator, in HDF5's single-writer/multiple-reader (SWMR) mode so the log stays
consistent and readable while the run goes on and after a kill: open it with `open_run` (or
`h5py.File(path, "r", swmr=True)`). Every round-indexed dataset grows by one row per round and says in its
`rows` attribute how rows map to rounds:

- `round`:    row i holds round i + 1 (R rows when complete), e.g. /participation/*, /metrics/lr;
- `round+1`:  row r holds round r, row 0 the start (R + 1 rows), e.g. /metrics/train_loss;
- `stored`:   one row per entry of /trajectory/round (round 0, every `log.every`-th round, and round R).

`/state` holds what a resume needs, written so that a kill at any instant leaves one consistent round:
small vectors (x, SCAFFOLD's c) alternate between two slots, round r writing slot r % 2; per-device rows
(the controls c_k, updated only for the devices that reported) are first copied to an undo area; the round
marker /state/round is written last, after a flush. Resume never writes into the killed file (a crashed
SWMR writer leaves it locked for writing): it copies the rounds that were completely logged into a fresh
file and swaps it in atomically, so nothing logged is lost if the resume itself fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import numbers
import datetime
import functools
import os
import shutil
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

try:
    import resource  # POSIX: RLIMIT_FSIZE
except ImportError:  # pragma: no cover - Windows
    resource = None

from edgefed import __version__, holds
from edgefed.algorithms.base import DeviceRows, nonzero_rows
from edgefed.errors import ResourceError, RunLogError
from edgefed.outputs import remove_stale_copies
from edgefed.errors import reading as errors_reading
from edgefed.memory import size_text  # noqa: F401 - re-exported for readers of logs

FORMAT = "edgefed-run"
FORMAT_VERSION = 1
# The file format of HDF5 1.10, the oldest that SWMR needs: the HDF5 tools Debian and Raspberry Pi OS ship
# (1.10.8: h5ls, h5dump, python3-h5py) and MATLAB's and HDFView's libraries read it; "latest" with the HDF5
# inside today's h5py wheels would write 2.0 formats they cannot (every boolean dataset, for one).
LIBVER = ("v110", "v110")

# Datasets holding measured wall time or load: the only ones that differ between two runs of one config.
MEASURED = frozenset({"participation/elapsed_s", "participation/cpu_percent", "participation/cpu_freq_mhz",
                      "participation/temperature_c", "participation/compiled", "metrics/round_elapsed_s",
                      "participation/secagg_s"})
# Root attributes measured (or estimated for this machine and world): they differ between runs of one config.
MEASURED_ATTRS = frozenset({"created", "finished", "warmup_s", "warmup_compiled", "rank_memory_estimate_mb",
                            "rank_board_memory_mb", "rank_peak_rss_mb"})
# ... and, where the clock is measured (root attribute clock = "measured"), the time the federation kept.
MEASURED_CLOCK = frozenset({"metrics/clock_s", "participation/comm_s", "participation/deadline_s",
                            "participation/core"})


def measured(attrs) -> frozenset:
    """The datasets of a log (by its root attributes) that hold measurements rather than results."""
    return MEASURED | MEASURED_CLOCK if attrs.get("clock", "measured") == "measured" else MEASURED


@dataclass(frozen=True)
class Column:
    """One round-indexed dataset: path, shape of one row, dtype, row mapping, description, and the value
    rows hold that were never written (a resumed log from before the column existed)."""

    path: str
    row_shape: tuple
    dtype: object
    rows: str
    meaning: str
    fill: object = 0


@dataclass(frozen=True)
class Header:
    config_toml: str
    seed: int
    rounds: int
    n_devices: int
    dim: int
    dtype: np.dtype
    n_train: np.ndarray
    extra_columns: tuple = ()  # more Columns (algorithms and modes beyond FedAvg)
    slots: tuple = ()  # (name, shape, dtype) of small state beyond the server model x, e.g. SCAFFOLD's c
    row_states: tuple = ()  # (name, shape, dtype) of per-device state updated by rows, e.g. the c_k
    attrs: dict = field(default_factory=dict)
    restarts: tuple = ()  # the worlds `edgefed launch` started again on this log (dicts of RESTART's fields)
    label_counts: np.ndarray | None = None  # (N, C) int64: each device's training labels (classification)
    frozen: np.ndarray | None = None  # the model's frozen tensors (trainable = false), stored once

    def __post_init__(self):
        """An algorithm's names must not take the log's own: /state holds round, x and undo/, undo/ holds
        round, count and ids beside a copy of each row state."""
        taken = {"round", "x", "undo", "count", "ids"}
        names = [name for name, _, _ in self.slots + self.row_states]
        paths = [c.path for c in columns(self.n_devices, self.dim, self.dtype) + self.extra_columns]
        clash = sorted(({*names} & taken) | {n for n in names if names.count(n) > 1}
                       | {p for p in paths if paths.count(p) > 1})
        if clash:
            raise ValueError(f"run log: the names {clash} are taken twice (the log keeps state/round, state/x, "
                             "state/undo/{round,count,ids} and its base columns); rename the algorithm's vectors")


FROZEN = "model/frozen"  # a model's frozen tensors, stored once (the whole parameter vector after x)


# One row per restart of the world by `edgefed launch`: which launch, the rounds completed when the world
# died, when (UTC), why, and the ranks of the world before and after.
RESTART = np.dtype([("launch", "S32"), ("round", "<i8"), ("time", "S32"), ("cause", "S240"),
                    ("ranks_before", "<i4"), ("ranks_after", "<i4")])


def _write_restarts(f: h5py.File, restarts) -> None:
    if not restarts:
        return
    rows = np.zeros(len(restarts), RESTART)
    for row, record in zip(rows, restarts):
        for name in RESTART.names:
            value = record[name]
            row[name] = value.encode("utf-8")[:RESTART[name].itemsize] if isinstance(value, str) else value
    ds = f.create_dataset("launch/restarts", data=rows)
    ds.attrs["meaning"] = "worlds edgefed launch started again on this log: round, time, cause, ranks before and after"


def restart_records(rows) -> tuple:
    """/launch/restarts' rows as dicts of RESTART's fields (text decoded)."""
    return tuple({name: (row[name].decode("utf-8", "replace") if RESTART[name].kind == "S" else int(row[name]))
                  for name in RESTART.names} for row in rows)


def _read_restarts(f: h5py.File) -> tuple:
    return restart_records(f["launch/restarts"][()]) if "launch/restarts" in f else ()


def exists_error(path: Path) -> RunLogError:
    return RunLogError(f"run log {path} already exists; use --resume {path} to continue it, --force to replace it, "
                       "or another --out")


def hold(path: Path, resume_point: "ResumePoint | None" = None) -> None:
    """Take the log at path for this process to write (holds.py), before its first byte: a RunLogError when a
    live process writes it already (a second writer would swap its copy in under that run), or when the log
    gained rounds since resume_point was read from it (its run ended between the two)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # (the log cannot be written there either: writing it says why)
    holder = holds.hold(path)
    if holder is not None:
        again = f"edgefed run --resume {path}" if resume_point is not None else "run it again"
        raise RunLogError(f"run log {path} is being written by {holder}, which is still running; let it finish (or "
                          f"stop it), then {again}")
    done = completed_rounds(path)  # (-1: none, or the log unreadable this moment: its reading will say)
    if resume_point is not None and done >= 0 and done != resume_point.rounds_done:
        holds.let_go(path)
        raise RunLogError(f"run log {path} gained rounds while --resume read it (its run ended just now); "
                          f"edgefed run --resume {path} again")


def let_go(path: Path) -> None:
    """This process writes the log at path no more (see hold)."""
    holds.let_go(path)


def write_stub(path: Path, config_toml: str, restarts=(), claim: bool = False) -> None:
    """A log with its config and no round, written before anything slow (building data, compiling), so a run
    killed during start-up still continues with --resume. Swapped in whole, like every log; claim: the path
    must not exist, and is taken atomically (of two runs started on one --out, one gets "already exists")."""

    def fill(f):
        for key, value in _root_attrs(config_toml, "starting").items():
            f.attrs[key] = value
        _write_restarts(f, restarts)

    _swap_in(Path(path), fill, claim)


def _swap_in(path: Path, fill, claim: bool = False) -> None:
    """Write a whole log beside path (fill(file) writes its contents), then put it in path's place: an
    existing file is only ever replaced by a complete one. claim: path must not exist; the whole file is
    linked into place atomically (of two runs starting on one --out, one gets "already exists"), so path
    never shows a partial file even to a run killed at that moment."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunLogError(f"cannot create the folder of run log {path} ({exc}); choose another --out") from None
    remove_stale_copies(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp, "w", libver=LIBVER) as f:
            fill(f)
        if claim:
            _link_new(tmp, path)
        else:
            os.replace(tmp, path)
    except OSError as exc:
        raise RunLogError(f"cannot write run log {path} ({exc}); choose another --out") from None
    finally:
        tmp.unlink(missing_ok=True)


def _link_new(tmp: Path, path: Path) -> None:
    """tmp's file at path, which must not exist: a hard link is created atomically or not at all. Where the
    file system has no hard links (FAT on a USB stick), the existence check and the rename are two steps."""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise exists_error(path) from None
    except OSError:
        pass  # no hard links here
    if path.exists():
        raise exists_error(path)
    os.replace(tmp, path)


def _root_attrs(config_toml: str, status: str) -> dict:
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "edgefed_version": __version__,
            "config": config_toml, "status": status,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def discard_stub(path: Path) -> None:
    """Remove the log at path if no round of it was run (the stub, or the log created over it, with at most round
    0, the start, in it): nothing to lose, so a failure in a run's start-up leaves nothing behind."""
    try:
        with h5py.File(path, "r") as f:
            if "state" in f:
                stub = f.attrs.get("status") == "running" and int(f["state/round"][0]) <= 0
            else:
                stub = f.attrs.get("status") == "starting"
    except (OSError, KeyError, ValueError, TypeError):
        return
    if stub:
        Path(path).unlink(missing_ok=True)


EVALUATED = ("metrics/train_loss", "metrics/test_loss", "metrics/test_accuracy")  # what [log] eval_devices samples


def columns(n: int, d: int, dtype) -> tuple[Column, ...]:
    return (
        Column("trajectory/round", (), np.int64, "stored", "rounds whose server model is stored"),
        Column("trajectory/x", (d,), dtype, "stored", "server model after those rounds (round 0: x_0)"),
        Column("participation/selected", (n,), np.bool_, "round", "device was selected (k in S_r)"),
        Column("participation/active", (n,), np.bool_, "round", "device was in the federation (k in C_r)"),
        Column("participation/budget", (n,), np.int32, "round", "local steps asked (0 if not selected)"),
        Column("participation/steps", (n,), np.int32, "round", "local steps completed s_k"),
        Column("participation/coeff", (n,), np.float64, "round", "aggregation coefficient p_k applied to Delta_k"),
        Column("participation/nonfinite", (n,), np.bool_, "round", "update had NaN/inf and was dropped"),
        Column("participation/elapsed_s", (n,), np.float32, "round", "wall time of the local work, s"),
        Column("participation/cpu_percent", (n,), np.float32, "round", "CPU share the device's work got, %"),
        Column("participation/cpu_freq_mhz", (n,), np.float32, "round", "CPU frequency after the work (NaN: unknown)"),
        Column("participation/temperature_c", (n,), np.float32, "round", "board temperature after the work (NaN: unknown)"),
        Column("participation/late", (n,), np.bool_, "round", "answered after deadline + grace; its work was dropped"),
        Column("participation/compiled", (n,), np.bool_, "round",
               "the device's work included Numba compilation (a cold kernel cache; see edgefed warmup)"),
        Column("participation/deadline_s", (n,), np.float64, "round",
               "the deadline policy's deadline for the device's report, s (NaN: none, or not selected)", np.nan),
        Column("participation/comm_s", (n,), np.float32, "round",
               "model out to report in, less the local work: links and waiting, s (NaN: unknown)", np.nan),
        Column("participation/core", (n,), np.int16, "round",
               "the core a device's deadline-bound work ran on (-1: not pinned, or not a measured deadline)", -1),
        Column("participation/bytes_up", (n,), np.int64, "round",
               "payload of the device's report as it travelled ([compress] uplink; 0: no work sent)"),
        Column("participation/bytes_down", (n,), np.int64, "round",
               "payload of the round's model broadcast to the device ([compress] downlink; 0: not selected)"),
        Column("metrics/lr", (), np.float64, "round", "local learning rate used in the round"),
        Column("metrics/n_applied", (), np.int32, "round",
               "devices whose update was applied (0: the model did not change, e.g. Scheme A with K_r = 0)"),
        Column("metrics/round_elapsed_s", (), np.float64, "round", "wall time of the whole round, s"),
        Column("metrics/clock_s", (), np.float64, "round+1",
               "the federation's time at the end of the round, s (attribute clock: measured, simulated, replayed)",
               np.nan),
        Column("metrics/train_loss", (), np.float64, "round+1", "global objective at x_r (NaN: not evaluated)"),
        Column("metrics/test_loss", (), np.float64, "round+1", "mean loss on held-out data (NaN: none)"),
        Column("metrics/test_accuracy", (), np.float64, "round+1", "accuracy on held-out data (NaN: none)"),
    )


COMPRESS_FROM = 10_000  # devices from which the (R, N) datasets are stored deflated


def _chunk(row_shape: tuple) -> tuple:
    """Several small rows per chunk; a large row is chunked along its last axis only."""
    per_row = int(np.prod(row_shape, dtype=np.int64)) if row_shape else 1
    if per_row > 65536 and len(row_shape) > 1:
        return (1,) * len(row_shape) + (row_shape[-1],)
    return (max(1, min(256, 65536 // max(per_row, 1))),) + tuple(row_shape)


class RunLogWriter:
    """Appends one round at a time to an open log; flushes after every round."""

    def __init__(self, path: Path, f: h5py.File, header: Header):
        self.path = path
        self._f = f
        cols = columns(header.n_devices, header.dim, header.dtype) + header.extra_columns
        self._cols = {c.path: (f[c.path], np.dtype(c.dtype), tuple(c.row_shape)) for c in cols}
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
    def create(cls, path: str | Path, header: Header, resume: "ResumePoint | None" = None) -> "RunLogWriter":
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
        f = h5py.File(path, "r+", libver=LIBVER)
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
            _write_row(ds, n, value, dtype, row_shape)
            self._rows[name] = n + 1

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
            with h5py.File(self.path, "r+", libver=LIBVER, locking=False) as f:
                for key, value in final_attrs.items():
                    f.attrs[key] = value


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


def _write_resume_point(f: h5py.File, point: "ResumePoint") -> None:
    """Copy a resume point (completed rounds, state, marker) into a fresh, not yet swapped-in log."""
    for name, data in point.prefix.items():
        ds = f[name]
        ds.resize(data.shape[0], axis=0)
        if data.shape[0]:
            ds[...] = data

    def pad(name, obj):  # a column the resumed log's version did not write: its completed rounds hold the fill
        if isinstance(obj, h5py.Dataset) and "rows" in obj.attrs and name not in point.prefix and point.limits:
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
                   if header.n_devices >= COMPRESS_FROM and tuple(col.row_shape) == (header.n_devices,) else {})
        ds = f.create_dataset(
            col.path, shape=(0,) + col.row_shape, maxshape=(None,) + col.row_shape, dtype=col.dtype,
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
        f.create_dataset("devices/label_counts", data=np.asarray(header.label_counts, dtype=np.int64))
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


# --------------------------------------------------------------------------------------------------- reading


def open_run(path: str | Path) -> h5py.File:
    """Open a run log for reading, also while its run goes on or after the run was killed."""
    path = Path(path)
    if not path.is_file():
        raise RunLogError(f"run log {path} not found")
    cut = _cut_short(path)
    if cut is not None:  # checked here: HDF5's SWMR open skips it, and then retries the missing bytes for minutes
        raise RunLogError(f"{path} is cut short: {cut[0]} of its {cut[1]} bytes are there; the file is damaged "
                          "(copy it again)")
    try:
        f = h5py.File(h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ, _swmr_access()))
    except (OSError, RuntimeError):
        try:
            f = h5py.File(path, "r")
        except OSError as exc:
            if _is_hdf5(path):
                raise _damaged(path, exc) from None
            raise RunLogError(f"{path} is not an HDF5 file ({exc}); give an edgefed run log") from None
        except RuntimeError as exc:
            raise _damaged(path, exc) from None
    try:
        fmt = f.attrs.get("format")
    except (OSError, RuntimeError, KeyError) as exc:
        f.close()
        raise _damaged(path, exc) from None
    if fmt != FORMAT:
        f.close()
        raise RunLogError(f"{path} is not an edgefed run log (no format = \"{FORMAT}\" attribute)")
    version = int(f.attrs.get("format_version", -1))
    if version > FORMAT_VERSION:
        f.close()
        raise RunLogError(f"{path} has log format {version}, newer than this edgefed reads ({FORMAT_VERSION}); upgrade")
    return f


READ_ATTEMPTS = 16  # a SWMR reader re-reads metadata whose checksum fails (the writer may be mid-write)


@functools.lru_cache(maxsize=None)
def _swmr_access():
    """File access for SWMR reads with READ_ATTEMPTS tries instead of HDF5's 100, which on a file whose
    metadata is damaged back off for minutes. h5py does not expose H5Pset_metadata_read_attempts, so it is
    called in the HDF5 library h5py itself loaded; where that cannot be found, HDF5's default stays."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_file_locking(False, True)  # a reader takes no lock, so it never stands in the writer's way
    try:
        with open("/proc/self/maps") as maps:
            libs = sorted({line.split()[-1] for line in maps if "libhdf5" in line and "_hl" not in line
                           and ".so" in line})
        setter = ctypes.CDLL(libs[0]).H5Pset_metadata_read_attempts
        setter.argtypes, setter.restype = [ctypes.c_int64, ctypes.c_uint], ctypes.c_int
        setter(fapl.id, READ_ATTEMPTS)
    except (OSError, IndexError, AttributeError):
        pass
    return fapl


def _is_hdf5(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89HDF\r\n\x1a\n"


def _damaged(path, exc: BaseException) -> RunLogError:
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return RunLogError(f"{path} is damaged: HDF5 cannot read its metadata ({detail}); copy it again, or resume "
                       "from another copy")


def _lacks(path, exc: KeyError, what: str) -> RunLogError:
    """h5py's KeyError: a dataset that is not there, or one whose metadata is damaged."""
    if "checksum" in str(exc):
        return _damaged(path, exc)
    return RunLogError(f"{path} lacks {exc.args[0]}; it is not {what}")


def nonfinite_counts(data) -> dict:
    """Of a log's rounds (its datasets by name; an older log may lack them): the reports dropped as non-finite
    in all, the rounds in which any were, and the rounds that applied no update."""
    nonfinite, applied = data.get("participation/nonfinite"), data.get("metrics/n_applied")
    dropped = np.zeros(0, np.int64) if nonfinite is None else np.asarray(nonfinite).sum(axis=1)
    return {"reports": int(dropped.sum()), "rounds": int(np.count_nonzero(dropped)),
            "no_update": 0 if applied is None else int(np.count_nonzero(np.asarray(applied) == 0))}


ATTR_TYPES = {"rounds": numbers.Integral, "n_devices": numbers.Integral, "dim": numbers.Integral,
              "seed": numbers.Integral, "config": str, "status": str}  # root attributes every reader relies on


def root_attrs(f: h5py.File, path) -> dict:
    """The log's root attributes, those every reader relies on checked for their types (a damaged or foreign
    file is one line, not a failure wherever it is first used)."""
    attrs = dict(f.attrs)
    for key, kind in ATTR_TYPES.items():
        if key in attrs and not isinstance(attrs[key], kind):
            raise RunLogError(f"{path}: its attribute {key} is {attrs[key]!r}, not {'an integer' if kind is not str else 'text'}"
                              "; it is not an edgefed run log (or it is damaged)")
    return attrs


SCHEMA_DATASETS = tuple(c.path for c in columns(1, 1, np.float32)) + (
    "devices/n_train", "devices/label_counts", "state/round", "state/x", "state/undo/round", "state/undo/count",
    "state/undo/ids")  # every log's (an older one may lack some)


def _require_datasets(f: h5py.File, path, names, missing_ok: bool = False) -> None:
    """A log whose expected dataset is missing (unless missing_ok), or a group in its place, is refused in one
    line (what a resume reads must be there: failing half-way would leave the run neither resumed nor as it
    was)."""
    for name in names:
        found = f.get(name)
        if not isinstance(found, h5py.Dataset) and not (missing_ok and found is None):
            what = "lacks" if found is None else "has a group, not a dataset, at"
            raise RunLogError(f"{path} {what} {name}; it is not an edgefed run log (or it is damaged)")


@contextlib.contextmanager
def reading(path: str | Path):
    """open_run for a read that ends with the file: h5py's errors of a damaged file become one RunLogError, and
    a group where the schema has a dataset is refused before anything reads it."""
    f = open_run(path)
    try:
        with errors_reading(path):
            _require_datasets(f, path, SCHEMA_DATASETS, missing_ok=True)
            yield f
    except (OSError, RuntimeError) as exc:  # what h5py raises for bytes that are not what the metadata says
        raise _damaged(path, exc) from None
    except KeyError as exc:
        raise _lacks(path, exc, "an edgefed run log") from None
    finally:
        f.close()


def _cut_short(path: Path) -> tuple[int, int] | None:
    """(bytes present, bytes the superblock says the file has) when the file is shorter than its superblock
    says. Version 2 and 3 superblocks (every edgefed log): signature, version, offset and length sizes,
    flags, then base, extension and end-of-file addresses. A log being written grows first and records its
    end at each flush, so a healthy log is never short."""
    with open(path, "rb") as f:
        head = f.read(48)
    if len(head) < 12 or head[:8] != b"\x89HDF\r\n\x1a\n" or head[8] not in (2, 3):
        return None
    size_of_offsets = head[9]
    at = 12 + 2 * size_of_offsets
    stored = int.from_bytes(head[at:at + size_of_offsets], "little")
    present = path.stat().st_size
    return (present, stored) if present < stored else None


def completed_rounds(path: str | Path) -> int:
    """The log's last completed round, read as a watcher would while the run goes on; -1 when there is none
    yet (no file, a stub, a file that cannot be read now)."""
    try:
        with reading(path) as f:
            return int(f["state/round"][0]) if "state/round" in f else -1
    except (RunLogError, OSError, KeyError):
        return -1


def run_status(path: str | Path) -> str | None:
    """The log's status attribute (starting, running, complete), or None when it cannot be read now."""
    try:
        with reading(path) as f:
            return str(f.attrs.get("status"))
    except (RunLogError, OSError, KeyError):
        return None


def read_run(path: str | Path, state: bool = True) -> dict:
    """Every dataset (path -> array) and the root attributes (under "attrs") of a run log. A log whose run
    goes on is read up to its last completed round (the marker is read first, and the rows written after it
    are left out), so every dataset agrees on the rounds. state=False leaves /state out (what only --resume
    needs: at a million devices its per-device rows read whole are gigabytes of zeros)."""
    with reading(path) as f:
        out = {"attrs": root_attrs(f, path)}
        limits = _completed(f)
        for name in _dataset_names(f, state):
            out[name] = _take(f[name], limits)
    return out


class LazyRun(Mapping):
    """read_run's mapping without /state, each dataset read when first asked for (and kept): a summary of a
    million-device log reads the few (R, N) datasets it shows, not the twenty the log holds."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with reading(path) as f:
            self._data = {"attrs": root_attrs(f, path)}
            self._limits = _completed(f)
            self._names = _dataset_names(f, state=False)

    def __getitem__(self, name: str):
        if name not in self._data:
            if name not in self._names:
                raise KeyError(name)
            with reading(self.path) as f:
                self._data[name] = _take(f[name], self._limits)
        return self._data[name]

    def __contains__(self, name) -> bool:
        return name == "attrs" or name in self._names

    def __iter__(self):
        return iter(["attrs", *self._names])

    def __len__(self) -> int:
        return 1 + len(self._names)


def _completed(f: h5py.File) -> dict | None:
    """Rows to keep per row mapping in a log whose run goes on (None: a finished log, all of them)."""
    if "state/round" in f and "trajectory/round" in f and f.attrs.get("status") != "complete":
        done = int(f["state/round"][0])
        if done >= 0:
            stored = f["trajectory/round"][()]
            return {"round": done, "round+1": done + 1, "stored": int(np.searchsorted(stored, done, side="right"))}
    return None


def _dataset_names(f: h5py.File, state: bool) -> list[str]:
    names = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) and (
        state or not name.startswith("state/")) else None)
    return names


def _take(ds: h5py.Dataset, limits: dict | None) -> np.ndarray:
    rows = ds.attrs.get("rows") if limits is not None else None
    return ds[: limits[rows]] if rows in (limits or {}) else ds[()]


@dataclass(frozen=True)
class ResumePoint:
    config_toml: str
    rounds_done: int
    state: dict
    prefix: dict
    complete: bool
    limits: dict = field(default_factory=dict)  # rows kept per row mapping ("round", "round+1", "stored")
    attrs: dict = field(default_factory=dict)  # the log's root attributes (e.g. the deadlines it ran with)
    restarts: tuple = ()  # the log's /launch/restarts
    fresh: bool = False  # no round completed (killed during start-up): the run starts from the beginning
    n_train: np.ndarray | None = None  # /devices/n_train: what the run's data gave each device


def read_resume_point(path: str | Path) -> ResumePoint:
    """What a killed run had completely logged: its config, last round, state and dataset prefixes."""
    with reading(path) as f:
        config_toml, restarts = str(f.attrs.get("config", "")), _read_restarts(f)
        if "state" not in f and f.attrs.get("status") == "starting":  # a stub: killed before its first round
            return ResumePoint(config_toml, 0, {}, {}, False, attrs=root_attrs(f, path), restarts=restarts,
                               fresh=True)
        _require_datasets(f, path, ["state/round", "trajectory/round", "state/undo/round", "state/undo/count",
                                    "state/undo/ids", *(f"state/{name}" for name in
                                                        str(f["state"].attrs.get("slots", "x")).split(","))])
        done = int(f["state/round"][0])
        stored = f["trajectory/round"][()]
        if done < 0:  # created, killed before round 0 was written: start from the beginning
            return ResumePoint(config_toml, 0, {}, {}, False, attrs=root_attrs(f, path), restarts=restarts,
                               fresh=True)
        n_stored = int(np.searchsorted(stored, done, side="right"))
        limits = {"round": done, "round+1": done + 1, "stored": n_stored}
        prefix = {}

        def take(name, obj):
            if isinstance(obj, h5py.Dataset) and "rows" in obj.attrs:
                prefix[name] = obj[: limits[obj.attrs["rows"]]]

        f.visititems(take)
        st = f["state"]
        slots = st.attrs["slots"].split(",")
        state = {name: st[name][done % 2] for name in slots}
        for name in st["undo"]:
            if name in ("round", "count", "ids"):
                continue
            rows = stored_rows(st[name])
            if int(st["undo/round"][0]) == done + 1:  # killed while writing round done + 1: roll its rows back
                count = int(st["undo/count"][0])
                rows = rows.updated(st["undo/ids"][:count], st[f"undo/{name}"][:count]).nonzero()
            state[name] = rows
        n_train = f["devices/n_train"][()] if isinstance(f.get("devices/n_train"), h5py.Dataset) else None
        return ResumePoint(config_toml, done, state, prefix, f.attrs.get("status") == "complete",
                           limits, root_attrs(f, path), restarts, n_train=n_train)


@dataclass(frozen=True)
class RecordedParticipation:
    """Who was selected, how many steps each completed, whose report came too late, and the time it all
    took, round by round, in a run log (clock and comm are None in logs written before they existed)."""

    selected: np.ndarray  # (R, N) bool
    steps: np.ndarray  # (R, N) int32
    budget: np.ndarray  # (R, N) int32
    late: np.ndarray  # (R, N) bool
    config_toml: str
    clock_s: np.ndarray | None = None  # (R + 1,)
    comm_s: np.ndarray | None = None  # (R, N)
    overselected: bool = False  # its late devices were surplus (over-selection), not part of the round's weights
    staleness: np.ndarray | None = None  # (R, N) int32 of an async run (its rows are server updates); else None
    candidate: np.ndarray | None = None  # (R, N) bool: a selection policy's considered devices; None: uniform
    utility: np.ndarray | None = None  # (R, N) float64: their scores


def no_round_yet(path, attrs, data: dict | None = None) -> RunLogError | None:
    """The error for a log with no round in it: a stub (a run stopped during start-up, a config and nothing
    else), or a log killed before its start was written."""
    empty = data is not None and "metrics/train_loss" in data and data["metrics/train_loss"].size == 0
    if attrs.get("status") == "starting" or empty:
        return RunLogError(f"{path} holds no round yet: its run was stopped during start-up; "
                           f"edgefed run --resume {path} starts it")
    return None


def read_participation(path: str | Path) -> RecordedParticipation:
    with reading(path) as f:
        stub = no_round_yet(path, f.attrs)
        if stub is not None:
            raise stub
        try:
            p = f["participation"]
            late = p["late"][()] if "late" in p else np.zeros(p["selected"].shape, bool)
            rounds = p["selected"].shape[0]
            clock = f["metrics/clock_s"][()] if "metrics/clock_s" in f else None
            comm = p["comm_s"][()] if "comm_s" in p else None
            if clock is not None and (clock.shape[0] != rounds + 1 or not np.isfinite(clock).all()):
                clock = comm = None  # an older log, or one resumed from an older one: no time kept throughout
            text = str(f.attrs["config"])
            overselected = bool(f.attrs["overselected"]) if "overselected" in f.attrs else (
                tomllib.loads(text).get("participation", {}).get("overselect", 0) > 0)
            staleness = p["staleness"][()] if "staleness" in p else None
            considered = [p[name][()] if name in p else None for name in ("candidate", "utility")]
            return RecordedParticipation(p["selected"][()], p["steps"][()], p["budget"][()], late, text, clock, comm,
                                         overselected, staleness, *considered)
        except KeyError as exc:
            raise _lacks(path, exc, "an edgefed run log with participation") from None
