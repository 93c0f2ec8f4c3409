"""The HDF5 run log of DESIGN 3.4: writer, reader and resume.

Written only by the coordinator, in HDF5's single-writer/multiple-reader (SWMR) mode so the log stays
consistent and readable while the run goes on and after a kill: open it with `open_run` (or
`h5py.File(path, "r", swmr=True)`). Every round-indexed dataset grows by one row per round and says in its
`rows` attribute how rows map to rounds:

- `round`:    row i holds round i + 1 (R rows when complete), e.g. /participation/*, /metrics/lr;
- `round+1`:  row r holds round r, row 0 the start (R + 1 rows), e.g. /metrics/train_loss;
- `stored`:   one row per entry of /trajectory/round (round 0, every `log.every`-th round, and round R).

Resume never writes into the killed file (a crashed SWMR writer leaves it locked for writing): it copies
the rounds that were completely logged into a fresh file and swaps it in atomically, so nothing logged is
lost if the resume itself fails.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from edgefed import __version__
from edgefed.errors import RunLogError

FORMAT = "edgefed-run"
FORMAT_VERSION = 1

# Datasets holding measured wall time or load: the only ones that differ between two runs of one config.
MEASURED = frozenset({"participation/elapsed_s", "participation/cpu_percent", "metrics/round_elapsed_s"})


@dataclass(frozen=True)
class Column:
    """One round-indexed dataset: path, shape of one row, dtype, row mapping, description."""

    path: str
    row_shape: tuple
    dtype: object
    rows: str
    meaning: str


@dataclass(frozen=True)
class Header:
    config_toml: str
    seed: int
    rounds: int
    n_devices: int
    dim: int
    dtype: np.dtype
    n_train: np.ndarray
    extra_columns: tuple = ()  # more Columns (later algorithms and modes)
    extra_state: tuple = ()  # (name, shape, dtype) beyond the server model x
    attrs: dict = field(default_factory=dict)


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
        Column("participation/cpu_percent", (n,), np.float32, "round", "CPU share of the device's process, %"),
        Column("metrics/lr", (), np.float64, "round", "local learning rate used in the round"),
        Column("metrics/round_elapsed_s", (), np.float64, "round", "wall time of the whole round, s"),
        Column("metrics/train_loss", (), np.float64, "round+1", "global objective at x_r (NaN: not evaluated)"),
        Column("metrics/test_loss", (), np.float64, "round+1", "mean loss on held-out data (NaN: none)"),
        Column("metrics/test_accuracy", (), np.float64, "round+1", "accuracy on held-out data (NaN: none)"),
    )


def _chunk(row_shape: tuple) -> tuple:
    per_row = int(np.prod(row_shape, dtype=np.int64)) if row_shape else 1
    return (max(1, min(256, 65536 // max(per_row, 1))),) + tuple(row_shape)


class RunLogWriter:
    """Appends one round at a time to an open log; flushes after every round."""

    def __init__(self, path: Path, f: h5py.File, header: Header):
        self.path = path
        self._f = f
        self.header = header
        self._cols = {c.path: c for c in columns(header.n_devices, header.dim, header.dtype) + header.extra_columns}

    # -- creation ------------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path, header: Header, prefix: dict | None = None) -> "RunLogWriter":
        """Build the log beside `path`, then swap it in: an existing file is replaced only by a whole log."""
        path = Path(path)
        if path.parent and not path.parent.exists():
            try:
                path.parent.mkdir(parents=True)
            except OSError as exc:
                raise RunLogError(f"cannot create the folder of run log {path} ({exc}); choose another --out") from None
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with h5py.File(tmp, "w", libver="latest") as f:
                _write_skeleton(f, header)
                if prefix:
                    for name, data in prefix.items():
                        ds = f[name]
                        ds.resize(data.shape[0], axis=0)
                        if data.shape[0]:
                            ds[...] = data
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise RunLogError(f"cannot write run log {path} ({exc}); choose another --out") from None
        f = h5py.File(path, "r+", libver="latest")
        f.swmr_mode = True
        return cls(path, f, header)

    # -- writing -------------------------------------------------------------------------------------
    def append(self, values: dict) -> None:
        """Append one row to each named dataset."""
        for name, value in values.items():
            ds = self._f[name]
            n = ds.shape[0]
            ds.resize(n + 1, axis=0)
            ds[n] = value

    def checkpoint(self, round_idx: int, state: dict) -> None:
        """Write the state a resume needs, then mark round_idx complete, then flush: the marker goes last."""
        for name, value in state.items():
            self._f[f"state/{name}"][...] = value
        self._f["state/round"][0] = round_idx
        self._f.flush()

    def close(self, final_attrs: dict | None = None) -> None:
        if self._f.id.valid:
            self._f.close()
        if final_attrs:
            # Attributes cannot change under SWMR; reopen normally once the writer is gone.
            with h5py.File(self.path, "r+") as f:
                for key, value in final_attrs.items():
                    f.attrs[key] = value


def _write_skeleton(f: h5py.File, header: Header) -> None:
    attrs = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "edgefed_version": __version__,
        "config": header.config_toml,
        "seed": header.seed,
        "rounds": header.rounds,
        "n_devices": header.n_devices,
        "dim": header.dim,
        "dtype": str(np.dtype(header.dtype)),
        "round_base": 1,
        "device_id_base": 0,
        "status": "running",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    attrs.update(header.attrs)
    for key, value in attrs.items():
        f.attrs[key] = value
    for col in columns(header.n_devices, header.dim, header.dtype) + header.extra_columns:
        ds = f.create_dataset(
            col.path, shape=(0,) + col.row_shape, maxshape=(None,) + col.row_shape, dtype=col.dtype,
            chunks=_chunk(col.row_shape),
        )
        ds.attrs["rows"] = col.rows
        ds.attrs["meaning"] = col.meaning
    f.create_dataset("devices/n_train", data=np.asarray(header.n_train, dtype=np.int64))
    f["devices/n_train"].attrs["meaning"] = "training samples n_k of each device (device_id = index)"
    state = f.create_group("state")
    state.attrs["meaning"] = "what --resume needs after the last completed round"
    state.create_dataset("round", data=np.array([-1], dtype=np.int64))
    for name, shape, dtype in (("x", (header.dim,), header.dtype),) + header.extra_state:
        state.create_dataset(name, shape=shape, dtype=dtype)


# --------------------------------------------------------------------------------------------------- reading


def open_run(path: str | Path) -> h5py.File:
    """Open a run log for reading, also while its run goes on or after the run was killed."""
    path = Path(path)
    if not path.is_file():
        raise RunLogError(f"run log {path} not found")
    try:
        f = h5py.File(path, "r", libver="latest", swmr=True)
    except OSError:
        try:
            f = h5py.File(path, "r")
        except OSError as exc:
            raise RunLogError(f"{path} is not an HDF5 file ({exc}); give an edgefed run log") from None
    if f.attrs.get("format") != FORMAT:
        f.close()
        raise RunLogError(f"{path} is not an edgefed run log (no format = \"{FORMAT}\" attribute)")
    version = int(f.attrs.get("format_version", -1))
    if version > FORMAT_VERSION:
        f.close()
        raise RunLogError(f"{path} has log format {version}, newer than this edgefed reads ({FORMAT_VERSION}); upgrade")
    return f


def read_run(path: str | Path) -> dict:
    """Every dataset (path -> array) and the root attributes (under "attrs") of a run log."""
    with open_run(path) as f:
        out = {"attrs": dict(f.attrs)}
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


@dataclass(frozen=True)
class ResumePoint:
    config_toml: str
    rounds_done: int
    state: dict
    prefix: dict
    complete: bool


def read_resume_point(path: str | Path) -> ResumePoint:
    """What a killed run had completely logged: its config, last round, state and dataset prefixes."""
    with open_run(path) as f:
        try:
            done = int(f["state/round"][0])
            stored = f["trajectory/round"][()]
        except KeyError as exc:
            raise RunLogError(f"{path} lacks {exc.args[0]}; it is not a resumable edgefed log") from None
        if done < 0:
            raise RunLogError(f"{path} holds no completed round; start the run again without --resume")
        n_stored = int(np.searchsorted(stored, done, side="right"))
        limits = {"round": done, "round+1": done + 1, "stored": n_stored}
        prefix = {}

        def take(name, obj):
            if isinstance(obj, h5py.Dataset) and "rows" in obj.attrs:
                prefix[name] = obj[: limits[obj.attrs["rows"]]]

        f.visititems(take)
        state = {name: f[f"state/{name}"][()] for name in f["state"] if name != "round"}
        return ResumePoint(str(f.attrs["config"]), done, state, prefix, f.attrs.get("status") == "complete")
