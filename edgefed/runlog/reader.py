"""Reading a run log: opening it (also while its run goes on, or after a kill; a damaged or foreign file is one
line), every dataset up to the last completed round, the resume point, the recorded participation."""

from __future__ import annotations

import json

import contextlib
import ctypes
import functools
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from edgefed.errors import RunLogError
from edgefed.errors import reading as errors_reading
from edgefed.runlog.rows import SparseRounds, read_sparse_rounds, stored_rows
from edgefed.runlog.schema import (ATTR_TYPES, FORMAT, FORMAT_VERSION, SCHEMA_DATASETS, restart_records, row_limits,
                                   sparse_rows)

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


def root_attrs(f: h5py.File, path) -> dict:
    """The log's root attributes, those every reader relies on checked for their types (a damaged or foreign
    file is one line, not a failure wherever it is first used)."""
    attrs = dict(f.attrs)
    for key, kind in ATTR_TYPES.items():
        if key in attrs and not isinstance(attrs[key], kind):
            raise RunLogError(f"{path}: its attribute {key} is {attrs[key]!r}, not {'an integer' if kind is not str else 'text'}"
                              "; it is not an edgefed run log (or it is damaged)")
    return attrs


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


def nonfinite_counts(data) -> dict:
    """Of a log's rounds (its datasets by name; an older log may lack them): the reports dropped as non-finite
    in all, the rounds in which any were, and the rounds that applied no update."""
    nonfinite, applied = data.get("participation/nonfinite"), data.get("metrics/n_applied")
    if isinstance(nonfinite, SparseRounds):
        dropped = np.array([ids.size for ids in nonfinite.ids], np.int64)
    else:
        dropped = np.zeros(0, np.int64) if nonfinite is None else np.asarray(nonfinite).sum(axis=1)
    return {"reports": int(dropped.sum()), "rounds": int(np.count_nonzero(dropped)),
            "no_update": 0 if applied is None else int(np.count_nonzero(np.asarray(applied) == 0))}


def last_completed_round(path: str | Path) -> int:
    """The log's last completed round, read as a watcher would while the run goes on; -1 when there is none
    yet (no file, a stub, a file that cannot be read now)."""
    try:
        with reading(path) as f:
            return int(f["state/round"][0]) if "state/round" in f else -1
    except (RunLogError, OSError, KeyError):
        return -1


def device_count(path: str | Path) -> int | None:
    """The federation's size in the log (its devices' table), or None when it holds none yet or cannot be read
    now."""
    try:
        with reading(path) as f:
            return int(f["devices/n_train"].shape[0]) if "devices/n_train" in f else None
    except (RunLogError, OSError, KeyError):
        return None


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
            return row_limits(done, f["trajectory/round"][()])
    return None


def _dataset_names(f: h5py.File, state: bool) -> list[str]:
    names = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) and (
        state or not name.startswith("state/")) else None)
    return names


def _take(ds: h5py.Dataset, limits: dict | None) -> np.ndarray:
    rows = ds.attrs.get("rows") if limits is not None else None
    return ds[: limits[rows]] if rows in (limits or {}) else ds[()]


def _read_restarts(f: h5py.File) -> tuple:
    return restart_records(f["launch/restarts"][()]) if "launch/restarts" in f else ()


@dataclass(frozen=True)
class ResumePoint:
    config_toml: str
    rounds_done: int
    state: dict
    logged: dict  # the completed rounds' rows of every per-round dataset, by path (a large federation's
    # per-device ones as runlog.rows.SparseRounds)
    complete: bool
    limits: dict = field(default_factory=dict)  # rows kept per row mapping ("round", "round+1", "stored")
    attrs: dict = field(default_factory=dict)  # the log's root attributes (e.g. the deadlines it ran with)
    restarts: tuple = ()  # the log's /launch/restarts
    fresh: bool = False  # no round completed (killed during start-up): the run starts from the beginning
    n_train: np.ndarray | None = None  # /devices/n_train: what the run's data gave each device


def read_resume_point(path: str | Path) -> ResumePoint:
    """What a killed run had completely logged: its config, last round, state and the rows of its completed rounds."""
    with reading(path) as f:
        config_toml, restarts = str(f.attrs.get("config", "")), _read_restarts(f)
        if "state" not in f and f.attrs.get("status") == "starting":  # a stub: killed before its first round
            return ResumePoint(config_toml, 0, {}, {}, False, attrs=root_attrs(f, path), restarts=restarts,
                               fresh=True)
        _require_datasets(f, path, ["state/round", "trajectory/round", "state/undo/round", "state/undo/count",
                                    "state/undo/ids", *(f"state/{name}" for name in
                                                        str(f["state"].attrs.get("slots", "x")).split(","))])
        done = int(f["state/round"][0])
        if done < 0:  # created, killed before round 0 was written: start from the beginning
            return ResumePoint(config_toml, 0, {}, {}, False, attrs=root_attrs(f, path), restarts=restarts,
                               fresh=True)
        limits = row_limits(done, f["trajectory/round"][()])
        logged = {}
        n_devices = f["devices/n_train"].shape[0] if "devices/n_train" in f else None

        def take(name, obj):
            if isinstance(obj, h5py.Dataset) and "rows" in obj.attrs:
                rows = limits[obj.attrs["rows"]]
                per_device = obj.attrs["rows"] == "round" and obj.shape[1:] == (n_devices,)  # (not a model's columns)
                if per_device and sparse_rows(tuple(obj.shape[1:])) and obj.chunks is not None \
                        and obj.chunks[1] < obj.shape[1]:
                    logged[name] = read_sparse_rounds(obj, rows, obj.fillvalue.item())  # (never R x N values)
                else:
                    logged[name] = obj[:rows]

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
        return ResumePoint(config_toml, done, state, logged, f.attrs.get("status") == "complete",
                           limits, root_attrs(f, path), restarts, n_train=n_train)


def no_round_yet(path, attrs, data: dict | None = None) -> RunLogError | None:
    """The error for a log with no round in it: a stub (a run stopped during start-up, a config and nothing
    else), or a log killed before its start was written."""
    empty = data is not None and "metrics/train_loss" in data and data["metrics/train_loss"].size == 0
    if attrs.get("status") == "starting" or empty:
        return RunLogError(f"{path} holds no round yet: its run was stopped during start-up; "
                           f"edgefed run --resume {path} starts it")
    return None


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
    energy_j: np.ndarray | None = None  # (R, N) float64: each device-round's energy; None: not logged
    away: tuple = ()  # the boards away as it ran ([[mpi.away]] entries as dicts: devices, round, back)
    width: np.ndarray | None = None  # (R, N) float64: each device-round's submodel width; None: not logged


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
            considered = [p[name][()] if name in p else None for name in ("candidate", "utility", "energy_j")]
            away = tuple(json.loads(str(f.attrs["away"]))) if "away" in f.attrs else ()
            return RecordedParticipation(p["selected"][()], p["steps"][()], p["budget"][()], late, text, clock, comm,
                                         overselected, staleness, *considered, away,
                                         p["width"][()] if "width" in p else None)
        except KeyError as exc:
            raise _lacks(path, exc, "an edgefed run log with participation") from None

